"""Every preset composes into the typed schema; bad names, keys and types stop with an error naming them."""
import re
from pathlib import Path

import pytest

from recipe.config import CONFIG_DIR, ConfigError, load_config

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))


# -- every file of the config tree is used, and composes -------------------------------------------------
NOT_HYDRA = {"accelerate"}  # folders under configs/ that are not hydra groups (accelerate's own files)
# group files no preset selects, kept for `group=name` overrides ("rl/name")
OVERRIDE_ONLY: set[str] = {"launcher/slurm_cpu"}  # SLURM on CPU nodes: tests/test_slurm_standin.py


def hydra_groups(config_dir: Path) -> list[str]:
    """The groups configs/config.yaml composes (its defaults list), in order."""
    return [next(iter(d)) for d in defaults(config_dir / "config.yaml") if isinstance(d, dict)]


def defaults(path: Path) -> list:
    import yaml

    return yaml.safe_load(path.read_text()).get("defaults", [])


def group_files(config_dir: Path) -> list[tuple[str, str]]:
    return sorted((g, f.stem) for g in hydra_groups(config_dir) for f in (config_dir / g).glob("*.yaml"))


def preset_choices(config_dir: Path, preset: str) -> dict:
    """group -> file name that a preset selects: config.yaml's default unless the preset overrides it."""
    choices = {next(iter(d)): next(iter(d.values())) for d in defaults(config_dir / "config.yaml")
               if isinstance(d, dict)}
    for d in defaults(config_dir / "preset" / f"{preset}.yaml"):
        key, value = next(iter(d.items()))
        choices[key.removeprefix("override ").strip("/")] = value
    choices["preset"] = preset
    return choices


def unreachable(config_dir: Path, override_only: set[str]) -> list[str]:
    """Config files nothing selects: group files in no preset and not override-only, and folders that are
    neither a hydra group nor known to be something else."""
    used = {f"{g}/{n}" for p in (config_dir / "preset").glob("*.yaml")
            for g, n in preset_choices(config_dir, p.stem).items()}
    stray = [f"{g}/{n}" for g, n in group_files(config_dir) if f"{g}/{n}" not in used | override_only]
    folders = [f"{d.name}/" for d in sorted(config_dir.iterdir())
               if d.is_dir() and d.name not in set(hydra_groups(config_dir)) | NOT_HYDRA]
    return stray + folders


def assert_within(expected, actual, where: str) -> None:
    """Every value a config file sets is in the composed config (which also has the schema's defaults)."""
    if isinstance(expected, dict):
        for k, v in expected.items():
            assert k in actual, f"{where}.{k} is missing from the composed config"
            assert_within(v, actual[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert len(expected) == len(actual), f"{where}: {len(expected)} items in the file, {len(actual)} composed"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_within(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: the file says {expected!r}, the composed config {actual!r}"


def assert_file_composed(cfg, group: str, name: str) -> None:
    from omegaconf import OmegaConf

    expected = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml"), resolve=True)
    assert_within(expected, OmegaConf.to_container(cfg[group], resolve=True), group)


def selecting_preset(group: str, name: str) -> list[str]:
    """preset=P for a preset that selects group/name, or nothing (the default preset) for override-only files:
    a group file may fit only its own preset's model (rl/gpu_small's 512 new tokens overrun the tiny context)."""
    return next(([f"preset={p}"] for p in PRESETS if preset_choices(CONFIG_DIR, p).get(group) == name), [])


@pytest.mark.parametrize("group,name", [gn for gn in group_files(CONFIG_DIR) if gn[0] != "preset"],
                         ids=lambda x: x)
def test_every_group_file_composes_into_the_schema_when_selected(group, name):
    cfg = load_config([*selecting_preset(group, name), f"{group}={name}"])  # the choice on the command line wins
    assert_file_composed(cfg, group, name)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_composes_every_file_it_selects(preset):
    cfg = load_config([f"preset={preset}"])
    for group, name in preset_choices(CONFIG_DIR, preset).items():
        if group != "preset":
            assert_file_composed(cfg, group, name)


def test_every_group_file_is_selected_by_a_preset_or_listed_as_override_only():
    assert hydra_groups(CONFIG_DIR) == ["model", "data", "base", "sft", "rl", "eval", "launcher", "preset"]
    assert unreachable(CONFIG_DIR, OVERRIDE_ONLY) == []
    assert all((CONFIG_DIR / f"{f}.yaml").exists() for f in OVERRIDE_ONLY), "a stale OVERRIDE_ONLY entry"


def test_the_config_tree_checks_catch_a_stray_file_a_stray_folder_and_an_unknown_key(tmp_path, monkeypatch):
    import shutil

    import recipe.config

    tree = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, tree)
    (tree / "rl" / "broken.yaml").write_text("max_steps: 3\nmax_stepz: 4\n")
    (tree / "extras").mkdir()
    assert unreachable(tree, OVERRIDE_ONLY) == ["rl/broken", "extras/"]
    assert unreachable(tree, OVERRIDE_ONLY | {"rl/broken"}) == ["extras/"]
    monkeypatch.setattr(recipe.config, "CONFIG_DIR", tree)
    assert load_config(["rl=tiny"]).rl.max_steps == 90  # the copy composes as the original does
    with pytest.raises(ConfigError, match="max_stepz"):
        load_config(["rl=broken"])


# -- accelerate's files ------------------------------------------------------------------------------------
ACCELERATE = sorted((CONFIG_DIR / "accelerate").glob("*.yaml"))


def accelerate_config(path: Path):
    """Parse a file as `accelerate launch --config_file` does (accelerate's own config class, which rejects
    unknown keys), and check every fsdp_config key against the launch option it becomes."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    cfg = load_config_from_file(str(path))
    options = {a.dest for a in launch_command_parser()._actions}
    # accelerate launch sets each fsdp_config key k as the option k, or fsdp_k when k lacks "fsdp"
    unknown = [k for k in cfg.fsdp_config if (k if "fsdp" in k else f"fsdp_{k}") not in options]
    if unknown:
        raise ValueError(f"{path}: fsdp_config has key(s) accelerate launch does not take: {unknown}")
    return cfg


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_parse_into_accelerates_config_class(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    cfg = accelerate_config(path)
    assert isinstance(cfg, ClusterConfig)
    if cfg.distributed_type == DistributedType.FSDP:
        assert cfg.fsdp_config.get("fsdp_version") == 2  # FSDP2, as recipe/rl/trainer.py says
        assert cfg.num_processes % cfg.num_machines == 0


def test_every_accelerate_config_is_used_by_a_launcher_and_every_launcher_config_exists():
    from omegaconf import OmegaConf

    used = {OmegaConf.load(f).accelerate_config for f in (CONFIG_DIR / "launcher").glob("*.yaml")} - {None}
    root = CONFIG_DIR.parent
    assert all((root / u).exists() for u in used), used
    assert {(root / u).resolve() for u in used} == {p.resolve() for p in ACCELERATE}


def test_the_accelerate_check_catches_unknown_keys(tmp_path):
    assert ACCELERATE
    text = ACCELERATE[0].read_text()
    top = tmp_path / "top.yaml"
    top.write_text(text + "num_gpus_per_node: 8\n")
    with pytest.raises(ValueError, match="num_gpus_per_node"):
        accelerate_config(top)
    nested = tmp_path / "nested.yaml"
    nested.write_text(text.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_shard_everything: true\n"))
    assert "fsdp_shard_everything" in nested.read_text()
    with pytest.raises(ValueError, match="fsdp_shard_everything"):
        accelerate_config(nested)


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
    assert rl.staleness == "prime_rl" and rl.online_filter is False  # scheduler.py and orch.toml of PR 1272
    assert (rl.mask_ratio_low, rl.mask_ratio_high, rl.sequence_mask_low) == (0.5, 5.0, 1e-5)
    assert dict(rl.env_mix) == {"math": 0.6, "code": 0.4}
    assert (rl.checkpoint_every, rl.keep_checkpoints) == (30, 5)
    # orch.toml: seq_len 51200; prime-rl masks no sample; i3-code runs 15 tests a problem
    assert (rl.seq_len, rl.mask_sandbox_failures, rl.code_max_tests) == (51200, False, 15)
    tiny = load_config([]).rl
    assert (tiny.seq_len, tiny.mask_sandbox_failures) == (None, True)
    # orch.toml's [eval]: AIME 2025, 16 samples a problem, every 30 steps
    assert (rl.eval_every, rl.eval_set, rl.eval_samples, rl.eval_max_problems) == (30, "aime25", 16, None)


def test_the_pass_rate_filter_has_one_key_per_environment_in_the_data_config():
    """data.max_pass_rate (applied by `make data`) is the only pass-rate filter: RL has none to disagree with."""
    assert dict(load_config(["preset=intellect3"]).data.max_pass_rate) == {"math": 0.874}  # code: unfiltered
    assert dict(load_config([]).data.max_pass_rate) == {}
    cfg = load_config(["preset=intellect3", "data.max_pass_rate={math:0.9,code:0.95}"])
    assert dict(cfg.data.max_pass_rate) == {"math": 0.9, "code": 0.95}
    assert dict(load_config(["preset=intellect3", "data.max_pass_rate={}"]).data.max_pass_rate) == {}
    for override in ("rl.max_pass_rate=0.874", "+rl.max_pass_rate=0.874"):
        with pytest.raises(ConfigError, match="unknown key rl.max_pass_rate"):
            load_config(["preset=intellect3", override])
    with pytest.raises(ConfigError, match=r"data.max_pass_rate names \['maths'\], not among the RL subsets .*"
                                          r"did you mean math"):
        load_config(["preset=intellect3", "data.max_pass_rate={maths:0.874}"])
    with pytest.raises(ConfigError, match="data.max_pass_rate.math must be a number in \\[0, 1\\], got 1.5"):
        load_config(["preset=intellect3", "data.max_pass_rate.math=1.5"])
    with pytest.raises(ConfigError, match="tiny rows carry no pass rate to filter on"):  # their difficulty: a level
        load_config(["data.max_pass_rate={math:0.9}"])


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_evaluates_during_rl_a_set_that_exists(preset):
    from recipe.eval.benchmarks import REGISTRY

    rl = load_config([f"preset={preset}"]).rl
    assert rl.eval_every > 0 and rl.eval_set in {"held_out", *REGISTRY}


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
    ("eval.benchmarks=[{name:aime24,pass_k:[65]}]", "eval.benchmarks[0].pass_k"),  # k is 64
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


# -- valid ranges, keys added with +, dicts that replace ---------------------------------------------------
def numeric_fields(tp, prefix: str = "") -> set[str]:
    """Dotted keys of every int and float of the schema (list items as `[]`, a dict's or list's values as the
    field itself), from the dataclasses' type hints."""
    import dataclasses
    import typing

    out = set()
    for name, t in typing.get_type_hints(tp).items():
        is_list = False
        while typing.get_origin(t) in (typing.Union, list, dict):  # Optional[...], List[...], Dict[str, ...]
            is_list |= typing.get_origin(t) is list
            t = [a for a in typing.get_args(t) if a is not type(None)][-1]
        if dataclasses.is_dataclass(t):
            out |= numeric_fields(t, f"{prefix}{name}{'[]' if is_list else ''}.")
        elif t in (int, float):
            out.add(prefix + name)
    return out


def test_every_number_of_the_schema_has_a_valid_range_and_every_range_a_number():
    from recipe.config import RANGES, Config

    assert numeric_fields(Config) == set(RANGES)


def test_every_preset_value_is_within_its_range():
    for preset in PRESETS:
        load_config([f"preset={preset}"])  # validate() runs the RANGES table


@pytest.mark.parametrize("override", ["+rl.foo=1", "++rl.foo=1", "+model.tiny.foo=1", "+foo=1",
                                      "+data.tasks.0.foo=1", "+eval.benchmarks=[{name:hle,foo:1}]"])
def test_keys_added_with_plus_must_be_schema_keys(override):
    key = "foo"
    with pytest.raises(ConfigError, match=f"unknown key .*{key}") as e:
        load_config([override])
    assert "+" not in str(e.value)  # no advice to add the key with +


def test_plus_adds_entries_to_dict_fields_only():
    cfg = load_config(["+rl.env_mix.science=0.5", "+data.tasks.0.params.extra=1"])
    assert cfg.rl.env_mix["science"] == 0.5 and cfg.data.tasks[0].params["extra"] == 1


@pytest.mark.parametrize("overrides", [["rl.env_mix={math:0.5,science:0.5}"],
                                       ["rl.env_mix={math:0.5,science:0.5}", "preset=intellect3"],
                                       ["preset=intellect3", "++rl.env_mix={math:0.5,science:0.5}"]])
def test_a_dict_on_the_command_line_replaces_the_presets_mix(overrides):
    assert dict(load_config(overrides).rl.env_mix) == {"math": 0.5, "science": 0.5}


def test_env_mix_entries_stay_typed_and_later_overrides_apply_on_top():
    cfg = load_config(["rl.env_mix={math:1,logic:1}", "rl.env_mix.logic=0.25", "~rl.env_mix.math",
                       "+rl.env_mix.code=0.75"])
    assert dict(cfg.rl.env_mix) == {"logic": 0.25, "code": 0.75}
    with pytest.raises(ConfigError, match=re.escape("rl.env_mix={math:abc}: Value 'abc'")):
        load_config(["rl.env_mix={math:abc}"])


def test_closed_choices_are_those_the_libraries_take():
    import torch
    from transformers.trainer_utils import SchedulerType

    from recipe.config import DType, SchedulerKind

    assert {s.value for s in SchedulerKind} <= {s.value for s in SchedulerType}
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in DType)


@pytest.mark.parametrize("override", ["model.arch.hidden_size=3", "+model.arch.hidden_size=3",
                                      "model.arch={hidden_size:3}"])
def test_keys_of_a_null_architecture_block_get_an_error_that_names_it(override):
    with pytest.raises(ConfigError, match=r"model\.arch is null in this preset.*model=glm45_air"):
        load_config(["preset=tiny", override])
    assert load_config(["preset=intellect3", "model.arch.hidden_size=3"]).model.arch.hidden_size == 3


def test_a_hub_models_context_is_not_checked_against_the_tiny_one():
    cfg = load_config(["preset=gpu_small", "rl.max_new_tokens=4096", "sft.max_length=8192"])
    assert cfg.rl.max_new_tokens == 4096  # Qwen3's context is known from its config.json, not here


def test_eval_top_k_is_range_checked_and_a_null_one_leaves_the_config_hash_as_it_was():
    """eval.top_k and eval.benchmarks[].top_k came later: null (the default) is left out of the hash, so that
    finished runs keep their stage hashes; a value counts."""
    import hashlib
    import json

    from omegaconf import OmegaConf

    from recipe.config import config_hash

    cfg = load_config(["eval.benchmarks=[{name:aime24}]"])
    data = OmegaConf.to_container(cfg, resolve=True)
    assert data["eval"]["top_k"] is None and data["eval"]["benchmarks"][0]["top_k"] is None
    del data["eval"]["top_k"], data["eval"]["benchmarks"][0]["top_k"]
    del data["eval"]["adapt_threads"]  # came later too (recipe.cores), never hashed
    data["data"].pop("extra_tasks", None)
    data["model"].pop("arch", None)
    before = hashlib.sha256(json.dumps({"eval": data["eval"]}, sort_keys=True).encode()).hexdigest()[:16]
    assert config_hash(cfg, ["eval"]) == before
    assert config_hash(load_config(["eval.benchmarks=[{name:aime24}]", "eval.top_k=20"]), ["eval"]) != before
    with pytest.raises(ConfigError, match="eval.top_k"):
        load_config(["eval.top_k=-2"])
    with pytest.raises(ConfigError, match=re.escape("eval.benchmarks[0].top_k")):
        load_config(["eval.benchmarks=[{name:aime24,top_k:-5}]"])
