"""`make bench-sft`: padded SFT batches against packed ones (sft.rows_per_sequence) and against batches whose rows
share their prompt prefixes (sft.shared_prefixes), on the same rows.

The arms train the preset's SFT from the same base model on the same random batches (same seed) for
sft.bench_steps steps: arm `padded` one row a sequence, arm `packed` sft.rows_per_sequence rows a sequence, arm
`shared` one flat sequence a batch with each prompt prefix that its rows share computed once
(recipe.sft.SharedPrefixCollator). They run in turn, padded-packed-shared twice, so that a change of the machine's
load over the bench falls on all; each arm's figures are the mean of its two runs. Reported: the padding share of
the batches, the share of the rows' tokens a shared prefix spares, trained tokens per second (the rows' tokens, no
padding, each row counted whole: the mean a step over the median step time, the first step left out), seconds a
step, the largest difference of the logged loss from the padded arm (the same rows and label tokens: the loss should
agree up to float rounding), and the parts of a step (forward and backward, optimizer, the rest) as its profile.
Results go to runs/<preset>/bench/sft.json and into RESULTS.md.
"""
from __future__ import annotations

import json
import shutil
import time
from statistics import mean, median

import torch
from omegaconf import OmegaConf
from transformers import TrainerCallback

from recipe.data.schema import read_split
from recipe.errors import ConfigError
from recipe.eval.report import write_bench
from recipe.model import load_pretrained
from recipe.runs import Began, load_avg, require_done, stage_dir, stage_main
from recipe.sft import chat_dataset, train_supervised

ORDER = ("padded", "packed", "shared", "padded", "packed", "shared")
ARMS = ("padded", "packed", "shared")


class StepParts(TrainerCallback):
    """Seconds of each step's parts: batch and forward-backward (step begin to the optimizer), optimizer step,
    the rest (logging, the step's bookkeeping)."""

    def __init__(self):
        self.parts = {"forward_backward_s": [], "optimizer_s": [], "rest_s": []}

    def on_step_begin(self, args, state, control, **kwargs):
        self.t = [time.perf_counter()]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())
        if len(self.t) == 4:
            for key, a, b in zip(self.parts, self.t, self.t[1:]):
                self.parts[key].append(b - a)


def bench_run(cfg, rows_per_sequence: int, shared_prefixes: bool, dataset, base: str, out_dir) -> dict:
    """One SFT run of sft.bench_steps steps from the base model; no checkpoint before the end."""
    train_cfg = OmegaConf.merge(cfg.sft, {"max_steps": cfg.sft.bench_steps, "rows_per_sequence": rows_per_sequence,
                                          "shared_prefixes": shared_prefixes,
                                          "save_steps": cfg.sft.bench_steps + 1, "logging_steps": 1,
                                          "adapt_threads": False})  # all arms at sft.threads, whatever the load
    shutil.rmtree(out_dir, ignore_errors=True)
    model, tokenizer = load_pretrained(base, cfg.model.revision, cfg.model.dtype, cfg.model.attn_implementation)
    load = load_avg()
    parts = StepParts()
    train_supervised(model, tokenizer, dataset, train_cfg, out_dir, use_cpu=not torch.cuda.is_available(),
                     callbacks=[parts])
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    # the median step, the first left out (warm-up): a burst of load from elsewhere moves a median little
    step_s = median([b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])])
    tokens = steps[-1]["num_tokens"]
    return {"rows_per_sequence": rows_per_sequence, "shared_prefixes": shared_prefixes, "steps": len(steps),
            "step_s": step_s, "seconds": steps[-1]["elapsed_s"], "tokens": tokens,
            "tokens_per_s": tokens / len(steps) / step_s,
            "padding": sum(r["padding"] for r in steps) / len(steps),
            "prefix_spared": sum(r.get("prefix_spared", 0.0) for r in steps) / len(steps),
            "loss": [r["loss"] for r in steps],
            # the median of each part over the steps after the first
            **{key: median(v[1:]) for key, v in parts.parts.items()},
            "load_avg_1m_at_start": load}




@stage_main
def main(cfg):
    packed_rows = cfg.sft.rows_per_sequence
    if packed_rows < 2:
        raise ConfigError(f"config error: make bench-sft compares padded batches with sft.rows_per_sequence rows a "
                          f"sequence; it is {packed_rows} in preset {cfg.preset}: pass e.g. ARGS=\"sft.rows_per_sequence=4\"")
    base = cfg.model.hub_id or str(require_done(cfg, "base") / "model")
    _, tokenizer = load_pretrained(base, cfg.model.revision, cfg.model.dtype, cfg.model.attn_implementation)
    dataset = chat_dataset(read_split(require_done(cfg, "data"), "sft"), tokenizer)
    bench_dir = stage_dir(cfg, "bench")
    began = Began.now()
    runs = []
    for i, arm in enumerate(ORDER):
        run = bench_run(cfg, packed_rows if arm == "packed" else 1, arm == "shared", dataset, base,
                        bench_dir / f"sft_{i}_{arm}")
        runs.append({"arm": arm, **run})
        print(f"bench-sft: run {i + 1}/{len(ORDER)} {arm}: {run['tokens_per_s']:.0f} tokens/s, "
              f"padding {run['padding']:.1%}, {run['step_s']:.3f} s a step")
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {"rows_per_sequence": mine[0]["rows_per_sequence"], "shared_prefixes": mine[0]["shared_prefixes"],
                     "runs": len(mine), "tokens_per_s": mean(r["tokens_per_s"] for r in mine),
                     "step_s": mean(r["step_s"] for r in mine), "padding": mean(r["padding"] for r in mine),
                     "prefix_spared": mean(r["prefix_spared"] for r in mine), "tokens": mine[0]["tokens"],
                     **{key: mean(r[key] for r in mine) for key in StepParts().parts}}
    first = {arm: next(r["loss"] for r in runs if r["arm"] == arm) for arm in ARMS}
    out = {"steps": cfg.sft.bench_steps, "batch_size": cfg.sft.batch_size, "order": list(ORDER), "runs": runs,
           "arms": arms, "speedup": arms["packed"]["tokens_per_s"] / arms["padded"]["tokens_per_s"],
           "speedup_shared": arms["shared"]["tokens_per_s"] / arms["padded"]["tokens_per_s"],
           "max_loss_difference": max(abs(x - y) for arm in ARMS[1:] for x, y in zip(first["padded"], first[arm]))}
    print(f"bench-sft: padded {arms['padded']['tokens_per_s']:.0f} tokens/s at {arms['padded']['padding']:.1%} "
          f"padding; packed {arms['packed']['tokens_per_s']:.0f} at {arms['packed']['padding']:.1%} "
          f"(x{out['speedup']:.2f}); shared prefixes {arms['shared']['tokens_per_s']:.0f} at "
          f"{arms['shared']['padding']:.1%}, {arms['shared']['prefix_spared']:.1%} of the rows' tokens spared "
          f"(x{out['speedup_shared']:.2f}); the loss of the arms differs by at most {out['max_loss_difference']:.2g}")
    write_bench(cfg, "bench-sft", "sft", out, began)


if __name__ == "__main__":
    main()
