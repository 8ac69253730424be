"""`make bench-trl`: this project's RL against TRL's GRPOTrainer on the same work.

Both arms start from the SFT model and train rl.bench_steps optimizer steps of rl.batch_size prompts x
rl.rollouts_per_example samples, rl.max_new_tokens new tokens at rl.temperature, the same LR and optimizer, drawing
prompts from the same RL rows of the environments TRL can run (math, logic, code: TRL's trainer has no tool turns,
so the tools environment sits out) in the env mix's proportions, each sample scored by the same environment code
on the same decoded text. TRL: loss_type "dapo" (token-level, as here), beta 0 (no reference model, as here),
scale_rewards "none" (advantage = reward - group mean, as here), generation with transformers in its own process
(no vLLM), gradient accumulation giving the same micro-batches.

The recipe arm runs without the online filter (rl.online_filter false, as the intellect3 preset and prime-rl's
production run), so both arms generate and update on the same samples: a group whose rewards are all equal stays in
the batch at advantage 0 in both. This recipe's trainer counts such a sample's tokens in the loss's normaliser and
skips its forward and backward (its gradient is exactly zero, recipe.rl.trainer.train_step); TRL computes them.
Where the preset filters (the tiny one does: such groups are dropped and more generated until a batch is full), a
last run, recipe_preset, trains as the preset does, reported beside the comparison with its generated completions.

What cannot be made equal, and how it is counted:
- Asynchrony: here the engine generates the next batches while the trainer takes step s (max_async_level 1 under
  prime-rl's rule: a group for step s + 1 is submitted under policy s - 1, so most samples start two policies old,
  some three when their group finished behind later ones, and the weights change under running requests); TRL is
  on-policy, generating and training in turn.
- Shared prompts: here a group's prompt is prefilled once by the engine and run once by the trainer for all its
  samples (rl.share_prompts; the same gradient); TRL runs it for every sample.
- Processes: here the engine runs in a process of its own on one core and the trainer on the other; TRL runs
  both in one process on both cores. CPU seconds (every process of the arm) are reported beside wall time.

The arms run recipe, TRL, recipe, TRL, recipe, each in a process of its own (so that its peak memory is its own:
the RSS of the arm's processes, sampled every second, and the kernel's peak of its main process), and each arm's
final policy is evaluated on the held-out rows of the same environments (avg@eval.samples, standard error over
problems). TRL's arm runs twice: on this shared 2-core machine its CPU for the same work moved by a third within an
hour (its two threads share both cores) while the recipe arm's held steady, so one TRL run could set the ratio
alone; the ratio of each TRL run to the recipe runs beside it is reported with the ratio of the means. Results go to
runs/<preset>/bench/trl.json and into RESULTS.md.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from pathlib import Path
from statistics import median

import torch
from omegaconf import OmegaConf

from recipe.chat import completion_text
from recipe.config import load_config
from recipe.data.schema import read_split
from recipe.envs import get_env
from recipe.errors import ConfigError
from recipe.eval.report import write_bench
from recipe.eval.runner import evaluate
from recipe.inference.hf import HFEngine
from recipe.model import load_pretrained
from recipe.rl.loop import run_rl
from recipe.rl.soak import RSSSampler
from recipe.runs import (Began, load_avg, require_done, run_spawned, stage_argv, stage_dir, stage_main,
                         write_atomic)
from recipe.sandbox import warm

ENVS = ("math", "logic", "code")
ORDER = ("recipe", "trl", "recipe", "trl", "recipe")  # every arm's runs centred on the same moment of the bench


def bench_order(cfg) -> tuple[str, ...]:
    """recipe, TRL, recipe, TRL, recipe; then, where the preset filters groups without signal, one run as the preset
    trains."""
    return ORDER + (("recipe_preset",) if cfg.rl.online_filter else ())


def bench_config(cfg, arm: str = "recipe"):
    """The preset's RL, for rl.bench_steps steps, on the environments both arms can run, no eval during RL; the
    recipe arm without the online filter (the same samples as TRL's), recipe_preset with the preset's."""
    mix = {e: w for e, w in cfg.rl.env_mix.items() if e in ENVS and w > 0}
    if not mix:
        raise ConfigError(f"config error: make bench-trl needs rl.env_mix to weigh one of {list(ENVS)}")
    run = OmegaConf.merge(cfg, {"rl": {"max_steps": cfg.rl.bench_steps, "eval_every": 0,
                                       "online_filter": cfg.rl.online_filter and arm == "recipe_preset"}})
    OmegaConf.set_readonly(run, False)
    run.rl.env_mix = mix  # replaced, not merged: the other environments leave the mix
    OmegaConf.set_readonly(run, True)
    return run


def trl_rows(cfg, rows: list[dict]) -> list[dict]:
    """The prompts TRL draws from: RL rows of each environment in proportion to the env mix, as many as the run
    takes (TRL walks through a shuffled dataset; the orchestrator draws environments by weight)."""
    mix = cfg.rl.env_mix
    total = cfg.rl.max_steps * cfg.rl.batch_size
    out = []
    for env, weight in mix.items():
        pool = [r for r in rows if r["env"] == env]
        want = max(1, round(total * weight / sum(mix.values())))
        out += [pool[i % len(pool)] for i in range(want)]
    return out


class StepTimes:
    """Seconds of each optimizer step of TRL's trainer (generation included: TRL generates inside the step)."""

    def __init__(self):
        from transformers import TrainerCallback

        times = self.times = []

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter() - self.t0)

        self.callback = Callback()


def run_trl(cfg, out_dir: Path, start_model: str, rows: list[dict]) -> tuple[Path, list[float], int]:
    """TRL's GRPOTrainer on the bench's work; returns the final model folder, step times and masked samples."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer


    rl = cfg.rl
    torch.manual_seed(rl.seed)
    model, tokenizer = load_pretrained(start_model, cfg.model.revision, cfg.model.dtype,
                                       cfg.model.attn_implementation)
    code = {"max_tests": rl.code_max_tests, "partial_credit": rl.code_partial_credit}
    envs = {e: get_env(e, **(code if e == "code" else {})) for e in rl.env_mix}
    by_id = {r["id"]: r for r in rows}
    masked = [0]

    def reward(prompts, completions, completion_ids, row_id, **_):
        out = []
        for ids, rid in zip(completion_ids, row_id):
            row = by_id[rid]
            result = envs[row["env"]].score(completion_text(tokenizer, list(ids)), row)
            masked[0] += result.masked
            out.append(0.0 if result.masked else result.reward)  # TRL has no masked sample: scored 0
        return out

    chosen = trl_rows(cfg, rows)
    dataset = Dataset.from_list([{"prompt": envs[r["env"]].prompt(r), "row_id": r["id"]} for r in chosen])
    micro = min(rl.micro_batch_size, rl.batch_size * rl.rollouts_per_example)
    accum = rl.batch_size * rl.rollouts_per_example // micro
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=rl.max_steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,  # one generation of batch x rollouts a step, trained in micro-batches
        num_generations=rl.rollouts_per_example, max_completion_length=rl.max_new_tokens,
        temperature=rl.temperature, top_p=1.0, top_k=0, learning_rate=rl.lr, lr_scheduler_type="constant",
        warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay, adam_beta1=rl.adam_beta1,
        adam_beta2=rl.adam_beta2, adam_epsilon=rl.adam_eps, max_grad_norm=rl.max_grad_norm,
        loss_type="dapo", beta=0.0, scale_rewards="none", num_iterations=1, use_vllm=False,
        bf16=False, use_cpu=not torch.cuda.is_available(), save_strategy="no", report_to=[], logging_steps=1,
        seed=rl.seed, disable_tqdm=False, dataloader_num_workers=0)
    steps = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[steps.callback])
    trainer.train()
    final = out_dir / "model"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    return final, steps.times, masked[0]



def run_arm(argv: list[str], arm: str, out_dir: str, result_path: str) -> None:
    """One arm, in a process of its own: train, evaluate, write its figures to result_path."""

    cfg = bench_config(load_config(argv), arm)
    rl = cfg.rl
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start_model = str(require_done(cfg, "sft") / "model")
    data = require_done(cfg, "data")
    per_step = rl.batch_size * rl.rollouts_per_example
    # RSS of this process and its descendants (the engine, sandbox runs), sampled: ru_maxrss cannot tell a child's
    # own peak from the parent's pages it was forked with
    with RSSSampler(rl.soak_sample_s, lambda: 0, out / "rss.jsonl") as sampler:
        cpu0, t0 = os.times(), time.perf_counter()
        if arm != "trl":
            model_dir = run_rl(cfg, out, start_model)
            records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            step_s = [r["step_s"] for r in records[1:]]  # step 1 includes the engine's first fill
            generated = sum(per_step + r["filtered_groups"] * rl.rollouts_per_example for r in records)
            masked = sum(r["masked_samples"] for r in records)
            steps = len(records)
        else:
            torch.set_num_threads(os.cpu_count() or 1)
            model_dir, times, masked = run_trl(cfg, out, start_model, read_split(data, "rl"))
            step_s, steps, generated = times[1:], len(times), len(times) * per_step
        wall = time.perf_counter() - t0
        warm.close_all()  # a warm sandbox's runs count in os.times once the sandbox has ended and been reaped
        cpu1 = os.times()
        cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
               - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system)
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the kernel's own peak of this process
    peak_all = max(sum(r["rss_mb"].values()) for r in sampler.rows)
    peak_engine = max(r["rss_mb"].get("engine", 0.0) for r in sampler.rows)
    torch.set_num_threads(cfg.eval.threads)
    engine = HFEngine.from_pretrained(str(model_dir), batch_size=cfg.eval.batch_size)
    rows = [r for r in read_split(data, "eval") if r["env"] in rl.env_mix]
    held_out = evaluate(engine, engine.tokenizer, rows, cfg.eval, out / "eval", desc=f"eval {arm}")
    env_se = [v["stderr"] for v in held_out["env"].values()]
    result = {
        "arm": arm, "steps": steps, "trained_completions": steps * per_step, "generated_completions": generated,
        "online_filter": rl.online_filter,
        "wall_s": wall, "cpu_s": cpu, "median_step_s": median(step_s),
        "trained_per_s": steps * per_step / wall, "trained_per_s_steady": per_step / median(step_s),
        "cpu_s_per_trained": cpu / (steps * per_step), "peak_rss_mb": peak_self, "peak_rss_all_mb": peak_all,
        "peak_rss_engine_mb": peak_engine,
        "masked_samples": masked, "held_out_avg": held_out["overall"]["avg"],
        "held_out_se": math.sqrt(sum(se ** 2 for se in env_se)) / len(env_se),
        "held_out_env": {e: v[f"avg@{cfg.eval.samples}"] for e, v in held_out["env"].items()},
        "load_avg_1m_at_end": load_avg(),
    }
    write_atomic(Path(result_path), json.dumps(result, indent=2, sort_keys=True))


def neighbour_ratios(runs: list[dict]) -> list[float]:
    """Each TRL run's trained completions/s against those of the recipe runs just before and after it, in order:
    the ratio as each moment of the bench gave it (the comparison's ratio is that of the arms' means)."""
    out = []
    for i, run in enumerate(runs):
        if run["arm"] != "trl":
            continue
        for j in (i - 1, i + 1):
            if 0 <= j < len(runs) and runs[j]["arm"] == "recipe":
                out.append(runs[j]["trained_per_s"] / run["trained_per_s"])
    return out


def bench(cfg, argv: list[str]) -> None:
    bench_config(cfg)  # a mix without any of the environments is refused before anything runs
    require_done(cfg, "sft")
    bench_dir = stage_dir(cfg, "bench")
    began = Began.now()
    runs = []
    order = bench_order(cfg)
    for i, arm in enumerate(order):
        run = run_spawned(run_arm, (argv, arm, str(bench_dir / f"trl_{i}_{arm}")), bench_dir / f"trl_{i}_{arm}.json",
                          f"bench-trl: the {arm} run ({i + 1}/{len(order)}) failed")
        runs.append(run)
        print(f"bench-trl: run {i + 1}/{len(order)} {arm}: {run['trained_per_s']:.1f} trained completions/s, "
              f"{run['cpu_s']:.0f} CPU s, held-out {run['held_out_avg']:.3f} ± {run['held_out_se']:.3f}")
    arms = {}
    for arm in dict.fromkeys(order):
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {k: sum(r[k] for r in mine) / len(mine) for k in
                     ("trained_per_s", "trained_per_s_steady", "cpu_s", "cpu_s_per_trained", "wall_s",
                      "peak_rss_mb", "peak_rss_all_mb", "peak_rss_engine_mb", "held_out_avg", "held_out_se",
                      "generated_completions")}
        arms[arm]["runs"] = len(mine)
    speedup = arms["recipe"]["trained_per_s"] / arms["trl"]["trained_per_s"]
    beside = neighbour_ratios(runs)
    gap = arms["recipe"]["held_out_avg"] - arms["trl"]["held_out_avg"]
    two_se = 2 * math.hypot(arms["recipe"]["held_out_se"], arms["trl"]["held_out_se"])
    print(f"bench-trl: x{speedup:.2f} TRL's trained completions/s; CPU seconds a trained completion "
          f"x{arms['trl']['cpu_s_per_trained'] / arms['recipe']['cpu_s_per_trained']:.2f} fewer; held-out "
          f"{arms['recipe']['held_out_avg']:.3f} against {arms['trl']['held_out_avg']:.3f} (difference {gap:+.3f}, "
          f"2 s.e. {two_se:.3f}); each TRL run against the recipe runs beside it x{min(beside):.2f} to "
          f"x{max(beside):.2f}")
    if "recipe_preset" in arms:
        arms["recipe_preset"]["speedup"] = arms["recipe_preset"]["trained_per_s"] / arms["trl"]["trained_per_s"]
        print(f"bench-trl: with the preset's online filter x{arms['recipe_preset']['speedup']:.2f} TRL's trained "
              f"completions/s, {arms['recipe_preset']['generated_completions']:.0f} generated")
    out = {"order": list(order), "runs": runs, "arms": arms, "speedup": speedup, "neighbour_ratios": beside,
           "held_out_gap": gap, "held_out_two_se": two_se, "envs": list(bench_config(cfg).rl.env_mix),
           "steps": cfg.rl.bench_steps, "batch_size": cfg.rl.batch_size,
           "rollouts_per_example": cfg.rl.rollouts_per_example, "max_new_tokens": cfg.rl.max_new_tokens}
    write_bench(cfg, "bench-trl", "trl", out, began)


@stage_main
def main(cfg):
    return bench(cfg, stage_argv())  # the raw overrides: each arm's process loads the config from them again


if __name__ == "__main__":
    main()
