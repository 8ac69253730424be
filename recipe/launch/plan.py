"""Dry run of the RL stage's launch: resolve placement, memory and throughput, print the plan, start nothing.

    python -m recipe.launch preset=intellect3 [overrides]     (or: make plan PRESET=intellect3)

For launcher.kind=slurm it writes <run_root>/<preset>/launch/rl.sbatch, the batch script a user submits with
sbatch from the repository root: trainer nodes run `accelerate launch -m recipe.rl` (FSDP2), inference nodes run
one `vllm serve` each (tensor parallel inside a node, data parallel across nodes), judge nodes are held. For
launcher.kind=local it only prints the plan: one process, or launcher.num_processes ranks under torchrun
(`make rl` runs it).
"""
from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import torch

from recipe.errors import ConfigError
from recipe.eval.benchmarks import validate_benchmarks
from recipe.inference.vllm import server_command, server_env
from recipe.model import count_params, meta_model
from recipe.rl.trainer import optimizer_split
from recipe.runs import stage_dir, stage_main, write_atomic

GIB = 2 ** 30
SERVER_HOST = "0.0.0.0"  # the trainer reaches the servers from other nodes
SERVER_PYTHON = "python"  # the job's environment (sbatch passes on the submitting shell's), not this machine's


# -- placement ---------------------------------------------------------------------------------------------
def placement(cfg) -> dict:
    """Node and GPU counts of the RL stage; a launcher that does not add up is a ConfigError naming fields."""
    la = cfg.launcher
    judge_extra = 0 if la.judge_in_inference else la.judge_nodes
    policy = la.inference_nodes - (la.judge_nodes if la.judge_in_inference else 0)
    used = la.trainer_nodes + la.inference_nodes + judge_extra
    if la.kind == "slurm":
        _check_slurm(cfg, used, policy)
    gpus = max(la.gpus_per_node, 0)
    return {
        "kind": la.kind, "nodes": la.nodes, "gpus_per_node": gpus, "used_nodes": used,
        "trainer_nodes": la.trainer_nodes, "inference_nodes": la.inference_nodes, "policy_nodes": policy,
        "judge_nodes": la.judge_nodes, "judge_in_inference": la.judge_in_inference,
        "trainer_gpus": la.trainer_nodes * gpus, "total_gpus": la.nodes * gpus,
    }


def _check_slurm(cfg, used: int, policy: int) -> None:
    la, rl = cfg.launcher, cfg.rl
    problems = []
    if used > la.nodes:
        judge = "" if la.judge_in_inference else " + launcher.judge_nodes"
        problems.append(f"launcher.trainer_nodes + launcher.inference_nodes{judge} = {used} > launcher.nodes = "
                        f"{la.nodes}")
    if la.trainer_nodes < 1 or la.gpus_per_node < 1:
        problems.append("launcher.trainer_nodes and launcher.gpus_per_node must be >= 1")
    if policy < 1:
        problems.append(f"no node left for a policy vLLM server (launcher.inference_nodes = {la.inference_nodes}, "
                        f"launcher.judge_nodes = {la.judge_nodes}, launcher.judge_in_inference = true)")
    if la.judge_in_inference and la.judge_nodes > la.inference_nodes:
        problems.append("launcher.judge_nodes > launcher.inference_nodes with launcher.judge_in_inference")
    if not 1 <= la.inference_tp <= la.gpus_per_node:
        problems.append(f"launcher.inference_tp = {la.inference_tp} must be in 1..launcher.gpus_per_node")
    # server_command reads the TP from rl; the two must agree or the plan would lie about the servers
    if la.inference_tp != rl.vllm_tensor_parallel_size:
        problems.append(f"launcher.inference_tp = {la.inference_tp} != rl.vllm_tensor_parallel_size = "
                        f"{rl.vllm_tensor_parallel_size}")
    if rl.engine != "vllm":
        problems.append(f"launcher.kind = slurm needs rl.engine = vllm (got {rl.engine})")
    if not la.accelerate_config:
        problems.append("launcher.kind = slurm needs launcher.accelerate_config")
    if problems:
        raise ConfigError("launcher placement does not fit: " + "; ".join(problems))


# -- estimates ---------------------------------------------------------------------------------------------
def param_counts(cfg) -> dict | None:
    """Parameter counts of the trainer's model: total, active a token, and how many each optimizer updates. They
    come from the model built on the meta device and build_optimizer's own split (optimizer_split), or, for a
    model without an architecture in the config, from model.params_total_b with every parameter on AdamW (the
    most state a parameter can take). None if neither is stated."""
    model = meta_model(cfg.model)
    if model is not None:
        total, active = count_params(model)
        muon, adamw = optimizer_split(model.named_parameters(), cfg.rl.optimizer)
        return {"total": total, "active": active, "muon": sum(p.numel() for _, p in muon),
                "adamw": sum(p.numel() for _, p in adamw), "counted": True}
    m = cfg.model
    if m.params_total_b is None:
        return None
    active = None if m.params_active_b is None else m.params_active_b * 1e9
    return {"total": m.params_total_b * 1e9, "active": active, "muon": 0, "adamw": m.params_total_b * 1e9,
            "counted": False}


def memory_estimate(cfg, plan: dict) -> dict | None:
    """Bytes a GPU holds for the trainer's sharded state and for the inference weights; None if the size is unknown.

    The trainer holds weights, gradients and optimizer state all in model.dtype: Muon one momentum buffer a
    parameter, AdamW two moments (exp_avg, exp_avg_sq; its step counters are scalars). FSDP2 full sharding
    spreads all of it evenly over the trainer's ranks. Activations, KV cache and temporary buffers are left out:
    these are the floors the model size alone sets.
    """
    n = param_counts(cfg)
    if n is None:
        return None
    dtype = cfg.model.dtype
    size = getattr(torch, dtype).itemsize
    slurm = plan["kind"] == "slurm"
    shards = plan["trainer_gpus"] if slurm else cfg.launcher.num_processes
    tp = cfg.launcher.inference_tp if slurm else 1
    parts = {"weights": n["total"] * size, "grads": n["total"] * size,
             "Muon momentum": n["muon"] * size, "AdamW moments": 2 * n["adamw"] * size}
    trainer = sum(parts.values()) / shards
    where = (f"FSDP2 full sharding over {shards} {'GPUs' if slurm else 'ranks'}" if shards > 1
             else "one process, unsharded")
    if not n["counted"]:
        source = ("model.params_total_b; no model.arch to count from, so every parameter is counted on AdamW, the "
                  "most state one can take")
    elif cfg.model.hub_id is None:
        source = "counted on the model built from model.tiny on the meta device"
    else:  # the checkpoint's MTP layers are neither loaded by transformers nor trained here
        source = (f"counted on the model built from model.arch on the meta device, without the "
                  f"{cfg.model.arch.num_nextn_predict_layers} MTP layer(s) transformers does not build")
    assumptions = [
        f"parameters: {source}",
        f"trainer: weights, grads and optimizer state in {dtype} ({size} B a value), {where}: ("
        + " + ".join(f"{k} {_size(v)}" for k, v in parts.items() if v) + f") / {shards}",
        f"inference: {dtype} weights / TP {tp}; KV cache and activations not counted",
    ]
    return {
        "params_total": n["total"], "params_active": n["active"], "params_muon": n["muon"],
        "params_adamw": n["adamw"], "dtype": dtype, "trainer_bytes_per_gpu": trainer,
        "inference_bytes_per_gpu": n["total"] * size / tp, "assumptions": assumptions,
    }


def throughput(cfg, plan: dict) -> dict:
    rl = cfg.rl
    rollouts = rl.batch_size * rl.rollouts_per_example
    out = {"rollouts_per_step": rollouts, "max_tokens_per_step": rollouts * rl.max_new_tokens}
    if plan["kind"] == "slurm":
        out["rollouts_per_server"] = math.ceil(rollouts / plan["policy_nodes"])
    return out


# -- the SLURM batch script ----------------------------------------------------------------------------------
def trainer_overrides(cfg, overrides: list[str]) -> list[str]:
    """The run's own overrides, with the resolved preset first (a second preset= would be ambiguous)."""
    return [f"preset={cfg.preset}"] + [o for o in overrides if not o.lstrip("+~").startswith("preset=")]


def sbatch_script(cfg, plan: dict, overrides: list[str]) -> str:
    la = cfg.launcher
    launch_dir = stage_dir(cfg, "launch")
    n, gpn = plan["used_nodes"], la.gpus_per_node
    t, p, j = plan["trainer_nodes"], plan["policy_nodes"], plan["judge_nodes"]
    serve = server_command(stage_dir(cfg, "sft") / "model", cfg, host=SERVER_HOST, python=SERVER_PYTHON)
    accelerate = ["accelerate", "launch", "--config_file", la.accelerate_config, "--num_machines", str(t),
                  "--num_processes", str(t * gpn)]
    # $SLURM_NODEID is the node's index inside the trainer step; expanded on each node, not here
    trainer_cmd = (" ".join(shlex.quote(a) for a in accelerate)
                   + ' --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_PROCESS_IP" -m recipe.rl '
                   + " ".join(shlex.quote(o) for o in trainer_overrides(cfg, overrides)))
    # the server's environment, but PYTHONPATH is the repository root on the cluster, not this machine's
    env = {k: v for k, v in server_env(base={}, cuda=True).items() if k != "PYTHONPATH"}
    q = shlex.quote
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name=recipe-rl-{cfg.preset}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpn}",
        f"#SBATCH --time={la.time_limit}",
        *([f"#SBATCH --partition={la.partition}"] if la.partition else []),
        f"#SBATCH --output={launch_dir}/rl-%j.out",
        f"# RL stage of preset {cfg.preset}, written by `python -m recipe.launch`. Submit from the repository",
        f"# root with the project's environment active:  sbatch {launch_dir}/rl.sbatch",
        f"# Nodes in allocation order: {t} trainer, {p} policy vLLM servers (TP {la.inference_tp}), {j} judge.",
        "set -euo pipefail",
        'cd "$SLURM_SUBMIT_DIR"  # every path below is relative to the repository root',
        f"LOG_DIR={q(str(launch_dir))}",
        'mkdir -p "$LOG_DIR"',
        "",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if (( ${{#NODES[@]}} < {n} )); then echo "need {n} nodes, got ${{#NODES[@]}}" >&2; exit 1; fi',
        f'TRAINER_NODES=("${{NODES[@]:0:{t}}}")',
        f'POLICY_NODES=("${{NODES[@]:{t}:{p}}}")',
        f'JUDGE_NODES=("${{NODES[@]:{t + p}:{j}}}")',
        'MAIN_PROCESS_IP="${TRAINER_NODES[0]}"',
        'export MAIN_PROCESS_IP',
        'echo "trainer: ${TRAINER_NODES[*]}"; echo "policy: ${POLICY_NODES[*]}"; echo "judge: ${JUDGE_NODES[*]:-}"',
        "# The judge (an LLM verifier, docs/recipe.md) has no server in this recipe yet: its nodes are held idle.",
        "",
        "# One vLLM server a node: tensor parallel inside it, data parallel across nodes.",
        *[f"export {k}={q(v)}" for k, v in sorted(env.items())],
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # vLLM workers import the recipe\'s weight loader',
        "SERVER_PIDS=()",
        "URLS=()",
        'for node in "${POLICY_NODES[@]}"; do',
        f'  srun --nodes=1 --ntasks=1 --gpus-per-node={gpn} -w "$node" \\',
        f'    {" ".join(q(a) for a in serve)} \\',
        '    > "$LOG_DIR/vllm-$node.log" 2>&1 &',
        "  SERVER_PIDS+=($!)",
        f'  URLS+=("http://$node:{cfg.rl.vllm_port}")',
        "done",
        "trap 'kill \"${SERVER_PIDS[@]}\" 2>/dev/null || true' EXIT",
        'RECIPE_VLLM_URLS=$(IFS=,; echo "${URLS[*]}")',
        "export RECIPE_VLLM_URLS  # the trainer's orchestrator spreads requests over these servers",
        "",
        f"deadline=$((SECONDS + {la.health_timeout_s}))",
        'for i in "${!URLS[@]}"; do',
        '  until curl -sf "${URLS[$i]}/health" > /dev/null; do',
        '    if ! kill -0 "${SERVER_PIDS[$i]}" 2>/dev/null; then',
        '      echo "vLLM server ${URLS[$i]} exited; see $LOG_DIR" >&2; exit 1; fi',
        '    if (( SECONDS > deadline )); then',
        '      echo "vLLM server ${URLS[$i]} not healthy in time; see $LOG_DIR" >&2; exit 1; fi',
        "    sleep 10",
        "  done",
        "done",
        "",
        "# The trainer: one accelerate launcher a node, FSDP2 over every trainer GPU.",
        'TRAINER_LIST=$(IFS=,; echo "${TRAINER_NODES[*]}")',
        f'srun --nodes={t} --ntasks={t} --ntasks-per-node=1 --gpus-per-node={gpn} -w "$TRAINER_LIST" \\',
        f"  bash -c {q('exec ' + trainer_cmd)}",
    ]
    return "\n".join(header) + "\n"


# -- printing ------------------------------------------------------------------------------------------------
def describe(cfg, plan: dict, mem: dict | None, tput: dict) -> list[str]:
    la, rl = cfg.launcher, cfg.rl
    lines = [f"preset {cfg.preset}: RL stage, launcher {la.kind} (dry run: nothing is started)"]
    if la.kind == "slurm":
        judge = ("counted among the inference nodes (unverified placement)" if la.judge_in_inference
                 else "on nodes of their own")
        lines += [
            f"nodes: {plan['used_nodes']} used of launcher.nodes {la.nodes}, {la.gpus_per_node} GPUs each, "
            f"{plan['total_gpus']} GPUs in all",
            f"trainer: {plan['trainer_nodes']} nodes, {plan['trainer_gpus']} GPUs (accelerate FSDP2, "
            f"{la.accelerate_config})",
            f"inference: {plan['inference_nodes']} nodes; {plan['policy_nodes']} policy vLLM servers, TP "
            f"{la.inference_tp} a node, data parallel across nodes, port {rl.vllm_port}",
            f"judge: {plan['judge_nodes']} nodes, {judge}",
        ]
    else:
        device = f"{la.gpus_per_node} GPU" if la.gpus_per_node else "CPU"
        n = la.num_processes
        if n == 1:
            lines.append(f"local: one trainer process on {device}, engine {rl.engine} in a child process")
        else:
            lines.append(f"local: {n} trainer ranks on {device} under torchrun (FSDP2); rank 0 also runs the "
                         f"orchestrator and the engine {rl.engine} in a child process")
    if mem is None:
        lines.append(f"memory: n/a ({cfg.model.name}: neither model.arch nor model.params_total_b is stated)")
    else:
        active = "" if mem["params_active"] is None else f", {_count(mem['params_active'])} active a token"
        lines.append(f"model: {_count(mem['params_total'])} params{active}")
        adamw = f"AdamW on {_count(mem['params_adamw'])} params (2 moments, {mem['dtype']})"
        muon = f"Muon on {_count(mem['params_muon'])} params (momentum, {mem['dtype']}) / " if mem["params_muon"] else ""
        lines.append(f"optimizer {rl.optimizer}: {muon}{adamw}")
        per = "GPU" if plan["gpus_per_node"] else "process"
        lines.append(f"memory: trainer {_size(mem['trainer_bytes_per_gpu'])}/{per}, inference weights "
                     f"{_size(mem['inference_bytes_per_gpu'])}/{per}")
        lines += [f"  assumes {a}" for a in mem["assumptions"]]
    lines.append(f"throughput: {rl.batch_size} prompts x {rl.rollouts_per_example} rollouts = "
                 f"{tput['rollouts_per_step']} rollouts a step; at most {tput['max_tokens_per_step']:,} new tokens a "
                 f"step ({rl.max_new_tokens} each)")
    if "rollouts_per_server" in tput:
        lines.append(f"  about {tput['rollouts_per_server']} rollouts a step per policy server")
    return lines


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def launch(cfg, overrides: list[str]) -> Path | None:
    validate_benchmarks(cfg.eval)
    plan = placement(cfg)
    lines = describe(cfg, plan, memory_estimate(cfg, plan), throughput(cfg, plan))
    script = None
    if cfg.launcher.kind == "slurm":
        script = stage_dir(cfg, "launch") / "rl.sbatch"
        write_atomic(script, sbatch_script(cfg, plan, overrides))
        lines += [f"wrote {script}", f"submit: sbatch {script}"]
    else:  # local: `make rl` runs it; nothing to write
        lines.append("run: " + " ".join(["python", "-m", "recipe.rl",
                                         *map(shlex.quote, trainer_overrides(cfg, overrides))]))
    print("\n".join(lines))
    return script


def main(argv=None):
    # stage_main turns config errors into one line; the raw overrides are kept for the trainer's command line
    argv = sys.argv[1:] if argv is None else list(argv)
    return stage_main(lambda cfg: launch(cfg, argv))(argv)
