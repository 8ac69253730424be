"""Every preset composes into the typed schema; bad names, keys and types stop with an error naming them."""
import re
from pathlib import Path

import pytest

from recipe.config import CONFIG_DIR, ConfigError, load_config

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))


def test_every_config_file_is_used_by_some_preset_or_parsed():
    import yaml

    for f in CONFIG_DIR.rglob("*.yaml"):
        assert yaml.safe_load(f.read_text()) is not None, f


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_is_consistent(preset):
    cfg = load_config([f"preset={preset}"])
    assert cfg.preset == preset
    if cfg.model.hub_id:  # every hub reference is pinned to a revision
        assert cfg.model.revision and cfg.model.revision != "main"
    if cfg.data.source == "intellect3":
        for ds in (cfg.data.sft_dataset, cfg.data.rl_dataset):
            assert ds.id and ds.revision and ds.revision != "main"
    assert abs(sum(cfg.rl.env_mix.values()) - 1.0) < 1e-9
    assert 0 < cfg.rl.mask_ratio_low < 1 < cfg.rl.mask_ratio_high
    assert cfg.eval.samples >= max(cfg.eval.pass_k)
    assert cfg.launcher.trainer_nodes + cfg.launcher.inference_nodes <= max(cfg.launcher.nodes, 1)


def test_intellect3_preset_carries_the_production_rl_values():
    rl = load_config(["preset=intellect3"]).rl
    assert (rl.batch_size, rl.rollouts_per_example) == (256, 16)
    assert rl.temperature == 1.05 and rl.optimizer == "muon" and rl.lr == 1e-6
    assert (rl.max_async_level, rl.max_off_policy_steps) == (1, 8)
    assert (rl.mask_ratio_low, rl.mask_ratio_high, rl.sequence_mask_low) == (0.5, 5.0, 1e-5)
    assert dict(rl.env_mix) == {"math": 0.6, "code": 0.4}
    assert (rl.checkpoint_every, rl.keep_checkpoints) == (30, 5)


def test_overrides_apply():
    cfg = load_config(["sft.lr=1e-4", "rl.max_async_level=0"])
    assert cfg.sft.lr == 1e-4 and cfg.rl.max_async_level == 0


@pytest.mark.parametrize("override,named", [
    ("preset=nope", "nope"),
    ("sft.lrr=1", "lrr"),
    ("sft.lr=abc", "sft.lr"),
    ("rl.max_steps=1.5", "rl.max_steps"),
    ("rl.engine=tgi", "rl.engine"),
    ("rl.optimizer=sgd", "rl.optimizer"),
    ("eval.samples=0", "eval.samples"),
    ("rl.env_mix.math=-1", "rl.env_mix"),
])
def test_bad_overrides_name_the_problem(override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config([override])


@pytest.mark.parametrize("override,named", [
    ("eval.benchmarks=[{name:nope}]", "eval.benchmarks[0].name='nope'"),
    ("eval.benchmarks=[{name:aime24,samples:0}]", "eval.benchmarks[0].samples"),
    ("eval.benchmarks=[{name:aime24,pass_k:[64]}]", "eval.benchmarks[0].pass_k"),
    ("eval.benchmarks=[{name:math500,contest_date_from:'2024-01-01'}]", "eval.benchmarks[0].contest_date_from"),
    ("eval.benchmarks=[{name:lcb_v6,contest_date_to:'May 2025'}]", "eval.benchmarks[0].contest_date_to"),
    ("eval.benchmarks=[{name:hle},{name:hle}]", "listed twice"),
])
def test_bad_benchmark_entries_name_the_problem(override, named):
    """Checked against the benchmark registry by the stages that run or plan benchmarks (eval, plan)."""
    from recipe.eval.benchmarks import validate_benchmarks

    with pytest.raises(ConfigError, match=re.escape(named)):
        validate_benchmarks(load_config([override]).eval)


def test_cli_prints_one_line_error_and_exit_2(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "recipe.data", "sft.lrr=1", f"run_root={tmp_path}"],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: config error") and "lrr" in res.stderr
    assert "Traceback" not in res.stderr
