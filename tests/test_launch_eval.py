"""`make plan` for the eval stage at scale: the eval job's servers (TP inside a node, data parallel across nodes),
requests in flight, tokens and hours for each benchmark at its k, and eval.sbatch from the template the RL launch
shares; and that script itself, run to the end under the srun/scontrol stand-ins of tests/slurm_standin."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.config import load_config
from recipe.eval.benchmarks import resolve
from recipe.launch.plan import describe_eval, eval_plan, eval_servers, launch
from recipe.runs import stage_dir, write_atomic

REPO = Path(__file__).parent.parent
STANDIN = REPO / "tests" / "slurm_standin"


def intellect3(tmp_path, *extra):
    return load_config(["preset=intellect3", f"run_root={tmp_path}", *extra])


def test_the_eval_job_serves_each_model_in_turn_to_the_eval_client(tmp_path, capsys):
    overrides = ["preset=intellect3", f"run_root={tmp_path}", "eval.checkpoints=[rl,INTELLECT-3,GLM-4.5-Air]",
                 "launcher.eval_nodes=4"]
    cfg = load_config(overrides)
    written = launch(cfg, overrides)
    script = tmp_path / "intellect3" / "launch" / "eval.sbatch"
    assert script in written and f"eval: sbatch {script}" in capsys.readouterr().out
    text = script.read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    servers = [ln for ln in text.splitlines() if "vllm.entrypoints.openai.api_server" in ln]
    clients = [ln for ln in text.splitlines() if ln.startswith("python -m recipe.eval ")]
    assert len(servers) == 3 and len(clients) == 3
    released = {m.name: m for m in cfg.eval.released}
    assert f"--model {tmp_path}/intellect3/rl/model " in servers[0] and "--revision" not in servers[0]
    for line, name in zip(servers[1:], ["INTELLECT-3", "GLM-4.5-Air"]):
        m = released[name]
        assert f"--model {m.hub_id} " in line and f"--revision {m.revision} --tokenizer-revision {m.revision}" in line
        assert f"hf download {m.hub_id} --revision {m.revision}" in text  # the cache to fill before submitting
    for line in servers:
        assert "--tensor-parallel-size 8" in line and "--generation-config auto" in line
        assert "--data-parallel-size" not in line  # TP 8 takes the node's 8 GPUs
    for line, entry in zip(clients, ["rl", "INTELLECT-3", "GLM-4.5-Air"]):
        assert line.count("eval.checkpoints=") == 1 and f"'eval.checkpoints=[{entry}]'" in line
        assert line.count("preset=") == 1 and f"run_root={tmp_path}" in line
    assert text.count('export RECIPE_INFERENCE_URLS  # the eval client spreads its requests over these servers') == 3
    assert f"server-GLM-4.5-Air-$node.log" in text
    assert str(REPO) not in text and sys.executable not in text and "{{" not in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_eval_servers_are_tensor_parallel_in_a_node_and_data_parallel_across_nodes(tmp_path):
    cfg = intellect3(tmp_path, "launcher.inference_tp=4", "rl.vllm_tensor_parallel_size=4", "launcher.eval_nodes=3",
                     "eval.checkpoints=[INTELLECT-3]")
    assert eval_servers(cfg) == {"servers": 3, "tp": 4, "dp": 2}
    launch(cfg, ["preset=intellect3"])
    line = next(ln for ln in (tmp_path / "intellect3" / "launch" / "eval.sbatch").read_text().splitlines()
                if "api_server" in ln)
    assert "--tensor-parallel-size 4" in line and "--data-parallel-size 2" in line
    lines = describe_eval(cfg, eval_plan(cfg))
    assert lines[0].startswith("eval stage: 1 model (INTELLECT-3) one after the other, 3 vLLM servers, one a node "
                               "(launcher.eval_nodes), TP 4 within the node x DP 2, data parallel across nodes")


def test_tokens_and_hours_follow_each_benchmarks_k_and_the_servers(tmp_path):
    cfg = intellect3(tmp_path)
    la, ev = cfg.launcher, cfg.eval
    one, four = eval_plan(cfg), eval_plan(intellect3(tmp_path, "launcher.eval_nodes=4"))
    assert [r["name"] for r in one["benchmarks"]] == [b.name for b in ev.benchmarks]
    for r, r4, b in zip(one["benchmarks"], four["benchmarks"], ev.benchmarks):
        spec = resolve(b, ev, {})
        assert (r["k"], r["problems"]) == (spec.samples, spec.expected_problems)
        assert r["samples"] == spec.expected_problems * spec.samples
        assert r["max_new_tokens"] == ev.max_new_tokens  # 81920: the release evals' max_tokens
        assert r["tokens_max"] == r["samples"] * ev.max_new_tokens
        assert r["tokens_expected"] == pytest.approx(r["samples"] * la.eval_completion_share * ev.max_new_tokens)
        assert r["mean_source"] == "assumed: launcher.eval_completion_share"
        assert r["hours_max"] == pytest.approx(r["tokens_max"] / la.eval_server_tokens_per_s / 3600)
        assert r4["hours_expected"] == pytest.approx(r["hours_expected"] / 4)  # four servers, data parallel
        # the runner sends whole problems (k samples each) up to eval.batch_size; the client's pool caps it
        in_flight = min(ev.batch_size // spec.samples * spec.samples, cfg.rl.gen_batch_size)
        assert r["in_flight"] == in_flight and r4["in_flight_per_server"] == math.ceil(in_flight / 4)
    text = "\n".join(describe_eval(cfg, one))
    aime = next(r for r in one["benchmarks"] if r["name"] == "aime24")
    assert f"AIME24: avg@64 x 30 problems = {30 * 64} samples, up to {aime['in_flight']} requests in flight" in text
    assert "(assumed: launcher.eval_server_tokens_per_s)" in text
    total = sum(r["samples"] for r in one["benchmarks"])
    assert f"all benchmarks, per model: {total:,} samples, tokens at most" in text
    no_tps = intellect3(tmp_path, "launcher.eval_server_tokens_per_s=null")
    assert all(r["hours_max"] is None and r["tokens_max"] is not None for r in eval_plan(no_tps)["benchmarks"])
    assert describe_eval(no_tps, eval_plan(no_tps))[1] == ("  per model, each benchmark at its k; no hours: "
                                                           "launcher.eval_server_tokens_per_s is not set; prompts' "
                                                           "prefill not counted")


def test_a_measured_mean_completion_replaces_the_assumed_one(tmp_path):
    cfg = intellect3(tmp_path)
    write_atomic(stage_dir(cfg, "eval") / "INTELLECT-3" / "aime24" / "results.json",
                 json.dumps({"mean_completion_tokens": 12000.0}))
    rows = {r["name"]: r for r in eval_plan(cfg)["benchmarks"]}
    assert rows["aime24"]["mean_completion"] == 12000.0
    assert rows["aime24"]["mean_source"] == "measured (eval/INTELLECT-3)"
    assert rows["aime24"]["tokens_expected"] == rows["aime24"]["samples"] * 12000.0
    assert rows["aime25"]["mean_source"].startswith("assumed")


def test_the_rl_and_eval_jobs_start_and_wait_for_their_servers_with_one_template(tmp_path):
    launch(intellect3(tmp_path, "eval.checkpoints=[rl]"), ["preset=intellect3"])
    launch_dir = tmp_path / "intellect3" / "launch"
    rl, ev = (launch_dir / "rl.sbatch").read_text(), (launch_dir / "eval.sbatch").read_text()
    shared = [ln for ln in rl.splitlines() if ln.startswith(("healthy() {", "deadline=", "trap ", "SERVER_PIDS=()"))]
    assert len(shared) == 4 and all(ln in ev.splitlines() for ln in shared)
    assert 'echo "policy server ${URLS[$i]} exited' in rl and 'echo "eval server ${URLS[$i]} exited' in ev


def test_a_local_plan_prints_the_eval_stage_and_writes_nothing(tmp_path, capsys):
    launch(load_config([f"run_root={tmp_path}", "eval.benchmarks=[{name:gpqa_diamond,samples:2}]"]), [])
    out = capsys.readouterr().out
    assert "eval stage: 3 models (base, sft, rl) one after the other, one hf engine of its own" in out
    assert "GPQA: avg@2 x 198 problems = 396 samples" in out and not (tmp_path / "tiny").exists()


# -- eval.sbatch, run ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # an hf engine server for the model and the eval client: about 30 s
def test_the_eval_sbatch_runs_to_the_end_under_srun_standins(tmp_path):
    """A hub model from a pre-filled HF cache (offline), served at its commit by the server of the job's node, and
    the eval client of the script's first node through RECIPE_INFERENCE_URLS. (One node: the stand-ins' nodes are
    one machine, where a second server could not take the same port; the servers' spread is the URL list above.)"""
    from tests.test_eval_models import HUB_ID, REVISION, fill_hub_cache, finish_data, save_model
    from tests.test_slurm_standin import NODES, free_port

    model = tmp_path / "local" / "tiny-model"
    save_model(model)
    cache = tmp_path / "hf" / "hub"
    fill_hub_cache(cache, model)
    entry = f"hub:{HUB_ID}@{REVISION}"
    args = [f"run_root={tmp_path / 'runs'}", "launcher=slurm_cpu", "launcher.eval_nodes=1",
            f"rl.vllm_port={free_port()}", "eval.samples=2", "eval.pass_k=[1,2]", "eval.max_new_tokens=4",
            f"eval.checkpoints=['{entry}']"]
    cfg = load_config(args)
    finish_data(cfg, n=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "TOKENIZERS_PARALLELISM": "false"}
    script = stage_dir(cfg, "launch") / "eval.sbatch"
    assert script in launch(cfg, args)  # `make plan`, in this process
    job_env = {**env, "PATH": os.pathsep.join([str(STANDIN), str(Path(sys.executable).parent), env["PATH"]]),
               "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": NODES[0], "SLURM_JOB_ID": "1",
               "SRUN_STANDIN_LOG": str(tmp_path / "srun.jsonl")}
    started = time.time()
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=job_env, capture_output=True, text=True,
                         timeout=600)
    print(f"the eval job ran {time.time() - started:.1f} s")
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    from recipe.eval.models import folder_name

    folder = folder_name("hub", entry, HUB_ID, REVISION)
    held = json.loads((stage_dir(cfg, "eval") / folder / "results.json").read_text())
    assert held["env"]["math"]["problems"] == 4 and held["provenance"]["model"]["revision"] == REVISION
    log = (stage_dir(cfg, "launch") / f"server-{folder}-{NODES[0]}.log").read_text()
    assert f"serving {cache}/models--org--tiny-glm/snapshots/{REVISION}" in log and "serve: stopped" in log
    steps = [json.loads(x) for x in (tmp_path / "srun.jsonl").read_text().splitlines()]
    assert [s["nodes"] for s in steps] == [[NODES[0]]]
    assert steps[0]["command"][-2:] == ["--revision", REVISION]  # the server reads the hub model at its commit
    assert (tmp_path / "runs" / "RESULTS.md").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_paper_table_evaluates_the_released_models_on_the_benchmarks_only():
    res = subprocess.run(["make", "-n", "paper-table"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0
    line = next(ln for ln in res.stdout.splitlines() if "-m recipe.eval " in ln)
    overrides = line.split("-m recipe.eval ", 1)[1].split()
    assert overrides == ["preset=intellect3", "eval.held_out=false", "eval.checkpoints=[INTELLECT-3,GLM-4.5-Air]"]
    cfg = load_config(overrides)  # names the preset's released models, each pinned
    assert list(cfg.eval.checkpoints) == [m.name for m in cfg.eval.released] and cfg.eval.benchmarks
    more = subprocess.run(["make", "-n", "paper-table", 'ARGS=eval.held_out=true'], capture_output=True, text=True,
                          cwd=REPO).stdout
    assert load_config(next(ln for ln in more.splitlines() if "-m recipe.eval " in ln)
                       .split("-m recipe.eval ", 1)[1].split()).eval.held_out  # ARGS come last and win
