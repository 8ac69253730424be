"""`make bench-engine`: what one decode step of the hf engine costs, by batch size.

The RL stage's engine (rl.engine=hf) spends most of its time in decode steps (docs/performance.md), and whether
a step's cost is mostly fixed (Python and many small operations) or mostly a row's share of the work decides
what batching can win. This bench decodes the base model with recipe.inference.hf.DecodeBatch in
rl.gen_threads threads: for each batch size, prompts of PROMPT_TOKENS tokens (8 rows a prompt, as a group of
samples), no stop token (every row decodes every step), and times each step by the thread's CPU time (the wall
time beside it), WARMUP steps left out. Every batch size runs once a round, ROUNDS rounds, so a change of the
machine's load shows as a difference between rounds; where the engine decodes through its written-out step
(recipe.inference.glm4moe_step), each step is timed through transformers' forward too, right beside it. A
least-squares line through the medians gives the step's fixed cost and its cost a row. Writes
runs/<preset>/bench/engine.json and rewrites RESULTS.md.
"""
from __future__ import annotations

import time
from statistics import median

import torch

from recipe.errors import ConfigError, StageError
from recipe.eval.report import write_bench, written_out_gain
from recipe.inference.hf import DecodeBatch, HFEngine
from recipe.model import load_pretrained
from recipe.rollout import SamplingParams
from recipe.runs import Began, require_done, stage_main

PROMPT_TOKENS = 50
SAMPLES_PER_PROMPT = 8
STEPS = 40
WARMUP = 5
ROUNDS = 2


def batch_sizes(largest: int) -> list[int]:
    """1, 8, 32, 64 and the engine's batch size (rl.gen_batch_size), those up to it."""
    return sorted({r for r in (1, 8, 32, 64) if r <= largest} | {largest})


def decode_step_costs(engine: HFEngine, rows: int, steps: int = STEPS, warmup: int = WARMUP,
                      prompt_tokens: int = PROMPT_TOKENS) -> tuple[list[float], list[float]]:
    """(CPU ms, wall ms) of each of `steps` decode steps of `rows` rows, after `warmup` steps not counted."""
    if engine.stop_ids:
        raise ValueError("decode_step_costs needs an engine without stop tokens (every row decodes every step)")
    vocab = engine.model.config.vocab_size
    distinct = max(1, rows // SAMPLES_PER_PROMPT)
    prompts = [[(7 * (i % distinct) + 3 * j) % vocab for j in range(prompt_tokens)] for i in range(rows)]
    budget = warmup + steps + 1  # the last sampled token ends a row: one more than the steps timed
    params = [SamplingParams(temperature=1.0, max_new_tokens=budget, seed=i) for i in range(rows)]
    batch = DecodeBatch(engine, params[0])
    batch.admit(list(range(rows)), prompts, params)
    device = next(engine.model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # wall time of the kernels too
    cpu, wall = [], []
    for i in range(warmup + steps):
        sync()
        c, w = time.thread_time(), time.perf_counter()
        finished = batch.step()
        sync()
        c, w = time.thread_time() - c, time.perf_counter() - w
        if finished or len(batch) != rows:  # a row that left would make the later steps cheaper than `rows`
            raise StageError(f"bench-engine: a row of {rows} finished at step {i + 1} of {warmup + steps}")
        if i >= warmup:
            cpu.append(1000 * c)
            wall.append(1000 * w)
    return cpu, wall


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs points at two different x at least")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def bench(engine: HFEngine, sizes: list[int], rounds: int = ROUNDS, steps: int = STEPS,
          warmup: int = WARMUP) -> dict:
    """Every batch size once a round; per size the median CPU and wall ms a step of each round. Where the engine
    decodes through its written-out step (recipe.inference.glm4moe_step), each size is also timed through
    transformers' forward right beside it (the order of the two swapped every round): `transformers_cpu_ms`."""
    cpu = {r: [] for r in sizes}
    wall = {r: [] for r in sizes}
    both = engine.written_out_decode
    stock = {r: [] for r in sizes}
    paths = (True, False) if both else (False,)
    for round_ in range(rounds):
        for rows in sizes:
            for written in paths if round_ % 2 == 0 else paths[::-1]:
                engine.written_out_decode = written
                c, w = decode_step_costs(engine, rows, steps, warmup)
                if written == both:  # the engine's own path
                    cpu[rows].append(round(median(c), 3))
                    wall[rows].append(round(median(w), 3))
                else:
                    stock[rows].append(round(median(c), 3))
    engine.written_out_decode = both
    def line(ms: dict) -> tuple[float, float]:  # (fixed ms, us a row) through every round's median
        fixed_ms, per_row_ms = fit_line([r for r in sizes for _ in ms[r]], [v for r in sizes for v in ms[r]])
        return round(fixed_ms, 3), round(1000 * per_row_ms, 1)

    out = {"rows": sizes, "cpu_ms": {str(r): cpu[r] for r in sizes}, "wall_ms": {str(r): wall[r] for r in sizes},
           "rounds": rounds, "steps": steps, "warmup": warmup, "prompt_tokens": PROMPT_TOKENS,
           "samples_per_prompt": SAMPLES_PER_PROMPT, "decode": "written_out" if both else "transformers"}
    out["fixed_ms"], out["per_row_us"] = line(cpu)
    if both:
        out["transformers_cpu_ms"] = {str(r): stock[r] for r in sizes}
        out["transformers_fixed_ms"], out["transformers_per_row_us"] = line(stock)
    return out


@stage_main
def main(cfg):
    if cfg.rl.engine != "hf":
        raise ConfigError(f"config error: make bench-engine measures the hf engine; this preset's rl.engine is "
                          f"{cfg.rl.engine!r}")
    began = Began.now()
    torch.set_num_threads(cfg.rl.gen_threads)  # as the engine process sets itself (recipe.inference.worker)
    path = cfg.model.hub_id or str(require_done(cfg, "base") / "model")
    model, tokenizer = load_pretrained(path, cfg.model.revision, cfg.model.dtype, cfg.model.attn_implementation)
    sizes = batch_sizes(cfg.rl.gen_batch_size)
    engine = HFEngine(model, tokenizer, stop_ids=[], batch_size=max(sizes))
    out = bench(engine, sizes, ROUNDS, STEPS, WARMUP)
    out["threads"] = cfg.rl.gen_threads
    for rows in sizes:
        print(f"bench-engine: {rows:4d} rows: {' / '.join(f'{v:.2f}' for v in out['cpu_ms'][str(rows)])} ms of CPU "
              f"a decode step")
    print(f"bench-engine: about {out['fixed_ms']:.2f} ms a step plus {out['per_row_us']:.0f} us a row")
    if "transformers_cpu_ms" in out:
        for rows in sizes:
            stock = out["transformers_cpu_ms"][str(rows)]
            print(f"bench-engine: {rows:4d} rows through transformers' forward: "
                  f"{' / '.join(f'{v:.2f}' for v in stock)} ms "
                  f"(x{written_out_gain(out, rows):.2f} the written-out step)")
        print(f"bench-engine: transformers' forward: about {out['transformers_fixed_ms']:.2f} ms a step plus "
              f"{out['transformers_per_row_us']:.0f} us a row")
    print(f"bench-engine: wrote {write_bench(cfg, 'bench-engine', 'engine', out, began)}")


if __name__ == "__main__":
    main()
