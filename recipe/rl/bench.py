"""`make bench-rl`: asynchronous RL (max_async_level 1 and 2) against the synchronous baseline (level 0).

Same SFT start, seeds, steps and so the same sample budget; generation and training on separate cores in every
run. Reports steps per hour of each level, its ratio to level 0, and the reward at equal samples (mean training
reward over the second half of the run, and held-out avg@k of the final policy). The levels run 0, 1, 2, 1, 0 in
turn and each level's figures are the mean of its runs: a machine that speeds up or slows down over the bench
weighs on every level alike, so the ratios hold where one run of each would not. Each run is a process of its own:
what one run leaves in memory (the environments' verdicts kept by program and answer, warm sandboxes) would
otherwise speed up the runs after it on the same prompts. Results go to runs/<preset>/bench/rl.json and into the
performance section of RESULTS.md.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recipe.config import load_config
from recipe.data.schema import read_split
from recipe.eval.report import write_bench
from recipe.eval.runner import evaluate
from recipe.inference.hf import HFEngine
from recipe.rl.loop import run_rl
from recipe.runs import (Began, load_avg, require_done, run_spawned, stage_argv, stage_dir, stage_main,
                         write_atomic)

ORDER = (0, 1, 2, 1, 0)  # A-B-C-B-A: every level's runs centred on the same moment of the bench


def bench_level(cfg, level: int, out_dir, eval_rows):
    # no eval during RL: the levels are compared on their steps alone, and the final policy is evaluated below
    run_cfg = OmegaConf.merge(cfg, {"rl": {"max_async_level": level, "max_steps": cfg.rl.bench_steps,
                                           "eval_every": 0}})
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    load_at_start = load_avg()  # each level's start: what else the machine was doing as it began
    t0 = time.perf_counter()
    model_dir = run_rl(run_cfg, out_dir, require_done(cfg, "sft") / "model")
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    half = records[len(records) // 2:]
    step_s = [r["step_s"] for r in records[1:]]  # step 1 includes the engine's first fill
    torch.set_num_threads(cfg.eval.threads)
    engine = HFEngine.from_pretrained(str(model_dir), batch_size=cfg.eval.batch_size)
    held_out = evaluate(engine, engine.tokenizer, eval_rows, cfg.eval, out_dir / "eval", desc=f"eval level {level}")
    rewards = [r["reward"] for r in half]
    mean_reward = sum(rewards) / len(rewards)
    env_se = [v["stderr"] for v in held_out["env"].values()]  # held-out mean weighs environments equally
    return {
        "max_async_level": level,
        "load_avg_1m_at_start": load_at_start,
        "steps": len(records),
        "samples": len(records) * cfg.rl.batch_size * cfg.rl.rollouts_per_example,
        "wall_s": wall,
        "mean_step_s": sum(step_s) / len(step_s),
        "steps_per_hour": 3600 / (sum(step_s) / len(step_s)),
        "reward_second_half": mean_reward,
        # step rewards vary with the prompts drawn: the standard error says what "no worse" can mean
        "reward_second_half_se": math.sqrt(sum((x - mean_reward) ** 2 for x in rewards) /
                                           max(1, len(rewards) - 1) / len(rewards)),
        "held_out_avg": held_out["overall"]["avg"],
        "held_out_se": math.sqrt(sum(se ** 2 for se in env_se)) / len(env_se),
        "mean_gen_busy_s": sum(r["gen_busy_s"] for r in records) / len(records),
        "mean_train_s": sum(r["train_s"] for r in records) / len(records),
        "staleness": {k: sum(r["staleness"].get(k, 0) for r in records)
                      for k in sorted({k for r in records for k in r["staleness"]})},
    }


def run_level(argv: list[str], level: int, out_dir: str, result_path: str) -> None:
    """One run of bench_level, in the process of its own that run_in_child starts: its figures to result_path."""
    cfg = load_config(argv)
    rows = read_split(require_done(cfg, "data"), "eval")
    write_atomic(Path(result_path), json.dumps(bench_level(cfg, level, Path(out_dir), rows), indent=2))


def run_in_child(argv: list[str], level: int, out_dir: Path) -> dict:
    """bench_level in a spawned process (nothing of an earlier run in its memory); its figures."""
    return run_spawned(run_level, (argv, level, str(out_dir)), out_dir.with_suffix(".json"),
                       f"bench-rl: the level {level} run in {out_dir} failed")


def level_means(level: int, runs: list[dict]) -> dict:
    """One level's figures over its runs: means, staleness summed (with samples). The standard errors are the mean
    of the runs' own, not smaller: the runs draw the same prompts with the same seeds (level 0's are the same run
    twice, but for its timing), so they are not independent samples of the score."""
    mine = [r for r in runs if r["max_async_level"] == level]
    n = len(mine)
    mean = {k: sum(r[k] for r in mine) / n for k in
            ("mean_step_s", "reward_second_half", "held_out_avg", "mean_gen_busy_s", "mean_train_s",
             "reward_second_half_se", "held_out_se")}
    return {"max_async_level": level, "runs": n, "steps": mine[0]["steps"], "samples": sum(r["samples"] for r in mine),
            **mean, "steps_per_hour": 3600 / mean["mean_step_s"],
            "steps_per_hour_runs": [r["steps_per_hour"] for r in mine],
            "staleness": {k: sum(r["staleness"].get(k, 0) for r in mine)
                          for k in sorted({k for r in mine for k in r["staleness"]}, key=int)}}


@stage_main
def main(cfg):
    read_split(require_done(cfg, "data"), "eval")  # a missing or broken eval split stops the bench before any run
    bench_dir = stage_dir(cfg, "bench")
    began = Began.now()
    runs = []
    for i, level in enumerate(ORDER):
        runs.append(run_in_child(stage_argv(), level, bench_dir / f"run{i}_async{level}"))
        print(f"bench-rl: run {i + 1}/{len(ORDER)} level {level}: {runs[-1]['steps_per_hour']:.0f} steps/h")
    results = [level_means(level, runs) for level in sorted(set(ORDER))]
    for r in results:
        r["speedup_vs_sync"] = r["steps_per_hour"] / results[0]["steps_per_hour"]
        print(f"bench-rl: level {r['max_async_level']}: {r['steps_per_hour']:.0f} steps/h "
              f"(x{r['speedup_vs_sync']:.2f} of sync), reward {r['reward_second_half']:.3f}, "
              f"held-out {r['held_out_avg']:.3f}")
    write_bench(cfg, "bench-rl", "rl", {"order": list(ORDER), "runs": runs, "results": results}, began)


if __name__ == "__main__":
    main()
