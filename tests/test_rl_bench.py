"""`make bench-rl` (recipe.rl.bench): the levels run 0, 1, 2, 1, 0 and each level's figures are the mean of its
runs, so that a machine that slows down (or speeds up) over the bench leaves the ratios to level 0 as they are.
The bench's order and sums are checked on faked runs; one real run goes through the process each run gets."""
import json

import pytest

from recipe.config import load_config
from recipe.data.schema import write_rows
from recipe.runs import Stage, stage_dir, write_atomic
from tests.test_rl_bench_trl import math_rows, sft_done  # noqa: F401 (a fixture)

STEP_S = {0: 2.0, 1: 1.0, 2: 0.8}  # each level's step on a machine that keeps its speed


def test_levels_run_a_b_c_b_a_and_a_steady_drift_leaves_the_ratios_as_they_are(tmp_path, monkeypatch):
    from recipe.rl import bench

    args = [f"run_root={tmp_path / 'runs'}"]
    cfg = load_config(args)
    data = stage_dir(cfg, "data")
    sha = write_rows(math_rows("eval", 4), data / "eval.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"eval.parquet": {"rows": 4, "sha256": sha}}}))
    for name in ("data", "base", "sft"):
        write_atomic(stage_dir(cfg, name) / "DONE.json", json.dumps({"config_hash": Stage(cfg, name).hash}))

    calls = []

    def fake_run(argv, level, out_dir):
        slower = 1 + 0.1 * len(calls)  # the machine slows by a tenth of a step's time with every run
        calls.append((level, out_dir.name))
        step = STEP_S[level] * slower
        return {"max_async_level": level, "load_avg_1m_at_start": 1.0 + len(calls), "steps": 40, "samples": 5120,
                "wall_s": 40 * step, "mean_step_s": step, "steps_per_hour": 3600 / step,
                "reward_second_half": 0.5 + 0.01 * len(calls), "reward_second_half_se": 0.02,
                "held_out_avg": 0.6, "held_out_se": 0.015, "mean_gen_busy_s": step / 2, "mean_train_s": step / 3,
                "staleness": {"0": 128, "2": 4992} if level else {"0": 5120}}

    monkeypatch.setattr(bench, "run_in_child", fake_run)
    bench.main(args)
    assert [level for level, _ in calls] == [0, 1, 2, 1, 0]
    assert len({folder for _, folder in calls}) == 5  # every run keeps its own folder

    out = json.loads((stage_dir(cfg, "bench") / "rl.json").read_text())
    assert out["order"] == [0, 1, 2, 1, 0] and len(out["runs"]) == 5
    by_level = {r["max_async_level"]: r for r in out["results"]}
    assert [r["max_async_level"] for r in out["results"]] == [0, 1, 2]
    assert by_level[1]["speedup_vs_sync"] == pytest.approx(STEP_S[0] / STEP_S[1])  # one run a level: 2 / 1.1
    assert by_level[2]["speedup_vs_sync"] == pytest.approx(STEP_S[0] / STEP_S[2])
    assert by_level[0]["runs"] == by_level[1]["runs"] == 2 and by_level[2]["runs"] == 1
    assert by_level[0]["steps_per_hour_runs"] == pytest.approx([1800, 3600 / 2.8])
    assert by_level[1]["samples"] == 10240 and by_level[1]["staleness"] == {"0": 256, "2": 9984}
    assert by_level[1]["reward_second_half"] == pytest.approx((0.52 + 0.54) / 2)
    assert by_level[1]["held_out_se"] == pytest.approx(0.015)  # two runs of the same prompts and seeds: not smaller

    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    section = report.split("## Performance: asynchronous against synchronous RL")[1].split("\n## ")[0]
    assert "The levels ran 0, 1, 2, 1, 0 in turn" in section
    assert "load 2.0, 3.0, 4.0, 5.0, 6.0 at the runs' starts" in section
    row = next(line for line in section.splitlines() if line.startswith("| 1 |"))
    assert f"| x{STEP_S[0] / STEP_S[1]:.2f} | {3600 / 1.1:.0f}, {3600 / 1.3:.0f} |" in row


def test_a_run_is_a_process_of_its_own_and_a_failed_one_stops_the_bench(sft_done, tmp_path):
    from recipe.errors import StageError
    from recipe.rl import bench

    cfg, args = sft_done
    out = bench.run_in_child(args, 1, tmp_path / "run1_async1")
    assert out["max_async_level"] == 1 and out["steps"] == 2 and out["samples"] == 2 * 2 * 2
    assert 0 <= out["held_out_avg"] <= 1 and out["steps_per_hour"] > 0
    assert len((tmp_path / "run1_async1" / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(StageError, match="level 0 run in .*run0_async0 failed"):
        bench.run_in_child([*args, "rl.max_async_level=-1"], 0, tmp_path / "run0_async0")
