"""`make bench-sft` (recipe.sft.bench) on a small model and a few SFT rows: both arms train the same rows, the
packed arm with less padding, the loss the same step by step; bench/sft.json and RESULTS.md's section say so."""
import json

import pytest

from recipe.config import load_config
from recipe.data.schema import write_rows
from recipe.runs import Stage, stage_dir, write_atomic

ARGS = ["data.sft_rows_per_task=8", "data.rl_rows_per_task=2", "data.eval_rows_per_task=2", "data.pretrain_rows_per_task=10", "data.tasks=[{env: math, task: add, params: {}}, {env: logic, task: "
        "letter_counting, params: {min_words: 3, max_words: 4}}]", "data.extra_tasks=[]",
        "sft.bench_steps=3", "sft.batch_size=8", "sft.rows_per_sequence=4", "sft.threads=1",
        "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=2",
        "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1", "model.tiny.head_dim=16",
        "model.tiny.moe_intermediate_size=16", "model.tiny.n_routed_experts=4"]


@pytest.fixture
def base_done(tmp_path):
    """A data stage with the SFT rows of two tiny tasks and a base stage whose model is a fresh tiny one."""
    from recipe.data.tiny import build_tiny
    from recipe.model import build_tiny_model, build_tokenizer

    args = [f"run_root={tmp_path / 'runs'}", *ARGS]
    cfg = load_config(args)
    rows = build_tiny(cfg.data)["sft"]
    data = stage_dir(cfg, "data")
    files = {"sft.parquet": {"rows": len(rows), "sha256": write_rows(rows, data / "sft.parquet")}}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    tok = build_tokenizer([r["prompt"][0]["content"] + r["completion"][0]["content"] for r in rows],
                          cfg.model.tiny.vocab_size)
    model = build_tiny_model(cfg.model.tiny, tok)
    model.save_pretrained(stage_dir(cfg, "base") / "model")
    tok.save_pretrained(stage_dir(cfg, "base") / "model")
    for name in ("data", "base"):
        write_atomic(stage_dir(cfg, name) / "DONE.json", json.dumps({"config_hash": Stage(cfg, name).hash}))
    return cfg, args


def test_bench_sft_compares_padded_packed_and_shared_prefix_batches_of_the_same_rows(base_done, monkeypatch, tmp_path):
    from recipe.sft import bench

    cfg, args = base_done
    monkeypatch.chdir(tmp_path)
    bench.main(args)
    out = json.loads((stage_dir(cfg, "bench") / "sft.json").read_text())
    assert [r["arm"] for r in out["runs"]] == ["padded", "packed", "shared"] * 2
    padded, packed, shared = (out["arms"][arm] for arm in ("padded", "packed", "shared"))
    assert padded["rows_per_sequence"] == 1 and packed["rows_per_sequence"] == 4
    assert not padded["shared_prefixes"] and not packed["shared_prefixes"] and shared["shared_prefixes"]
    assert packed["tokens"] == padded["tokens"] == shared["tokens"] > 0  # the same rows, counted without padding
    assert packed["padding"] < padded["padding"] and shared["padding"] == 0.0
    # the math rows share their instructions: a prefix computed once spares a share of the rows' tokens
    assert shared["prefix_spared"] > 0.1 and padded["prefix_spared"] == packed["prefix_spared"] == 0.0
    assert out["max_loss_difference"] < 1e-3
    assert out["speedup"] == pytest.approx(packed["tokens_per_s"] / padded["tokens_per_s"])
    assert out["speedup_shared"] == pytest.approx(shared["tokens_per_s"] / padded["tokens_per_s"])
    assert all(r["steps"] == 3 for r in out["runs"])
    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    assert "## Performance: SFT batches: padded, packed, shared prefixes" in report
    assert f"| packed | 4 | {packed['padding']:.1%} | 0.0% | {packed['tokens_per_s']:.0f} |" in report
    assert f"| shared prefixes | all | 0.0% | {shared['prefix_spared']:.1%} | {shared['tokens_per_s']:.0f} |" in report


def test_bench_sft_needs_packed_rows(base_done, capsys):
    from recipe.sft import bench

    _, args = base_done
    with pytest.raises(SystemExit) as stop:
        bench.main([*args, "sft.rows_per_sequence=1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sft.rows_per_sequence" in err[0] and "ARGS=" in err[0]
