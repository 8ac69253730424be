"""`make bench-engine` (recipe.inference.bench): every timed decode step runs the whole batch, each batch size is
timed once a round, the line through the medians is a least-squares fit, and bench/engine.json and RESULTS.md's
section say what was measured."""
import json

import pytest
import torch

from recipe.config import load_config
from recipe.errors import StageError
from recipe.inference import bench
from recipe.inference.hf import DecodeBatch, HFEngine
from recipe.model import build_tiny_model, build_tokenizer
from recipe.runs import Stage, stage_dir, write_atomic

pytestmark = pytest.mark.usefixtures("one_thread")
ARGS = ["rl.gen_batch_size=16", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
        "model.tiny.head_dim=16", "model.tiny.moe_intermediate_size=16", "model.tiny.n_routed_experts=4"]


def tiny_parts(cfg):
    tok = build_tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], cfg.model.tiny.vocab_size)
    return build_tiny_model(cfg.model.tiny, tok, seed=0), tok


@pytest.fixture
def engine(cfg_factory):
    model, tok = tiny_parts(cfg_factory(*ARGS))
    return HFEngine(model, tok, stop_ids=[], batch_size=16)


def test_every_timed_step_decodes_every_row(engine, monkeypatch):
    rows_seen = []
    step = DecodeBatch.step

    def counted(self, *a, **k):
        rows_seen.append(len(self))
        return step(self, *a, **k)

    monkeypatch.setattr(DecodeBatch, "step", counted)
    cpu, wall = bench.decode_step_costs(engine, rows=8, steps=6, warmup=2, prompt_tokens=12)
    assert len(cpu) == len(wall) == 6 and min(cpu) > 0 and min(wall) > 0
    assert rows_seen == [8] * 8  # warm-up and timed steps, all 8 rows running


def test_a_row_that_finishes_stops_the_bench_rather_than_time_a_smaller_batch(engine, monkeypatch):
    init = DecodeBatch.__init__

    def every_token_stops(self, *a, **k):
        init(self, *a, **k)
        self.stops = torch.arange(engine.model.config.vocab_size)

    monkeypatch.setattr(DecodeBatch, "__init__", every_token_stops)
    with pytest.raises(StageError, match=r"a row of 8 finished at step 1 of 3"):
        bench.decode_step_costs(engine, rows=8, steps=2, warmup=1)


def test_an_engine_with_stop_tokens_is_refused(cfg_factory):
    model, tok = tiny_parts(cfg_factory(*ARGS))
    with pytest.raises(ValueError, match="without stop tokens"):
        bench.decode_step_costs(HFEngine(model, tok, stop_ids=[1], batch_size=8), rows=2, steps=1, warmup=0)


def test_the_line_is_the_least_squares_fit():
    xs = [1, 8, 32, 64, 128] * 2
    fixed, per_row = bench.fit_line(xs, [2.5 + 0.045 * x + (0.1 if i < 5 else -0.1) for i, x in enumerate(xs)])
    assert fixed == pytest.approx(2.5) and per_row == pytest.approx(0.045)
    assert bench.fit_line([0, 1, 2, 3], [1, 3, 2, 4]) == pytest.approx((1.3, 0.8))
    with pytest.raises(ValueError):
        bench.fit_line([8, 8], [1.0, 2.0])


def test_batch_sizes_run_up_to_the_engines_batch():
    assert bench.batch_sizes(128) == [1, 8, 32, 64, 128]
    assert bench.batch_sizes(64) == [1, 8, 32, 64]
    assert bench.batch_sizes(16) == [1, 8, 16]
    assert bench.batch_sizes(1) == [1]


def test_bench_times_each_size_once_a_round(engine, monkeypatch):
    order = []
    costs = bench.decode_step_costs

    def logged(eng, rows, *a, **k):
        order.append((rows, eng.written_out_decode))
        return costs(eng, rows, *a, **k)

    monkeypatch.setattr(bench, "decode_step_costs", logged)
    assert engine.written_out_decode
    out = bench.bench(engine, [1, 8, 16], rounds=2, steps=3, warmup=1)
    # each size through the written-out step and transformers' forward, the order swapped the next round
    assert order == [(1, True), (1, False), (8, True), (8, False), (16, True), (16, False),
                     (1, False), (1, True), (8, False), (8, True), (16, False), (16, True)]
    assert engine.written_out_decode and out["decode"] == "written_out"
    assert set(out["transformers_cpu_ms"]) == {"1", "8", "16"}
    assert all(len(v) == 2 and min(v) > 0 for v in out["transformers_cpu_ms"].values())
    stock = [(r, v) for r in (1, 8, 16) for v in out["transformers_cpu_ms"][str(r)]]
    fixed, per_row = bench.fit_line([r for r, _ in stock], [v for _, v in stock])
    assert out["transformers_fixed_ms"] == pytest.approx(fixed, abs=1e-3)
    assert out["transformers_per_row_us"] == pytest.approx(1000 * per_row, abs=0.1)
    assert set(out["cpu_ms"]) == set(out["wall_ms"]) == {"1", "8", "16"}
    assert all(len(v) == 2 and min(v) > 0 for v in out["cpu_ms"].values())
    medians = [(r, v) for r in (1, 8, 16) for v in out["cpu_ms"][str(r)]]
    fixed, per_row = bench.fit_line([r for r, _ in medians], [v for _, v in medians])
    assert out["fixed_ms"] == pytest.approx(fixed, abs=1e-3) and out["per_row_us"] == pytest.approx(1000 * per_row, abs=0.1)


def test_make_bench_engine_writes_its_figures_and_the_report_section(tmp_path, monkeypatch):
    args = [f"run_root={tmp_path / 'runs'}", *ARGS]
    cfg = load_config(args)
    model, tok = tiny_parts(cfg)
    model.save_pretrained(stage_dir(cfg, "base") / "model")
    tok.save_pretrained(stage_dir(cfg, "base") / "model")
    write_atomic(stage_dir(cfg, "base") / "DONE.json", json.dumps({"config_hash": Stage(cfg, "base").hash}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "STEPS", 4)
    bench.main(args)
    out = json.loads((stage_dir(cfg, "bench") / "engine.json").read_text())
    assert out["rows"] == [1, 8, 16] and out["rounds"] == 2 and out["steps"] == 4 and out["threads"] == 1
    # the overrides main() was called with, not the test runner's command line; less the run root
    assert out["command"] == f'make bench-engine PRESET=tiny ARGS="{" ".join(ARGS)}"'
    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    section = report.split("## Performance: the inference engine's decode step")[1].split("\n## ")[0]
    assert f"**about {out['fixed_ms']:.2f} ms a step plus {out['per_row_us']:.0f} us a row**" in section
    assert "| rows | 1 | 8 | 16 |" in section
    assert "| ms of CPU a step | " + " | ".join(" / ".join(f"{v:.2f}" for v in out["cpu_ms"][r])
                                             for r in ("1", "8", "16")) + " |" in section
    assert "| ms of CPU a step, transformers' forward | " + " | ".join(
        " / ".join(f"{v:.2f}" for v in out["transformers_cpu_ms"][r]) for r in ("1", "8", "16")) + " |" in section
    gain = sum(out["transformers_cpu_ms"]["16"]) / sum(out["cpu_ms"]["16"])
    assert (f"a line through them about {out['transformers_fixed_ms']:.2f} ms a step plus "
            f"{out['transformers_per_row_us']:.0f} us a row: at 16 rows transformers' forward takes **x{gain:.2f}** "
            "the CPU a step") in section


def test_make_bench_engine_refuses_a_preset_without_the_hf_engine(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main([f"run_root={tmp_path / 'runs'}", *ARGS, "rl.engine=vllm"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rl.engine" in err[0] and "'vllm'" in err[0]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("engine.json"))
