"""The eval runner: k samples a problem on any engine, scored by the problem's environment.

Resumable per problem: every finished problem's samples are appended to samples.jsonl (completion, score and
reason), and a rerun skips the problems already there. A masked sample (the verifier could not judge it, e.g. a
broken sandbox) is written with masked=true; its problem is left out of the metrics and redone by a rerun. A
problem whose prompt plus max_new_tokens does not fit the model's context is not sampled (the engine would fail
or hang on it): it is written once with `skipped` (the reason), left out of the metrics and counted in the
results as `skipped_too_long`. The context is the engine's: the hf model's max_position_embeddings, or what the
vLLM servers take (VLLMEngine.context). A multi-turn sample whose next turn would not fit ends there, truncated,
and is scored as it stands (recipe.rollout.next_reply).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from recipe.chat import completion_text, encode_prompt, parse_final_answer
from recipe.cores import ThreadGovernor
from recipe.envs import get_env
from recipe.errors import DataError, StageError
from recipe.eval.metrics import breakdown
from recipe.inference.engine import Generator
from recipe.rollout import SamplingParams, Transcript, next_reply, score_in_threads, score_sample


def _reason(completion, reward: float, finish: str, errors: list, mask_reason: str | None = None) -> str:
    if mask_reason:
        return "masked: " + mask_reason
    if errors:
        return "verifier error: " + "; ".join(errors)
    if parse_final_answer(completion) is None:
        return "no </think>: truncated" if finish == "length" else "no </think>: format not followed"
    return "correct" if reward >= 1.0 else "wrong answer"


def load_done(path: Path, k: int) -> dict[str, list[dict]]:
    """Samples already written, by problem id; a problem counts only with all k samples (a kill mid-write)."""
    done: dict[str, list[dict]] = {}
    if path.exists():
        for n, raw in enumerate(path.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:  # a kill cuts lines, it does not write foreign bytes
                raise DataError(f"{path} line {n} is not UTF-8 text (the file is damaged): delete it to "
                                f"evaluate this checkpoint again") from None
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(rec, dict) and "id" in rec:
                done.setdefault(rec["id"], []).append(rec)
    return {pid: recs for pid, recs in done.items() if len(recs) >= k or is_skipped(recs)}


def is_masked(recs: list[dict]) -> bool:
    return any(r.get("masked") for r in recs)


def is_skipped(recs: list[dict]) -> bool:
    return any(r.get("skipped") for r in recs)


def model_context(engine) -> int | None:
    """The longest prompt plus completion the engine takes: its own `context` (the vLLM engine asks its servers),
    else max_position_embeddings of the model it holds (the hf engine); None when it says neither."""
    served = getattr(engine, "context", None)
    if served is not None:
        return served
    config = getattr(getattr(engine, "model", None), "config", None)
    return getattr(config, "max_position_embeddings", None)


def too_long(tokenizer, rows: list[dict], max_new_tokens: int, context: int | None) -> dict[str, str]:
    """id -> why, for the rows whose encoded prompt plus max_new_tokens exceeds the context (None: no limit)."""
    if context is None:
        return {}
    out = {}
    for r in rows:
        n = len(encode_prompt(tokenizer, r["prompt"]))
        if n + max_new_tokens > context:
            out[r["id"]] = (f"too long: prompt of {n} tokens plus max_new_tokens {max_new_tokens} exceeds the "
                            f"model's context ({context})")
    return out


def tool_turns(engine, tokenizer, chunk, k, prompts, completions, params, context: int | None = None) -> list:
    """Multi-turn rows: append the environment's tool reply and generate again, for every sample still calling
    a tool, until each is final; their completion becomes the whole transcript (model and environment text).
    Single-turn rows keep their completion. With `context`, a sample whose next turn would not fit ends as it
    stands, truncated."""
    out = list(completions)
    envs = [get_env(r["env"]) for r in chunk]
    ts = {}
    for j, c in enumerate(completions):
        if envs[j // k].multi_turn:
            ts[j] = Transcript()
            ts[j].add_model(c)
    active = list(ts)
    while active:
        cont = []
        for j in active:
            room = None if context is None else context - len(prompts[j]) - params.max_new_tokens
            reply = next_reply(envs[j // k], tokenizer, ts[j], chunk[j // k], room)
            if reply is not None:
                ts[j].add_env(reply)
                cont.append(j)
        if not cont:
            break
        for j, c in zip(cont, engine.generate([prompts[j] + ts[j].ids for j in cont], params)):
            ts[j].add_model(c)
        active = cont
    for j, t in ts.items():
        out[j] = t.completion()
    return out


def evaluate(engine: Generator, tokenizer, rows: list[dict], eval_cfg, out_dir: Path, desc: str = "eval",
             context: int | None = None, governor: ThreadGovernor | None = None) -> dict:
    """`context`: the model's max_position_embeddings (default: read from the engine's model, if it has one).
    `governor`: an in-process engine's torch threads set by the load before each chunk (recipe.cores).
    eval_cfg's sampling settings are the resolved ones (recipe.eval.sampling): temperature, top_p and
    max_new_tokens set; top_k None means none."""
    missing = [k for k in ("temperature", "top_p", "max_new_tokens") if getattr(eval_cfg, k) is None]
    if missing:
        raise StageError(f"{desc}: sampling setting(s) {missing} unresolved (recipe.eval.sampling resolves them)")
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "samples.jsonl"
    k = eval_cfg.samples
    context = model_context(engine) if context is None else context
    skip = too_long(tokenizer, rows, eval_cfg.max_new_tokens, context)
    if rows and len(skip) == len(rows):
        raise StageError(f"{desc}: every one of the {len(rows)} prompts plus eval.max_new_tokens "
                         f"({eval_cfg.max_new_tokens}) exceeds the model's context ({context}): lower "
                         f"max_new_tokens or use a model with a longer context")
    if skip:
        print(f"{desc}: skipping {len(skip)} of {len(rows)} problems whose prompt plus max_new_tokens "
              f"({eval_cfg.max_new_tokens}) exceeds the model's context ({context}); written as skipped to "
              f"{samples_path}", file=sys.stderr)
    # masked problems are redone: the verifier may work now; skipped ones are judged again (another context)
    done = {pid: recs for pid, recs in load_done(samples_path, k).items()
            if not is_masked(recs[:k]) and not is_skipped(recs)}
    # rewrite only complete problems, so partial lines from a killed run do not linger
    with open(samples_path, "w") as f:
        for recs in done.values():
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in recs[:k])
        f.writelines(json.dumps({"id": r["id"], "env": r["env"], "task": r["task"], "skipped": skip[r["id"]]},
                                sort_keys=True) + "\n" for r in rows if r["id"] in skip and r["id"] not in done)
    done.update({pid: [] for pid in skip})
    todo = [r for r in rows if r["id"] not in done]
    per_chunk = max(1, eval_cfg.batch_size // k)
    bar = tqdm(total=len(rows), initial=len(rows) - len(todo), desc=desc, unit="problem")
    for start in range(0, len(todo), per_chunk):
        chunk = todo[start:start + per_chunk]
        if governor is not None and governor.step() is not None:
            bar.write(f"{desc}: {governor.describe()}")
        prompts = [encode_prompt(tokenizer, r["prompt"]) for r in chunk for _ in range(k)]
        params = SamplingParams(max_new_tokens=eval_cfg.max_new_tokens, temperature=eval_cfg.temperature,
                                top_p=eval_cfg.top_p, top_k=-1 if eval_cfg.top_k is None else eval_cfg.top_k,
                                # sample s of the chunk's problem j gets seed + (first + j) * k + s: one seed per
                                # (problem, sample), whatever the batching
                                seed=eval_cfg.seed + (len(rows) - len(todo) + start) * k)
        completions = engine.generate(prompts, params)
        if any(get_env(r["env"]).multi_turn for r in chunk):
            completions = tool_turns(engine, tokenizer, chunk, k, prompts, completions, params, context)
        texts = [completion_text(tokenizer, c.token_ids) for c in completions]
        envs = [get_env(r["env"]) for r in chunk]
        scores = score_in_threads(lambda j: score_sample(envs[j // k], texts[j], chunk[j // k], completions[j]),
                                  list(range(len(completions))), lambda j: envs[j // k].score_in_parallel)
        lines = []
        for i, row in enumerate(chunk):
            for s in range(k):
                c, text, res = completions[i * k + s], texts[i * k + s], scores[i * k + s]
                lines.append({"id": row["id"], "env": row["env"], "task": row["task"], "sample": s,
                              "completion": text, "score": res.reward, "tokens": len(c.token_ids),
                              "masked": res.masked,
                              "reason": _reason(text, res.reward, c.finish_reason, res.errors, res.mask_reason)})
        with open(samples_path, "a") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in lines)
        bar.update(len(chunk))
    bar.close()
    return results_from_samples(samples_path, rows, eval_cfg)


def problem_records(samples_path: Path, rows: list[dict], k: int, done: dict | None = None
                    ) -> tuple[list[dict], list[str]]:
    """(one record of env, task and k scores per judged problem, ids of the problems with a masked sample).
    `done`: the samples already read by load_done, to read the file once."""
    done = load_done(samples_path, k) if done is None else done
    records, masked = [], []
    for r in rows:
        if is_skipped(done[r["id"]]):
            continue  # not sampled: counted as skipped_too_long
        recs = sorted(done[r["id"]], key=lambda s: s["sample"])[:k]
        if is_masked(recs):
            masked.append(r["id"])
        else:
            records.append({"env": r["env"], "task": r["task"], "scores": [s["score"] for s in recs]})
    return records, masked


def results_from_samples(samples_path: Path, rows: list[dict], eval_cfg) -> dict:
    done = load_done(samples_path, eval_cfg.samples)
    records, masked = problem_records(samples_path, rows, eval_cfg.samples, done)
    out = breakdown(records, list(eval_cfg.pass_k))
    tokens = [s["tokens"] for recs in done.values() for s in recs if "tokens" in s]
    out["mean_completion_tokens"] = sum(tokens) / max(1, len(tokens))
    if masked:  # not judged: left out of every metric above, and counted here
        out["masked_problems"] = len(masked)
    skipped = sum(1 for r in rows if is_skipped(done[r["id"]]))
    if skipped:  # not sampled (prompt too long for the context): left out of every metric, and counted here
        out["skipped_too_long"] = skipped
    return out
