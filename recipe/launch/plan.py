"""Dry run of the launch: resolve placement, memory and throughput, print the plan, start nothing.

    python -m recipe.launch preset=intellect3 [overrides]     (or: make plan PRESET=intellect3)

For launcher.kind=slurm it renders the batch scripts from recipe/launch/templates (Jinja2) into
<run_root>/<preset>/launch/: rl.sbatch (trainer nodes run torchrun -m recipe.rl, the first of them also the
orchestrator; each policy node runs one server: `vllm serve` on GPUs, the hf engine's server on CPU), sft.sbatch
(torchrun -m recipe.sft on the trainer nodes), judge.sbatch (the LLM judge, a 1-node job of its own) and
eval.sbatch (the eval stage: launcher.eval_nodes nodes, one vLLM server a node, TP within the node and data
parallel across nodes, serving each model of eval.checkpoints in turn to `python -m recipe.eval` on the first
node). The servers' part of rl.sbatch and eval.sbatch is one template, _servers.sh.j2. The trainer command is
roles.torchrun_on_nodes, the one `make rl` / `make sft` run on one machine (roles.torchrun_command) with the
node's rank added. For launcher.kind=local it only prints the plan.

The eval plan (eval_plan) gives each benchmark at its k: samples, requests in flight, tokens at most (every
completion at max_new_tokens) and expected (the mean completion a results.json of the preset measured, else
launcher.eval_completion_share of max_new_tokens), and hours at launcher.eval_server_tokens_per_s a server.
"""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import jinja2
import torch

from recipe.config import checkpoint_entry
from recipe.errors import ConfigError
from recipe.eval.benchmarks import resolve, validate_benchmarks
from recipe.eval.models import folder_name
from recipe.inference.vllm import hf_server_command, server_command, server_env
from recipe.launch.recipe_table import compare
from recipe.launch.roles import INFERENCE_URLS_ENV, torchrun_on_nodes
from recipe.model import count_params, meta_model
from recipe.rl.trainer import optimizer_split
from recipe.runs import stage_argv, stage_dir, stage_main, write_atomic

GIB = 2 ** 30
SERVER_HOST = "0.0.0.0"  # the trainer reaches the servers from other nodes
SERVER_PYTHON = "python"  # the job's environment (sbatch passes on the submitting shell's), not this machine's


# -- placement ---------------------------------------------------------------------------------------------
def ranks_per_node(cfg) -> int:
    """Trainer ranks on each trainer node: one a GPU, or launcher.num_processes on CPU nodes."""
    la = cfg.launcher
    return la.gpus_per_node if la.gpus_per_node > 0 else la.num_processes


def placement(cfg) -> dict:
    """Node and GPU counts of the RL stage; a launcher that does not add up is a ConfigError naming fields."""
    la = cfg.launcher
    if la.kind == "slurm":
        _check_slurm(cfg)
    gpus = max(la.gpus_per_node, 0)
    trainer_ranks = la.trainer_nodes * ranks_per_node(cfg) if la.kind == "slurm" else la.num_processes
    return {
        "kind": la.kind, "nodes": la.nodes, "gpus_per_node": gpus, "trainer_nodes": la.trainer_nodes,
        "inference_nodes": la.inference_nodes,
        "policy_nodes": la.inference_nodes, "judge_nodes": la.judge_nodes, "trainer_ranks": trainer_ranks,
        "trainer_gpus": la.trainer_nodes * gpus, "total_gpus": (la.nodes + la.judge_nodes) * gpus,
    }


def _check_slurm(cfg) -> None:
    la, rl = cfg.launcher, cfg.rl
    problems = []
    if la.trainer_nodes + la.inference_nodes != la.nodes:
        problems.append(f"launcher.trainer_nodes + launcher.inference_nodes = {la.trainer_nodes + la.inference_nodes}"
                        f" != launcher.nodes = {la.nodes} (the RL job's nodes; the judge is a job of its own)")
    if la.inference_nodes < 1:
        problems.append("launcher.inference_nodes must be >= 1 (a policy server a node)")
    ranks = la.trainer_nodes * ranks_per_node(cfg)
    if cfg.sft.batch_size % ranks:  # sft.sbatch runs SFT on the same trainer ranks
        problems.append(f"sft.batch_size = {cfg.sft.batch_size} (the global batch) is not a multiple of the {ranks} "
                        f"trainer ranks")
    if ranks % la.hsdp_replicas:
        problems.append(f"launcher.hsdp_replicas = {la.hsdp_replicas} does not divide the {ranks} trainer ranks")
    if la.gpus_per_node > 0 and not 1 <= la.inference_tp <= la.gpus_per_node:
        problems.append(f"launcher.inference_tp = {la.inference_tp} must be in 1..launcher.gpus_per_node")
    # server_command reads the TP from rl; the two must agree or the plan would lie about the servers
    if rl.engine == "vllm" and la.inference_tp != rl.vllm_tensor_parallel_size:
        problems.append(f"launcher.inference_tp = {la.inference_tp} != rl.vllm_tensor_parallel_size = "
                        f"{rl.vllm_tensor_parallel_size}")
    if rl.engine == "vllm" and la.gpus_per_node < 1:
        problems.append("rl.engine = vllm on SLURM needs launcher.gpus_per_node >= 1 (rl.engine = hf serves on CPU)")
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

    The trainer holds weights, gradients and optimizer state in float32 whatever model.dtype (the master weights:
    recipe.rl.dist.load_sharded; the forward runs in model.dtype): Muon one momentum buffer a parameter, AdamW two
    moments (exp_avg, exp_avg_sq; its step counters are scalars). FSDP2 spreads all of it evenly over the trainer's
    ranks (HSDP: over the ranks of one replica). The engines hold the weights in model.dtype. Activations, KV
    cache, the layers gathered in model.dtype for a forward and temporary buffers are left out: these are the
    floors the model size alone sets.
    """
    n = param_counts(cfg)
    if n is None:
        return None
    dtype = cfg.model.dtype
    size = getattr(torch, dtype).itemsize
    master = torch.float32.itemsize
    slurm = plan["kind"] == "slurm"
    shards = plan["trainer_ranks"] // cfg.launcher.hsdp_replicas
    tp = cfg.launcher.inference_tp if slurm else 1
    parts = {"weights": n["total"] * master, "grads": n["total"] * master,
             "Muon momentum": n["muon"] * master, "AdamW moments": 2 * n["adamw"] * master}
    trainer = sum(parts.values()) / shards
    unit = "GPUs" if slurm and cfg.launcher.gpus_per_node else "ranks"
    replicas = f" in each of {cfg.launcher.hsdp_replicas} HSDP replicas" if cfg.launcher.hsdp_replicas > 1 else ""
    where = f"FSDP2 sharding over {shards} {unit}{replicas}" if shards > 1 else "one process, unsharded"
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
        f"trainer: weights, grads and optimizer state in float32 (master weights; the forward in {dtype}), "
        f"{where}: ("
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


# -- the eval stage --------------------------------------------------------------------------------------------
def eval_servers(cfg) -> dict:
    """The eval job's servers: one a node of launcher.eval_nodes (one, of its own, for a local launcher), each TP
    launcher.inference_tp and data parallel over the rest of its node's GPUs."""
    la = cfg.launcher
    slurm = la.kind == "slurm"
    tp = la.inference_tp if slurm else 1
    dp = max(1, la.gpus_per_node // tp) if slurm and la.gpus_per_node else 1
    return {"servers": la.eval_nodes if slurm else 1, "tp": tp, "dp": dp}


def measured_completion(cfg, bench: str) -> tuple[float, str] | None:
    """(the longest mean completion, in tokens, that a results.json of this preset measured for the benchmark,
    its folder); None before any eval of it ran."""
    root = stage_dir(cfg, "eval")
    found = []
    for path in sorted(root.glob(f"*/{bench}/results.json")) if root.is_dir() else []:
        try:
            mean = float(json.loads(path.read_text()).get("mean_completion_tokens") or 0)
        except (OSError, ValueError, TypeError):  # a damaged file: the report names it, the plan does without
            continue
        if mean > 0:
            found.append((mean, f"eval/{path.parent.parent.name}"))
    return max(found) if found else None


def eval_plan(cfg) -> dict:
    """What the eval stage costs, benchmark by benchmark at its k, for one model: samples, requests in flight,
    tokens at most and expected, hours (module docstring)."""
    la, ev = cfg.launcher, cfg.eval
    servers = eval_servers(cfg)
    context = (cfg.model.arch.max_position_embeddings if cfg.model.arch is not None
               else cfg.model.tiny.max_position_embeddings if cfg.model.hub_id is None else None)
    tps = la.eval_server_tokens_per_s
    rows = []
    for b in ev.benchmarks:
        spec = resolve(b, ev, {})
        problems = spec.expected_problems
        if spec.max_problems is not None and problems is not None:
            problems = min(problems, spec.max_problems)
        k = spec.samples
        max_new = spec.max_new_tokens if spec.max_new_tokens is not None else context
        chunk = max(1, ev.batch_size // k) * k  # the runner sends whole problems, k samples each, together
        in_flight = min(chunk, cfg.rl.gen_batch_size) if ev.engine == "vllm" else chunk
        measured = measured_completion(cfg, spec.name)
        if measured is not None:
            mean, source = measured[0], f"measured ({measured[1]})"
        elif la.eval_completion_share is not None and max_new is not None:
            mean, source = la.eval_completion_share * max_new, "assumed: launcher.eval_completion_share"
        else:
            mean, source = None, None
        row = {"name": spec.name, "title": spec.title, "k": k, "problems": problems, "max_new_tokens": max_new,
               "in_flight": in_flight, "in_flight_per_server": math.ceil(in_flight / servers["servers"]),
               "mean_completion": mean, "mean_source": source}
        if problems is not None:
            row["samples"] = problems * k
            row["tokens_max"] = row["samples"] * max_new if max_new is not None else None
            row["tokens_expected"] = row["samples"] * mean if mean is not None else None
            for key in ("max", "expected"):
                tokens = row[f"tokens_{key}"]
                row[f"hours_{key}"] = (tokens / (servers["servers"] * tps) / 3600
                                       if tokens is not None and tps else None)
        rows.append(row)
    return {**servers, "models": list(ev.checkpoints), "benchmarks": rows, "tokens_per_s": tps}


def _tokens(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,.0f}"


def _hours(h: float | None) -> str:
    return "n/a" if h is None else f"{h:.1f} h"


def describe_eval(cfg, ep: dict) -> list[str]:
    la = cfg.launcher
    n = len(ep["models"])
    if la.kind == "slurm" and cfg.eval.engine == "vllm":
        where = (f"{plural(ep['servers'], 'vLLM server')}, one a node (launcher.eval_nodes), TP {ep['tp']} within the "
                 f"node" + (f" x DP {ep['dp']}" if ep["dp"] > 1 else "") + ", data parallel across nodes; the eval "
                 "client on the job's first node")
    elif la.kind == "slurm":
        where = (f"{plural(ep['servers'], 'hf engine server')} on CPU, one a node (launcher.eval_nodes), data "
                 "parallel across nodes; the eval client on the job's first node")
    else:
        where = f"one {cfg.eval.engine} engine of its own"
    lines = [f"eval stage: {plural(n, 'model')} ({', '.join(ep['models'])}) one after the other, {where}"]
    if not ep["benchmarks"]:
        return lines + ["  no benchmarks in eval.benchmarks (the held-out suite's size is known after `make data`)"]
    tps = (f"hours at {ep['tokens_per_s']:g} completion tokens/s a server (assumed: launcher.eval_server_tokens_per_s)"
           if ep["tokens_per_s"] else "no hours: launcher.eval_server_tokens_per_s is not set")
    lines.append(f"  per model, each benchmark at its k; {tps}; prompts' prefill not counted")
    total = {"samples": 0, "tokens_max": 0.0, "tokens_expected": 0.0, "hours_max": 0.0, "hours_expected": 0.0}
    for r in ep["benchmarks"]:
        mean = (f"expected {_tokens(r.get('tokens_expected'))} (mean {r['mean_completion']:,.0f} a completion, "
                f"{r['mean_source']})" if r["mean_completion"] is not None else "expected n/a")
        lines.append(f"  {r['title']}: avg@{r['k']} x {r['problems'] if r['problems'] is not None else '?'} problems "
                     f"= {r.get('samples', '?')} samples, up to {r['in_flight']} requests in flight (about "
                     f"{r['in_flight_per_server']} a server); tokens at most {_tokens(r.get('tokens_max'))} "
                     f"({r['max_new_tokens']} each), {mean}; {_hours(r.get('hours_max'))} at most, "
                     f"{_hours(r.get('hours_expected'))} expected")
        for key in total:
            total[key] = None if total[key] is None or r.get(key) is None else total[key] + r[key]
    samples = "?" if total["samples"] is None else f"{total['samples']:,}"
    all_models = None if total["hours_expected"] is None else total["hours_expected"] * n
    lines.append(f"  all benchmarks, per model: {samples} samples, tokens at most {_tokens(total['tokens_max'])}, "
                 f"expected {_tokens(total['tokens_expected'])}; {_hours(total['hours_max'])} at most, "
                 f"{_hours(total['hours_expected'])} expected"
                 + (f"; x {n} models: {_hours(all_models)} expected" if n > 1 else ""))
    return lines


# -- the SLURM batch scripts ---------------------------------------------------------------------------------
TEMPLATES = Path(__file__).resolve().parent / "templates"
HEALTH_POLL_S = 2
JUDGE_URL_FILE = "judge_url"


def trainer_overrides(cfg, overrides: list[str]) -> list[str]:
    """The run's own overrides, with the resolved preset first (a second preset= would be ambiguous)."""
    return [f"preset={cfg.preset}"] + [o for o in overrides if not o.lstrip("+~").startswith("preset=")]


def _render(name: str, **values) -> str:
    # bash's ${#array[@]} holds Jinja's comment opener: comments are spelled <#-- --#> here instead
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, comment_start_string="<#--", comment_end_string="--#>")
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env.get_template(name).render(**values)


def policy_server(cfg, model_path) -> tuple[list[str], dict, str]:
    """(command, environment, kind) of the policy server a policy node runs: `vllm serve` on GPU nodes, the hf
    engine behind the same HTTP endpoints on CPU nodes (rl.engine=hf)."""
    if cfg.rl.engine == "vllm":
        # cuda=True: GPU nodes keep chunked prefill, whatever the machine that writes the plan has
        cmd = server_command(model_path, cfg, host=SERVER_HOST, python=SERVER_PYTHON, cuda=True)
        # the server's environment, but PYTHONPATH is the repository root on the cluster, not this machine's
        env = {k: v for k, v in server_env(base={}, cuda=True).items() if k != "PYTHONPATH"}
        return cmd, env, f"vLLM, TP {cfg.launcher.inference_tp}"
    return hf_server_command(model_path, cfg, host=SERVER_HOST, python=SERVER_PYTHON), {}, "hf engine server, CPU"


def _common(cfg, plan: dict) -> dict:
    la = cfg.launcher
    launch_dir = stage_dir(cfg, "launch")
    return {"preset": cfg.preset, "gpus_per_node": la.gpus_per_node, "time_limit": la.time_limit,
            "partition": la.partition, "launch_dir": launch_dir, "trainer_nodes": plan["trainer_nodes"],
            "ranks_per_node": ranks_per_node(cfg), "python": SERVER_PYTHON,
            "judge_url_file": launch_dir / JUDGE_URL_FILE}


def rl_script(cfg, plan: dict, overrides: list[str], judge_script: Path | None) -> str:
    la = cfg.launcher
    cmd, env, kind = policy_server(cfg, stage_dir(cfg, "sft") / "model")
    trainer = torchrun_on_nodes("recipe.rl", la.trainer_nodes, ranks_per_node(cfg), la.master_port,
                                trainer_overrides(cfg, overrides), python=SERVER_PYTHON)
    hsdp = f", HSDP {la.hsdp_replicas} replicas" if la.hsdp_replicas > 1 else ""
    return _render("rl.sbatch.j2", **_common(cfg, plan), nodes=plan["nodes"], policy_nodes=plan["policy_nodes"],
                   server_kind=kind, server_cmd=" ".join(shlex.quote(a) for a in cmd), server_env=sorted(env.items()),
                   server_port=cfg.rl.vllm_port, health_timeout_s=la.health_timeout_s, health_poll_s=HEALTH_POLL_S,
                   trainer_cmd=trainer, hsdp=hsdp, judge_script=judge_script, urls_env=INFERENCE_URLS_ENV)


def sft_script(cfg, plan: dict, overrides: list[str]) -> str:
    la = cfg.launcher
    trainer = torchrun_on_nodes("recipe.sft", la.trainer_nodes, ranks_per_node(cfg), la.master_port,
                                trainer_overrides(cfg, overrides), python=SERVER_PYTHON)
    return _render("sft.sbatch.j2", **_common(cfg, plan), trainer_cmd=trainer)


def judge_script(cfg, plan: dict) -> str:
    j = cfg.rl.judge
    cmd = [SERVER_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", j.hub_id, "--revision", j.revision,
           "--host", SERVER_HOST, "--port", str(j.port), "--data-parallel-size", str(j.data_parallel),
           "--tensor-parallel-size", str(j.tensor_parallel)]
    return _render("judge.sbatch.j2", **_common(cfg, plan), judge_model=j.hub_id, judge_revision=j.revision,
                   judge_port=j.port, judge_cmd=" ".join(shlex.quote(a) for a in cmd))


def served_model(cfg, entry: str) -> tuple[str, str | None, str]:
    """(what the servers load, its revision or None, a description) for one eval.checkpoints entry: a stage's
    model folder, a hub id at its commit (the servers read it from the HF cache, which they share), or a folder.
    Nothing is looked up: the plan runs where the models are not."""
    released = {m.name: m for m in cfg.eval.released}
    kind, hub_id, revision = checkpoint_entry(entry, list(released))
    if kind == "stage" and entry == "base" and cfg.model.hub_id:
        return cfg.model.hub_id, cfg.model.revision, f"{cfg.model.hub_id}@{cfg.model.revision}"
    if kind == "stage":
        return str(stage_dir(cfg, entry) / "model"), None, f"this run's {entry} stage"
    if kind == "released":
        m = released[entry]
        what = f"{m.hub_id}@{m.revision}" + ("" if m.revision_verified else ", revision unverified")
        return m.hub_id, m.revision, what
    if kind == "hub":
        return hub_id, revision, f"{hub_id}@{revision}"
    return entry, None, "local folder"


def eval_server_command(cfg, entry: str, ep: dict) -> list[str]:
    """The server an eval node runs for one model: with eval.engine=vllm `vllm serve` with the eval's
    generation_config (auto, as the release evals), the model at its revision, TP launcher.inference_tp and data
    parallel over the node's other GPUs; with eval.engine=hf the hf engine's server on a CPU node (as rl.sbatch's
    policy servers)."""
    model, revision, _ = served_model(cfg, entry)
    if cfg.eval.engine != "vllm":
        return hf_server_command(model, cfg, host=SERVER_HOST, python=SERVER_PYTHON) + (
            ["--revision", revision] if revision else [])
    cmd = server_command(model, cfg, host=SERVER_HOST, python=SERVER_PYTHON, generation_config="auto", cuda=True)
    if revision:
        cmd += ["--revision", revision, "--tokenizer-revision", revision]
    if ep["dp"] > 1:
        cmd += ["--data-parallel-size", str(ep["dp"])]
    return cmd


def eval_overrides(cfg, overrides: list[str], entry: str) -> list[str]:
    """The eval client's overrides in the job: the run's, with one model in eval.checkpoints."""
    kept = [o for o in trainer_overrides(cfg, overrides) if not o.lstrip("+~").startswith("eval.checkpoints=")]
    return kept + [f"eval.checkpoints=[{entry}]"]


def eval_script(cfg, ep: dict, overrides: list[str]) -> str:
    la = cfg.launcher
    env = {k: v for k, v in server_env(base={}, cuda=True).items() if k != "PYTHONPATH"}
    released = [m.name for m in cfg.eval.released]
    models = []
    for entry in ep["models"]:
        kind, hub_id, revision = checkpoint_entry(entry, released)
        client = [SERVER_PYTHON, "-m", "recipe.eval", *eval_overrides(cfg, overrides, entry)]
        folder = folder_name(kind, entry, hub_id, revision)
        served, served_revision, what = served_model(cfg, entry)
        models.append({"entry": entry, "folder": folder, "what": what, "hub_id": served, "revision": served_revision,
                       "results": stage_dir(cfg, "eval") / folder,
                       "server_cmd": " ".join(shlex.quote(a) for a in eval_server_command(cfg, entry, ep)),
                       "eval_cmd": " ".join(shlex.quote(a) for a in client)})
    kind = (f"vLLM, TP {ep['tp']}" + (f" x DP {ep['dp']}" if ep["dp"] > 1 else "") if cfg.eval.engine == "vllm"
            else "hf engine server, CPU")
    return _render("eval.sbatch.j2", **_common(cfg, placement(cfg)), nodes=ep["servers"], models=models,
                   server_kind=kind, server_env=sorted(env.items()), server_port=cfg.rl.vllm_port,
                   health_timeout_s=la.health_timeout_s, health_poll_s=HEALTH_POLL_S, urls_env=INFERENCE_URLS_ENV,
                   hub_models=[m for m in models if m["revision"]])


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


# -- printing ------------------------------------------------------------------------------------------------
def describe(cfg, plan: dict, mem: dict | None, tput: dict) -> list[str]:
    la, rl = cfg.launcher, cfg.rl
    lines = [f"preset {cfg.preset}: RL stage, launcher {la.kind} (dry run: nothing is started)"]
    if la.kind == "slurm":
        hsdp = f", HSDP: {la.hsdp_replicas} replicas" if la.hsdp_replicas > 1 else ""
        device = f"{la.gpus_per_node} GPUs" if la.gpus_per_node else "CPU"
        j = rl.judge
        judge = (f"judge: a 1-node job of its own, {j.hub_id} (vLLM, DP {j.data_parallel}, TP {j.tensor_parallel})"
                 if la.judge_nodes and j.hub_id else "judge: none")
        lines += [
            f"nodes: {plan['nodes']} in the RL job"
            + (f" + {plan['judge_nodes']} in the judge's job" if j.hub_id else "")
            + f", {device} each"
            + (f", {plan['total_gpus']} GPUs in all" if la.gpus_per_node else ""),
            f"trainer: {plural(plan['trainer_nodes'], 'node')}, {plural(plan['trainer_ranks'], 'rank')} under torchrun "
            f"(FSDP2{hsdp}); "
            f"rank 0 also runs the orchestrator",
            f"inference: {plural(plan['policy_nodes'], 'policy server')}, one a node "
            f"({policy_server(cfg, 'model')[2]}), data "
            f"parallel across nodes, port {rl.vllm_port}",
            judge,
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
        adamw = f"AdamW on {_count(mem['params_adamw'])} params (2 moments, float32)"
        muon = f"Muon on {_count(mem['params_muon'])} params (momentum, float32) / " if mem["params_muon"] else ""
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
    return lines + production_values(cfg)


def production_values(cfg) -> list[str]:
    """docs/recipe.md §11 against this config: every row for the production preset, the count for the others."""
    rows = compare(cfg)
    same = sum(ok for _, _, ok in rows)
    lines = [f"production values (docs/recipe.md §11): {same} of {len(rows)} as in INTELLECT-3's run"]
    if cfg.preset != "intellect3":
        return lines
    width = max(len(row.key) for row, _, _ in rows)
    for row, actual, ok in rows:
        shown = actual if ok else f"{actual}   DIFFERS: the run had {row.value}"
        lines.append(f"  {row.key:<{width}} = {shown}   [{row.source}]")
    return lines


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def write_scripts(cfg, plan: dict, overrides: list[str]) -> tuple[list[Path], list[str]]:
    """The SLURM batch scripts of a slurm launcher (judge first, when there is one to write), and lines to print."""
    launch_dir = stage_dir(cfg, "launch")
    written, lines = [], []
    judge = None
    j = cfg.rl.judge
    if cfg.launcher.judge_nodes and j.hub_id:
        if j.revision:
            judge = launch_dir / "judge.sbatch"
            write_atomic(judge, judge_script(cfg, plan))
            written.append(judge)
        else:  # every hub reference is pinned: no script serves an unpinned model
            lines.append(f"judge: no script written: rl.judge.revision is not set (pin {j.hub_id} to a commit)")
    for name, text in (("rl.sbatch", rl_script(cfg, plan, overrides, judge)), ("sft.sbatch",
                                                                              sft_script(cfg, plan, overrides)),
                       ("eval.sbatch", eval_script(cfg, eval_plan(cfg), overrides))):
        write_atomic(launch_dir / name, text)
        written.append(launch_dir / name)
    lines += [f"wrote {p}" for p in written]
    lines.append("submit: " + " && ".join(f"sbatch {p}" for p in written if p.name not in ("sft.sbatch",
                                                                                           "eval.sbatch"))
                 + f"   (SFT: sbatch {launch_dir / 'sft.sbatch'}; eval: sbatch {launch_dir / 'eval.sbatch'})")
    return written, lines


def launch(cfg, overrides: list[str]) -> list[Path]:
    validate_benchmarks(cfg.eval)
    plan = placement(cfg)
    lines = describe(cfg, plan, memory_estimate(cfg, plan), throughput(cfg, plan))
    lines += describe_eval(cfg, eval_plan(cfg))
    written = []
    if cfg.launcher.kind == "slurm":
        written, more = write_scripts(cfg, plan, overrides)
        lines += more
    else:  # local: `make rl` runs it; nothing to write
        lines.append("run: " + " ".join(["python", "-m", "recipe.rl",
                                         *map(shlex.quote, trainer_overrides(cfg, overrides))]))
    print("\n".join(lines))
    return written


@stage_main  # config errors become one line
def main(cfg):
    return launch(cfg, stage_argv())  # the raw overrides, for the trainer's command line
