"""`make soak` (recipe.rl.soak): RSS of every process sampled during RL, and the flatness verdict.

The verdict's arithmetic on series whose answer is known (flat with noise, a steady leak, warm-up growth
only), then a short real soak with the hf engine process: both roles sampled on every row, the summary and the
figure written.
"""
import json
import os
import random
import subprocess
import sys

import psutil
import pytest

from recipe import runs
from recipe.config import load_config
from recipe.envs.base import RewardResult
from recipe.envs.math import MathEnv
from recipe.rl import soak
from tests.fakes import save_tiny_qa_model, write_math_rl_data


def test_the_periodic_trim_trims_at_every_tenth_call_only(monkeypatch):
    trims = []
    monkeypatch.setattr(runs, "release_free_memory", lambda: trims.append(1))
    trim = runs.PeriodicTrim()
    assert [call for call in range(1, 32) if trim()] == [10, 20, 30]
    assert len(trims) == 3
    two = runs.PeriodicTrim(every=2)
    assert [call for call in range(1, 6) if two()] == [2, 4]
    with pytest.raises(ValueError, match="at least 1"):
        runs.PeriodicTrim(every=0)


@pytest.mark.skipif(runs._malloc_trim() is None, reason="glibc's malloc_trim only")
def test_a_trim_hands_the_freed_heap_back_to_the_os():
    rss = lambda: psutil.Process().memory_info().rss / (1 << 20)  # noqa: E731
    chunks = [b"x" * (48 << 10) for _ in range(2000)]  # about 94 MB in the heap: each under the mmap threshold
    above = b"y" * (48 << 10)  # a live chunk after them, so the heap's top cannot shrink by itself
    before = rss()
    del chunks  # freed into the heap, still resident
    kept = rss()
    runs.release_free_memory()
    after = rss()
    assert kept > before - 20, (before, kept)
    assert after < kept - 60, (kept, after)
    assert above[:1] == b"y"


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


HUGE_PAGES_PROBE = """
import os, sys, torch
from recipe.runs import HUGE_PAGES_ENV, huge_pages
with huge_pages(sys.argv[1] == "on"):
    x = torch.empty(32 << 18)  # 32 MB of float32, written so that its pages are faulted in
    x.fill_(1.0)
    huge = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")][0]
print(huge, os.environ.get(HUGE_PAGES_ENV))
"""


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or not os.path.exists("/proc/self/smaps_rollup"),
                    reason="Linux with transparent huge pages in madvise or always mode")
def test_huge_pages_back_a_fresh_processs_large_tensors_and_leave_the_environment_as_it_was():
    env = {k: v for k, v in os.environ.items() if k != runs.HUGE_PAGES_ENV}
    run = lambda mode: subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE, mode], env=env, check=True,  # noqa: E731
                                      capture_output=True, text=True).stdout.split()
    huge_kb, after = run("on")
    assert int(huge_kb) >= 2048 and after == "None", (huge_kb, after)  # the tensor in 2 MB pages; the variable gone
    if _thp_mode() == "madvise":  # (in always mode the kernel gives them to every process)
        huge_kb, _ = run("off")
        assert int(huge_kb) == 0, huge_kb


def test_the_rl_loop_runs_under_the_huge_pages_setting_of_its_config(monkeypatch, tmp_path):
    from recipe.rl import loop

    seen = []
    monkeypatch.setattr(loop, "_rl_loop", lambda *a: seen.append(os.environ.get(runs.HUGE_PAGES_ENV)))
    monkeypatch.delenv(runs.HUGE_PAGES_ENV, raising=False)
    for on in (True, False):
        loop.run_rl(load_config(["preset=tiny", "rl.pin_cores=false", f"rl.huge_pages={on}"]), tmp_path, tmp_path)
        assert runs.HUGE_PAGES_ENV not in os.environ  # put back after the loop
    assert seen == ["1", None]


def _rows(values_by_step):
    return [{"step": s, "rss_mb": {"trainer": v}} for s, v in values_by_step]


def test_bursts_are_flat_a_rising_floor_is_not_and_warm_up_growth_does_not_count():
    rnd = random.Random(0)
    # RSS samples of a step: a floor plus a burst of work of any size (activations, KV cache)
    bursts = _rows((s, 500 + rnd.choice([0, 0, rnd.uniform(0, 400)])) for s in range(0, 201) for _ in range(5))
    assert soak.summarize(bursts, 200, "trainer")["flat"] is True
    # a leak lifts the floor: 0.5 MB a step is 80 MB over steps 40-200, 16% of a 500 MB floor
    leak = _rows((s, 500 + 0.5 * s + rnd.choice([0, 300])) for s in range(0, 201) for _ in range(5))
    res = soak.summarize(leak, 200, "trainer")
    assert res["flat"] is False and 70 < res["growth_mb"] < 80 and abs(res["slope_mb_per_100_steps"] - 50) < 2
    warm = _rows((s, 300 + 5 * min(s, 30)) for s in range(0, 201))  # grows during warm-up only
    assert soak.summarize(warm, 200, "trainer")["flat"] is True
    shrinking = _rows((s, 900 - s) for s in range(0, 201))  # memory handed back is not a leak
    assert soak.summarize(shrinking, 200, "trainer")["flat"] is True
    assert soak.summarize(_rows([(50, 1.0)]), 200, "trainer")["flat"] is None  # too few samples to say


def test_the_warm_sandboxes_are_held_to_the_same_rule_where_the_run_kept_any():
    # the sandboxes' floor flat, with a run's burst now and then
    rows = [{"step": s, "rss_mb": {"trainer": 600.0, "engine": 500.0, "sandbox": 100.0 + 30.0 * (s % 10 == 4)}}
            for s in range(0, 201, 2)]
    assert [r["role"] for r in soak.summarize_roles(rows, 200)] == ["trainer", "engine", "sandbox"]
    assert soak.summarize_roles(rows, 200)[2]["flat"] is True
    leaking = [{**r, "rss_mb": {**r["rss_mb"], "sandbox": 100.0 + r["step"] * 0.5}} for r in rows]
    assert soak.summarize_roles(leaking, 200)[2]["flat"] is False
    without = [{**r, "rss_mb": {"trainer": 600.0, "engine": 500.0}} for r in rows]
    assert [r["role"] for r in soak.summarize_roles(without, 200)] == ["trainer", "engine"]


def test_a_short_soak_samples_the_trainer_and_the_engine_process(tmp_path, monkeypatch):
    # sampled every 0.02 s: the forked engine starts at once, and 5 tiny steps can take well under a second
    start = tmp_path / "start_model"
    save_tiny_qa_model(start)
    cfg = load_config([f"run_root={tmp_path / 'runs'}", "rl.soak_steps=5", "rl.soak_sample_s=0.02",
                       "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8",
                       "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.engine=hf",
                       "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0"])
    write_math_rl_data(cfg)
    # a random model never answers right: reward a property of the sampled text, so groups carry signal
    monkeypatch.setattr(MathEnv, "score", lambda self, text, row: RewardResult(float(sum(map(ord, text)) % 2)))
    figure = tmp_path / "soak.png"
    res = soak.run_soak(cfg, start, tmp_path / "soak", figure)
    rows = [json.loads(x) for x in (tmp_path / "soak" / "rss.jsonl").read_text().splitlines()]
    assert len(rows) >= 3 and rows[-1]["step"] >= 4
    # the stage's own process from the first sample; the engine process once it is up, at 10+ MB each
    assert all(r["rss_mb"]["trainer"] > 10 for r in rows)
    with_engine = [r for r in rows if "engine" in r["rss_mb"]]
    assert with_engine and all(r["rss_mb"]["engine"] > 10 and r["processes"]["engine"] == 1 for r in with_engine)
    assert [r["role"] for r in res["roles"]] == ["trainer", "engine"]
    assert figure.stat().st_size > 1000
    steps = [json.loads(x)["step"] for x in (tmp_path / "soak" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
