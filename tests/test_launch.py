"""The launcher's dry run: placement, estimates and the SLURM script, without starting anything."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.config import ConfigError, load_config
from recipe.launch.plan import GIB, launch, memory_estimate, placement, throughput

REPO = Path(__file__).parent.parent


def intellect3(tmp_path, *extra):
    return load_config(["preset=intellect3", f"run_root={tmp_path}", *extra])


def test_intellect3_placement_and_throughput(tmp_path):
    cfg = intellect3(tmp_path)
    plan = placement(cfg)
    assert (plan["nodes"], plan["trainer_nodes"], plan["inference_nodes"], plan["gpus_per_node"]) == (44, 16, 28, 8)
    assert plan["used_nodes"] <= plan["nodes"] and plan["trainer_gpus"] == 128
    tput = throughput(cfg, plan)
    assert tput["rollouts_per_step"] == 4096
    assert tput["max_tokens_per_step"] == 4096 * cfg.rl.max_new_tokens


def test_glm45_air_memory_estimate_is_sane(tmp_path):
    cfg = intellect3(tmp_path)
    mem = memory_estimate(cfg, placement(cfg))
    # bf16 weights + grads, Muon's one momentum and AdamW's two moments, over 128 GPUs
    assert mem["trainer_bytes_per_gpu"] == 2 * (2 * mem["params_total"] + mem["params_muon"]
                                                + 2 * mem["params_adamw"]) / 128
    assert 5 * GIB < mem["trainer_bytes_per_gpu"] < 40 * GIB
    assert 10 * GIB < mem["inference_bytes_per_gpu"] < 141 * GIB  # bf16 106B over TP 8 fits an H200
    # adamw keeps two moments where Muon keeps one momentum
    adamw = memory_estimate(intellect3(tmp_path, "rl.optimizer=adamw"), placement(cfg))
    assert adamw["params_muon"] == 0 and adamw["trainer_bytes_per_gpu"] > mem["trainer_bytes_per_gpu"]


def test_sbatch_script_is_written_and_parses(tmp_path, capsys):
    overrides = ["preset=intellect3", f"run_root={tmp_path}", "rl.max_steps=5"]
    script = launch(load_config(overrides), overrides)
    assert script == tmp_path / "intellect3" / "launch" / "rl.sbatch" and script.is_file()
    text = script.read_text()
    assert "#SBATCH --nodes=44" in text and "#SBATCH --gpus-per-node=8" in text
    trainer = [ln for ln in text.splitlines() if "accelerate launch" in ln and not ln.startswith("#")]
    assert len(trainer) == 1 and "--num_processes 128" in trainer[0] and "--num_machines 16" in trainer[0]
    assert "-m recipe.rl preset=intellect3" in trainer[0] and "rl.max_steps=5" in trainer[0]
    assert trainer[0].count("preset=") == 1
    assert "--tensor-parallel-size 8" in text and "--model intellect3/sft/model" not in text
    assert f"--model {tmp_path}/intellect3/sft/model" in text
    assert "RECIPE_VLLM_URLS" in text and 'cd "$SLURM_SUBMIT_DIR"' in text
    assert str(REPO) not in text and sys.executable not in text  # nothing names a path of this machine
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = capsys.readouterr().out
    assert f"sbatch {script}" in out and "4096 rollouts" in out


def test_default_run_root_keeps_paths_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run_root=runs is relative: written under the working folder
    script = launch(load_config(["preset=intellect3"]), ["preset=intellect3"])
    text = script.read_text()
    assert "--model runs/intellect3/sft/model" in text and "--output=runs/intellect3/launch/rl-%j.out" in text


def test_inconsistent_nodes_name_the_launcher_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"launcher\.trainer_nodes.*launcher\.inference_nodes.*launcher\.nodes"):
        placement(intellect3(tmp_path, "launcher.trainer_nodes=40"))
    with pytest.raises(ConfigError, match=r"launcher\.judge_nodes = 45 > launcher\.nodes = 44"):
        placement(intellect3(tmp_path, "launcher.judge_in_inference=false"))
    with pytest.raises(ConfigError, match=r"launcher\.inference_tp.*rl\.vllm_tensor_parallel_size"):
        placement(intellect3(tmp_path, "launcher.inference_tp=4"))


def test_cli_error_is_one_line_and_tiny_prints_a_local_plan(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "recipe.launch", f"run_root={tmp_path}", *args],
                              capture_output=True, text=True, cwd=REPO)

    bad = run("preset=intellect3", "launcher.trainer_nodes=40")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error:") and "launcher.trainer_nodes" in bad.stderr
    tiny = run("preset=tiny")
    assert tiny.returncode == 0, tiny.stderr
    assert "local: one trainer process" in tiny.stdout and "optimizer adamw: AdamW on 1.48M params" in tiny.stdout
    assert "memory: trainer 22.5 MiB/process" in tiny.stdout  # counted on the tiny model of `make base`
    assert not (tmp_path / "tiny").exists()  # a local plan writes nothing


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_plan_target_runs_recipe_launch():
    res = subprocess.run(["make", "-n", "plan", "PRESET=intellect3"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "-m recipe.launch preset=intellect3" in res.stdout
