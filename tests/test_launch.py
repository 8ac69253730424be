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
    assert plan["judge_nodes"] == 1 and plan["trainer_gpus"] == 128 and plan["trainer_ranks"] == 128
    assert plan["total_gpus"] == 45 * 8  # the RL job's 44 nodes and the judge's own 1-node job
    tput = throughput(cfg, plan)
    assert tput["rollouts_per_step"] == 4096
    assert tput["max_tokens_per_step"] == 4096 * cfg.rl.max_new_tokens


def test_glm45_air_memory_estimate_is_sane(tmp_path):
    cfg = intellect3(tmp_path)
    mem = memory_estimate(cfg, placement(cfg))
    # float32 master weights + grads, Muon's one momentum and AdamW's two moments, sharded over the 64 GPUs of
    # one of the 2 HSDP replicas
    assert mem["trainer_bytes_per_gpu"] == 4 * (2 * mem["params_total"] + mem["params_muon"]
                                                + 2 * mem["params_adamw"]) / 64
    assert mem["inference_bytes_per_gpu"] == 2 * mem["params_total"] / 8  # bf16 over TP 8
    assert 5 * GIB < mem["trainer_bytes_per_gpu"] < 40 * GIB
    assert 10 * GIB < mem["inference_bytes_per_gpu"] < 141 * GIB  # bf16 106B over TP 8 fits an H200
    # adamw keeps two moments where Muon keeps one momentum
    adamw = memory_estimate(intellect3(tmp_path, "rl.optimizer=adamw"), placement(cfg))
    assert adamw["params_muon"] == 0 and adamw["trainer_bytes_per_gpu"] > mem["trainer_bytes_per_gpu"]


def test_sbatch_scripts_are_rendered_from_the_templates_and_parse(tmp_path, capsys):
    overrides = ["preset=intellect3", f"run_root={tmp_path}", "rl.max_steps=5"]
    written = launch(load_config(overrides), overrides)
    launch_dir = tmp_path / "intellect3" / "launch"
    # no judge script: not pinned; eval.sbatch: tests/test_launch_eval.py
    assert written == [launch_dir / "rl.sbatch", launch_dir / "sft.sbatch", launch_dir / "eval.sbatch"]
    out = capsys.readouterr().out
    assert "judge: no script written: rl.judge.revision is not set" in out
    text = (launch_dir / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=44" in text and "#SBATCH --gpus-per-node=8" in text
    trainer = [ln for ln in text.splitlines() if "torch.distributed.run" in ln and not ln.startswith("#")]
    assert len(trainer) == 1 and "--nnodes=16" in trainer[0] and "--nproc-per-node=8" in trainer[0]
    assert '--node-rank="$SLURM_PROCID"' in trainer[0] and "--master-port=29500" in trainer[0]
    assert "-m recipe.rl preset=intellect3" in trainer[0] and "rl.max_steps=5" in trainer[0]
    assert trainer[0].count("preset=") == 1 and "HSDP 2 replicas" in text
    assert "--tensor-parallel-size 8" in text and "--model intellect3/sft/model" not in text
    assert f"--model {tmp_path}/intellect3/sft/model" in text
    assert "RECIPE_INFERENCE_URLS" in text and 'cd "$SLURM_SUBMIT_DIR"' in text
    sft = (launch_dir / "sft.sbatch").read_text()
    assert "#SBATCH --nodes=16" in sft and "-m recipe.sft preset=intellect3" in sft
    for script in written:
        body = script.read_text()
        assert str(REPO) not in body and sys.executable not in body  # nothing names a path of this machine
        assert "{{" not in body and "{%" not in body  # every template field filled
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert f"sbatch {launch_dir / 'rl.sbatch'}" in out and "4096 rollouts" in out


def test_the_judge_is_a_1_node_job_of_its_own_once_its_revision_is_pinned(tmp_path, capsys):
    overrides = ["preset=intellect3", f"run_root={tmp_path}", "rl.judge.revision=0123abcd"]
    written = launch(load_config(overrides), overrides)
    launch_dir = tmp_path / "intellect3" / "launch"
    assert written[0] == launch_dir / "judge.sbatch"
    judge = written[0].read_text()
    assert "#SBATCH --nodes=1" in judge and "#SBATCH --gpus-per-node=8" in judge
    assert "--model opencompass/CompassVerifier-7B --revision 0123abcd" in judge
    assert "--data-parallel-size 8 --tensor-parallel-size 1" in judge
    assert str(launch_dir / "judge_url") in judge and subprocess.run(["bash", "-n", str(written[0])]).returncode == 0
    rl = (launch_dir / "rl.sbatch").read_text()
    assert f"RECIPE_JUDGE_URL=$(cat {launch_dir / 'judge_url'})" in rl and "#SBATCH --nodes=44" in rl
    assert f"sbatch {launch_dir / 'judge.sbatch'} && sbatch {launch_dir / 'rl.sbatch'}" in capsys.readouterr().out


def test_default_run_root_keeps_paths_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run_root=runs is relative: written under the working folder
    launch(load_config(["preset=intellect3"]), ["preset=intellect3"])
    text = (tmp_path / "runs" / "intellect3" / "launch" / "rl.sbatch").read_text()
    assert "--model runs/intellect3/sft/model" in text and "--output=runs/intellect3/launch/rl-%j.out" in text


def test_inconsistent_nodes_name_the_launcher_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"launcher\.trainer_nodes.*launcher\.inference_nodes.*launcher\.nodes"):
        placement(intellect3(tmp_path, "launcher.trainer_nodes=40"))
    with pytest.raises(ConfigError, match=r"launcher\.hsdp_replicas = 3 does not divide the 128 trainer ranks"):
        placement(intellect3(tmp_path, "launcher.hsdp_replicas=3"))
    with pytest.raises(ConfigError, match=r"sft\.batch_size = 100 \(the global batch\) is not a multiple of the 128"):
        placement(intellect3(tmp_path, "sft.batch_size=100"))
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
    assert "local: one trainer process" in tiny.stdout and "optimizer adamw: AdamW on 1.09M params" in tiny.stdout
    assert "memory: trainer 16.7 MiB/process" in tiny.stdout  # counted on the tiny model of `make base`
    assert not (tmp_path / "tiny").exists()  # a local plan writes nothing


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_plan_target_runs_recipe_launch():
    res = subprocess.run(["make", "-n", "plan", "PRESET=intellect3"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "-m recipe.launch preset=intellect3" in res.stdout
