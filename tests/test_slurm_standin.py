"""The SLURM batch script itself, run to the end on this machine: `make plan` renders rl.sbatch for SLURM CPU nodes
(configs/launcher/slurm_cpu.yaml: 1 trainer node with 2 ranks, 1 policy node serving the hf engine), and bash runs
it with small stand-ins for srun and scontrol (tests/slurm_standin) that map its 2 "nodes", 127.0.0.1 and
127.0.0.2 (both this machine's loopback), to local processes. The script starts the policy server on the policy
node, waits for its /health, and runs torchrun on the trainer node; rank 0's orchestrator generates every rollout
through the server over HTTP, and each step's weights reach it by the reload call. Nothing here is specific to the
test but the two stand-ins."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.config import load_config
from recipe.runs import stage_dir
from tests.test_distributed import RL_ARGS, prepared_root, records

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "slurm_standin"
NODES = ["127.0.0.1", "127.0.0.2"]  # trainer node, policy node
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    port = free_port()
    # no online filter (as prime-rl's production run): the random test model rarely answers right, and a group
    # with no signal still makes a step
    args = [f"run_root={root / 'runs'}", "launcher=slurm_cpu", f"rl.max_steps={STEPS}", *RL_ARGS,
            "rl.online_filter=false", f"rl.vllm_port={port}", f"launcher.master_port={free_port()}"]
    prepared_root(root / "runs", args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    plan = subprocess.run([sys.executable, "-m", "recipe.launch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    script = stage_dir(load_config(args), "launch") / "rl.sbatch"
    job_env = {**env, "PATH": os.pathsep.join([str(STANDIN), str(Path(sys.executable).parent), env["PATH"]]),
               "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NODELIST": ",".join(NODES), "SLURM_JOB_ID": "1",
               "SRUN_STANDIN_LOG": str(root / "srun.jsonl")}
    t0 = time.time()
    res = subprocess.run(["bash", str(script)], cwd=root, env=job_env, capture_output=True, text=True, timeout=600)
    took = time.time() - t0
    print(f"the batch script ran {took:.1f} s")
    return {"res": res, "args": args, "root": root, "port": port, "script": script, "took": took,
            "steps": [json.loads(x) for x in (root / "srun.jsonl").read_text().splitlines()]}


@pytest.mark.slow  # a policy server, 2 trainer ranks and 3 RL steps: about 40 s
def test_the_sbatch_script_runs_the_rl_stage_to_the_end_under_srun_standins(job):
    from transformers import AutoModelForCausalLM

    res = job["res"]
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    rl_dir = stage_dir(load_config(job["args"]), "rl")
    assert records(rl_dir) == list(range(1, STEPS + 1)) and (rl_dir / "DONE.json").exists()
    assert AutoModelForCausalLM.from_pretrained(rl_dir / "model") is not None
    # the roles on their nodes: one server step on the policy node, one torchrun task on the trainer node
    server, trainer = job["steps"]
    assert server["nodes"] == [NODES[1]] and server["ntasks"] == 1
    assert server["command"][1:3] == ["-m", "recipe.inference.serve"]
    assert trainer["nodes"] == [NODES[0]] and trainer["ntasks"] == 1
    assert "--nnodes=1 --nproc-per-node=2" in trainer["command"][-1] and "-m recipe.rl" in trainer["command"][-1]
    assert "2 trainer ranks" in res.stdout


@pytest.mark.slow
def test_rollouts_and_weights_went_through_the_policy_server(job):
    assert job["res"].returncode == 0
    launch_dir = job["script"].parent
    log = (launch_dir / f"server-{NODES[1]}.log").read_text()
    # the server on the policy node served the SFT model and loaded every version the trainer published
    assert f"serving {stage_dir(load_config(job['args']), 'sft') / 'model'} on http://0.0.0.0:{job['port']}" in log
    for version in range(1, STEPS + 1):
        assert f"policy_{version:06d}.safetensors" in log, log[-2000:]
    assert "serve: stopped" in log  # SIGTERM from the script's EXIT trap, a clean stop
    # the script's EXIT trap stopped the server: nothing listens on its port any more
    deadline = time.time() + 10
    while port_open(NODES[1], job["port"]) and time.time() < deadline:
        time.sleep(0.2)
    assert not port_open(NODES[1], job["port"])
