"""`make bench-trl` (recipe.rl.bench_trl) on a tiny model and a few math rows: five runs, recipe, TRL, recipe, TRL,
recipe, each in a process of its own, trained for the same steps of the same batch, each final policy evaluated;
bench/trl.json and RESULTS.md's section carry the figures. What is compared is checked here, not the speed itself:
on a random model the ratio means nothing (`make bench-trl` on the tiny preset gives it, in RESULTS.md)."""
import json
from pathlib import Path

import pytest

from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.runs import Stage, stage_dir, write_atomic
from tests.fakes import save_tiny_qa_model

# memory sampled every 0.05 s: the forked engine of a 2-step run lives well under a second
ARGS = ["rl.bench_steps=2", "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8",
        "rl.micro_batch_size=2", "rl.pin_cores=false", "rl.online_filter=false", "rl.gen_batch_size=4",
        "rl.soak_sample_s=0.05",
        "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0",
        "eval.samples=2", "eval.pass_k=[1,2]", "eval.max_new_tokens=8", "eval.threads=1"]


def math_rows(split, n):
    return [{"id": f"{split}{i}", "env": "math", "task": "add", "split": split, "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(n)]


@pytest.fixture
def sft_done(tmp_path):
    args = [f"run_root={tmp_path / 'runs'}", *ARGS]
    cfg = load_config(args)
    data = stage_dir(cfg, "data")
    files = {}
    for split, n in (("rl", 20), ("eval", 4)):
        files[f"{split}.parquet"] = {"rows": n, "sha256": write_rows(math_rows(split, n), data / f"{split}.parquet")}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    save_tiny_qa_model(stage_dir(cfg, "sft") / "model")
    for name in ("data", "base", "sft"):
        write_atomic(stage_dir(cfg, name) / "DONE.json", json.dumps({"config_hash": Stage(cfg, name).hash}))
    return cfg, args


def test_bench_trl_runs_both_arms_on_the_same_work(sft_done, tmp_path, monkeypatch):
    from recipe.rl import bench_trl

    cfg, args = sft_done
    monkeypatch.chdir(tmp_path)
    # three runs, not the bench's five: each costs a process start, a model load and a held-out eval (about 15 s on
    # 2 busy cores); the five-run bookkeeping is checked on stand-in runs below
    monkeypatch.setattr(bench_trl, "ORDER", ("recipe", "trl", "recipe"))
    bench_trl.main(args)
    out = json.loads((stage_dir(cfg, "bench") / "trl.json").read_text())
    assert [r["arm"] for r in out["runs"]] == ["recipe", "trl", "recipe"]
    per_step = 2 * 2
    for r in out["runs"]:
        assert r["steps"] == 2 and r["trained_completions"] == 2 * per_step
        assert r["generated_completions"] >= r["trained_completions"]
        assert r["cpu_s"] > 0 and r["peak_rss_mb"] > 0 and 0 <= r["held_out_avg"] <= 1
    # the recipe's engine is a process of its own, counted in the arm's memory; TRL generates in-process
    for r in out["runs"]:
        engine = r["peak_rss_engine_mb"]
        assert (engine > 50) if r["arm"] == "recipe" else (engine == 0)
        assert r["peak_rss_all_mb"] >= max(engine, 50)
    assert out["envs"] == ["math"] and out["arms"]["recipe"]["runs"] == 2 and out["arms"]["trl"]["runs"] == 1
    assert out["speedup"] == pytest.approx(out["arms"]["recipe"]["trained_per_s"] / out["arms"]["trl"]["trained_per_s"])
    rate = [r["trained_per_s"] for r in out["runs"]]
    assert out["neighbour_ratios"] == pytest.approx([rate[0] / rate[1], rate[2] / rate[1]])
    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    assert "## Performance: this recipe's RL against TRL's GRPOTrainer" in report
    assert f"trains **x{out['speedup']:.2f}** TRL's completions a second" in report


def test_trl_rows_follow_the_env_mix():
    from recipe.rl.bench_trl import bench_config, trl_rows

    mix = "rl.env_mix={math:0.3,logic:0.3,code:0.2,tools:0.2}"  # the preset's may change; this one is the case
    cfg = bench_config(load_config(["rl.bench_steps=10", "rl.batch_size=16", mix]))
    assert dict(cfg.rl.env_mix) == {"math": 0.3, "logic": 0.3, "code": 0.2}  # tools sits out
    rows = [{"id": f"{e}{i}", "env": e} for e in ("math", "logic", "code", "tools") for i in range(50)]
    chosen = trl_rows(cfg, rows)
    counts = {e: sum(r["env"] == e for r in chosen) for e in ("math", "logic", "code", "tools")}
    assert counts == {"math": 60, "logic": 60, "code": 40, "tools": 0}


def test_the_recipe_arm_runs_without_the_filter_and_a_last_run_as_the_preset_filters():
    from recipe.rl.bench_trl import bench_config, bench_order

    cfg = load_config(["rl.online_filter=true"])
    assert bench_order(cfg) == ("recipe", "trl", "recipe", "trl", "recipe", "recipe_preset")
    filters = [bench_config(cfg, arm).rl.online_filter for arm in ("recipe", "trl", "recipe_preset")]
    assert filters == [False, False, True]
    off = load_config(["rl.online_filter=false"])  # a preset without the filter: the recipe arm is already it
    assert bench_order(off) == ("recipe", "trl", "recipe", "trl", "recipe")
    assert not bench_config(off, "recipe_preset").rl.online_filter


def test_the_preset_run_is_reported_beside_the_comparison_not_in_it(sft_done, tmp_path, monkeypatch):
    """The bench's bookkeeping with the six runs (each arm's figures written by a stand-in for its process)."""
    from recipe import runs
    from recipe.rl import bench_trl

    cfg, args = sft_done
    args = [a for a in args if a != "rl.online_filter=false"] + ["rl.online_filter=true"]
    per_s = {"recipe": [150.0, 160.0, 155.0], "trl": [50.0, 40.0], "recipe_preset": [120.0]}

    class Child:
        def __init__(self, target, args):
            self.arm, self.result_path, self.exitcode = args[1], args[3], 0

        def start(self):
            rate = per_s[self.arm].pop(0)
            run = {"arm": self.arm, "trained_per_s": rate, "trained_per_s_steady": rate * 1.2, "cpu_s": 10.0,
                   "cpu_s_per_trained": 10.0 / 80, "wall_s": 80 / rate, "peak_rss_mb": 500.0,
                   "peak_rss_all_mb": 900.0, "peak_rss_engine_mb": 0.0 if self.arm == "trl" else 400.0,
                   "held_out_avg": 0.5, "held_out_se": 0.02, "load_avg_1m_at_end": 1.0,
                   "generated_completions": 120 if self.arm == "recipe_preset" else 80}
            write_atomic(Path(self.result_path), json.dumps(run))

        def join(self):
            pass

    monkeypatch.setattr(runs.multiprocessing, "get_context", lambda kind: type("Ctx", (), {"Process": Child}))
    monkeypatch.chdir(tmp_path)
    bench_trl.main(args)
    out = json.loads((stage_dir(cfg, "bench") / "trl.json").read_text())
    assert out["order"] == ["recipe", "trl", "recipe", "trl", "recipe", "recipe_preset"]
    assert out["speedup"] == pytest.approx(155.0 / 45.0)  # the same-samples runs only, the arms' means
    assert out["neighbour_ratios"] == pytest.approx([3.0, 3.2, 4.0, 3.875])  # each TRL run against its neighbours
    assert out["arms"]["recipe"]["runs"] == 3 and out["arms"]["recipe_preset"]["speedup"] == pytest.approx(120 / 45)
    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    assert "trains **x3.44** TRL's completions a second" in report
    assert "against the recipe runs just before and after it: x3.00 to x4.00." in report
    assert "| this recipe (3 runs) | 155.0 | 150.0, 160.0, 155.0 |" in report
    assert "| TRL GRPOTrainer (2 runs) | 45.0 | 50.0, 40.0 |" in report
    assert "| this recipe, the preset's online filter on (1 run) | 120.0 | 120.0 |" in report
    assert "x2.67 TRL's trained completions a second, 120 completions generated for 8 trained" in report
