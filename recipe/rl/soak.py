"""`make soak`: a long RL run with the resident memory (RSS) of every process sampled, to show it stays flat.

Runs rl.soak_steps steps of the RL loop (asynchronous, as `make rl`) from the SFT model into
runs/<preset>/bench/soak/, while a thread samples RSS every rl.soak_sample_s seconds: the stage's own process
(trainer and orchestrator), the engine process, and the sandbox's processes (the warm sandboxes and the runs
they fork) summed as one role, held to the same rule as the other two where there are any.
After a warm-up (the first fifth of the steps: allocator pools, the engine's caches and the optimizer state fill
up), each role's floor (its lowest RSS in each window of WINDOW_STEPS steps: what it keeps between bursts of
work) is fitted with a least-squares line against step; a role is flat when the line rises by less than
FLAT_SHARE of its median floor over the rest of the run (or FLAT_MB, whichever is larger: a few MB of
allocator noise is not a leak). Writes soak.json, rss.jsonl, and a figure that RESULTS.md shows.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import psutil
from omegaconf import OmegaConf

from recipe.eval.report import write_bench
from recipe.inference.worker import engine_pids
from recipe.rl.loop import run_rl
from recipe.runs import Began, require_done, stage_dir, stage_main

WARMUP_SHARE = 0.2
FLAT_SHARE = 0.05
FLAT_MB = 16.0
WINDOW_STEPS = 10
MB = 1 << 20


def _role(proc: psutil.Process, me: int, my_cmdline: list[str]) -> str:
    if proc.pid == me:
        return "trainer"
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "other"
    if proc.pid in engine_pids():  # the hf engine process, forked (the stage's command line) or spawned
        return "engine"
    # a child that is still the stage's own command line is a fork that has not yet exec'd its program (the
    # sandbox's launcher): its pages are the trainer's, shared copy-on-write, and counting them would count the
    # trainer twice
    if cmdline == my_cmdline:
        return "fork"
    cmd = " ".join(cmdline)
    # multiprocessing's resource tracker is a helper; everything else the stage starts is a sandbox run (code
    # rewards, the python tool)
    if "multiprocessing" in cmd:
        return "helper"
    return "sandbox"


class RSSSampler:
    """Samples RSS by role (trainer, engine, sandbox) of this process and all its descendants, in a thread."""

    def __init__(self, interval_s: float, step_of, out: Path):
        self.interval_s, self.step_of, self.out = interval_s, step_of, out
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._t0 = time.perf_counter()

    def sample(self) -> dict:
        me = os.getpid()
        root = psutil.Process(me)
        mine = root.cmdline()
        rss: dict[str, float] = {}
        procs: dict[str, int] = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                mb = p.memory_info().rss / MB
            except psutil.Error:  # a sandbox run that ended between listing and reading
                continue
            if mb == 0:  # exiting (its memory already given back) or exited and not yet reaped, as a closed engine
                continue
            role = _role(p, me, mine)
            procs[role] = procs.get(role, 0) + 1
            if role != "fork":
                rss[role] = rss.get(role, 0.0) + mb
        return {"t": round(time.perf_counter() - self._t0, 2), "step": self.step_of(),
                "rss_mb": {k: round(v, 2) for k, v in sorted(rss.items())}, "processes": procs}

    def _run(self) -> None:
        with self.out.open("a") as f:
            while not self._stop.is_set():
                row = self.sample()
                self.rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)


def summarize(rows: list[dict], steps: int, role: str) -> dict:
    """Growth of one role's retained memory after warm-up.

    RSS rises and falls within a step with the work in hand (a batch's activations, the engine's KV cache,
    whose size follows the completions' lengths), so its median follows the workload. What a leak raises is the
    floor: the lowest sample of each window of WINDOW_STEPS steps. A least-squares line of that floor against
    step, times the steps it covers, is the growth."""
    warm = max(1, int(steps * WARMUP_SHARE))
    pts = [(r["step"], r["rss_mb"][role]) for r in rows if r["step"] >= warm and role in r["rss_mb"]]
    windows: dict[int, list[tuple[int, float]]] = {}
    for s, v in pts:
        windows.setdefault((s - warm) // WINDOW_STEPS, []).append((s, v))
    floor = [(statistics.fmean(s for s, _ in w), min(v for _, v in w)) for _, w in sorted(windows.items())]
    if len(floor) < 3:
        return {"role": role, "samples": len(pts), "flat": None, "reason": "too few samples after warm-up"}
    xs, ys = [s for s, _ in floor], [v for _, v in floor]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in floor) / sum((x - mx) ** 2 for x in xs)
    growth = slope * (max(xs) - min(xs))
    median_floor = statistics.median(ys)
    bound = max(FLAT_SHARE * median_floor, FLAT_MB)
    values = [v for _, v in pts]
    return {"role": role, "samples": len(pts), "windows": len(floor), "warmup_steps": warm,
            "floor_first_mb": ys[0], "floor_last_mb": ys[-1], "median_floor_mb": median_floor,
            "median_mb": statistics.median(values), "max_mb": max(values),
            "slope_mb_per_100_steps": slope * 100, "growth_mb": growth, "bound_mb": bound,
            "flat": growth <= bound}


def summarize_roles(rows: list[dict], steps: int) -> list[dict]:
    """The trainer and the engine, and the sandbox's processes where the run kept them up long enough to have a
    floor (warm sandboxes stay up between runs; a run without code rewards starts none)."""
    roles = [summarize(rows, steps, r) for r in ("trainer", "engine")]
    sandbox = summarize(rows, steps, "sandbox")
    return roles + ([sandbox] if sandbox["flat"] is not None else [])


def write_figure(rows: list[dict], png: Path, warm: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    for role in sorted({k for r in rows for k in r["rss_mb"]}):
        pts = [(r["step"], r["rss_mb"][role]) for r in rows if role in r["rss_mb"]]
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=role, marker="." if role == "sandbox" else None,
                linestyle="none" if role == "sandbox" else "-")
    ax.axvline(warm, color="grey", linestyle=":", label="end of warm-up")
    ax.set(title="RSS by process during RL", xlabel="step", ylabel="MB")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80, metadata={"Software": None})
    plt.close(fig)


def run_soak(cfg, start_model: Path, out: Path, figure: Path) -> dict:
    """rl.soak_steps RL steps from start_model into `out`, RSS sampled; returns the summary (and draws the figure)."""
    steps = cfg.rl.soak_steps
    shutil.rmtree(out, ignore_errors=True)  # a soak is one uninterrupted run: a resumed one would hide growth
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"

    def step_of() -> int:
        try:
            with metrics.open("rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    run_cfg = OmegaConf.merge(cfg, {"rl": {"max_steps": steps, "checkpoint_every": steps}})
    with RSSSampler(cfg.rl.soak_sample_s, step_of, out / "rss.jsonl") as sampler:
        run_rl(run_cfg, out, start_model)
    rows = sampler.rows + [sampler.sample()]  # and one after the last step
    roles = summarize_roles(rows, steps)
    sandbox = [r["rss_mb"]["sandbox"] for r in rows if "sandbox" in r["rss_mb"]]
    warm = max(1, int(steps * WARMUP_SHARE))
    write_figure(rows, figure, warm)
    for r in roles:
        if r["flat"] is None:
            print(f"soak: {r['role']}: {r['reason']}")
        else:
            print(f"soak: {r['role']}: floor {r['floor_first_mb']:.0f} -> {r['floor_last_mb']:.0f} MB after warm-up "
                  f"(median {r['median_mb']:.0f}, peak {r['max_mb']:.0f}); growth {r['growth_mb']:+.1f} MB over "
                  f"steps {warm}-{steps} (bound {r['bound_mb']:.0f} MB): {'flat' if r['flat'] else 'GROWING'}")
    return {"steps": steps, "sample_s": cfg.rl.soak_sample_s, "samples": len(rows), "roles": roles,
            "sandbox_max_mb": max(sandbox, default=0.0), "sandbox_samples": len(sandbox),
            "flat": all(r["flat"] for r in roles)}


@stage_main
def main(cfg):
    # beside the learning curves: the repository's results/ for the default run root, else the run root's own
    root = Path(".") if cfg.run_root == "runs" else Path(cfg.run_root)
    figure = Path("results") / f"{cfg.preset}_soak.png"
    began = Began.now()
    result = run_soak(cfg, require_done(cfg, "sft") / "model", stage_dir(cfg, "bench") / "soak", root / figure)
    print(f"report: wrote {write_bench(cfg, 'soak', 'soak', {**result, 'figure': str(figure)}, began)}")


if __name__ == "__main__":
    main()
