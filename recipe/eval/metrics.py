"""avg@k, the unbiased pass@k estimator and standard errors, per task, per environment and overall."""
from __future__ import annotations

import math
from collections import defaultdict


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples a problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(problem_scores: list[list[float]], pass_k: list[int]) -> dict:
    """problem_scores: per problem, the score (0..1) of each sample. Correct means score >= 1 for pass@k."""
    n_prob = len(problem_scores)
    if n_prob == 0:
        return {"problems": 0}
    means = [sum(s) / len(s) for s in problem_scores]
    avg = sum(means) / n_prob
    var = sum((m - avg) ** 2 for m in means) / (n_prob - 1) if n_prob > 1 else 0.0
    k = min(len(s) for s in problem_scores)
    out = {"problems": n_prob, "samples": k, f"avg@{k}": avg, "stderr": math.sqrt(var / n_prob)}
    for kk in pass_k:
        if kk <= k:
            out[f"pass@{kk}"] = sum(pass_at_k(len(s), sum(1 for x in s if x >= 1.0), kk)
                                    for s in problem_scores) / n_prob
    return out


def breakdown(records: list[dict], pass_k: list[int]) -> dict:
    """records: one per problem with env, task and scores. Returns overall, per-env and per-task summaries."""
    by_env, by_task = defaultdict(list), defaultdict(list)
    for r in records:
        by_env[r["env"]].append(r["scores"])
        by_task[f"{r['env']}/{r['task']}"].append(r["scores"])
    envs = {e: summarize(s, pass_k) for e, s in sorted(by_env.items())}
    # overall: the mean over environments, so a large environment does not drown a small one
    key = next((k for k in next(iter(envs.values()), {}) if k.startswith("avg@")), None)
    overall = {"avg": sum(e[key] for e in envs.values()) / len(envs)} if key else {}
    return {"overall": overall, "env": envs, "task": {t: summarize(s, pass_k) for t, s in sorted(by_task.items())}}
