"""`make sft` on several ranks: `python -m recipe.sft launcher.num_processes=2` re-runs itself under torchrun, 2 CPU
ranks train TRL's SFTTrainer over gloo (DDP), and the stage is the one-process stage at the same global batch.

- one process (here) and 2 ranks (torchrun, through the relaunch) take the same steps: the same examples a step
  (the Trainer's sampler hands each rank its half of every global batch), per-step loss within 1e-4 relative and
  the same token counts, over 20 steps (2.5 epochs);
- SIGTERM to the stage (torchrun its child) stops both ranks after the same step, with a checkpoint of it both wrote to; a rerun on 2
  ranks resumes from it (rank 0 alone removes a damaged newer checkpoint) and ends where one process ends; one
  metrics record a step, the files only rank 0 writes, one DONE.json and manifest, a final model transformers
  loads;
- the relaunch comes after the stage's own checks (sft and base), and a global batch the ranks cannot split
  evenly is refused with one line before any rank starts;
- FSDP2 settings only for GPU ranks, and a sharded (torch.distributed.checkpoint) checkpoint is checked as whole
  or not; rank 0's tokenizer reaches the other ranks of `make base` unchanged.
"""
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recipe.base import __main__ as base_main
from recipe.config import TrainConfig, load_config
from recipe.data.schema import message, write_rows
from recipe.errors import ConfigError
from recipe.launch import roles
from recipe.rl.dist import World
from recipe.runs import Stage, stage_dir, write_atomic
from recipe.sft import __main__ as sft_main
from recipe.sft import checkpoint_problem, per_device_batch, sharding
from tests.fakes import save_tiny_qa_model

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20  # 40 rows, a global batch of 8: 5 steps an epoch, so the runs cross epoch boundaries (a reshuffle)
# constant LR without warmup: the schedule does not depend on max_steps, so the run signalled at step n (with
# max_steps far away) and its rerun to STEPS follow the one-process run to STEPS
ARGS = ["sft.batch_size=8", "sft.logging_steps=1", "sft.save_steps=100000", "sft.threads=1", "sft.warmup_ratio=0",
        "sft.scheduler=constant", "sft.max_length=64", "launcher.collective_timeout_s=120"]
# fp32, the same examples each step: the runs differ only in summation order (DDP's all-reduce of the gradients,
# each rank padding its half of the batch to its own longest row): measured at most 2e-7 relative over the 20
# steps. 1e-5 leaves room for Adam, which turns such rounding into steps of up to lr where a gradient is ~0 (the
# key biases, whose gradient is rounding alone), and for other BLAS builds. Other batches move it far more:
# another data order (sft.seed=1) puts step 1 3.6e-3 apart, and the 20 steps up to 1.1e-2
LOSS_RTOL = 1e-5


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prepared_root(root: Path, model: Path, args: list[str]) -> None:
    """A run root with finished data (40 SFT rows `Q<n>` -> `<think>t</think><n>`) and base (the tiny test
    model) stages."""
    cfg = load_config([f"run_root={root}", *args])
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "split": "sft", "prompt": [message("user", f"Q{i}")],
             "completion": [message("assistant", f"<think>t</think>{i}")], "answer": str(i), "info": "{}",
             "difficulty": 0.0, "tools": "[]"} for i in range(40)]
    data = stage_dir(cfg, "data")
    sha = write_rows(rows, data / "sft.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"sft.parquet": {"rows": 40, "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    shutil.copytree(model, stage_dir(cfg, "base") / "model")
    write_atomic(stage_dir(cfg, "base") / "DONE.json", json.dumps({"config_hash": Stage(cfg, "base").hash}))


def records(sft_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (sft_dir / "metrics.jsonl").read_text().splitlines()]


def losses(sft_dir: Path) -> dict[int, dict]:
    """The per-step records (the Trainer's end-of-train summary has no loss)."""
    out = {}
    for r in records(sft_dir):
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice"
            out[r["step"]] = r
    return out


def stop_lines(log: str) -> list[str]:
    return sorted(ln[ln.index("sft: stopped"):] for ln in re.split(r"[\r\n]", log) if "sft: stopped" in ln)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process to STEPS, here. Then `python -m recipe.sft launcher.num_processes=2` (the relaunch: torchrun,
    2 ranks) with max_steps far away, SIGTERM after 2 records; a damaged newer checkpoint planted; the same
    command rerun to STEPS."""
    root = tmp_path_factory.mktemp("sft_ranks")
    save_tiny_qa_model(root / "start")
    single_args = [f"run_root={root / 'single'}", *ARGS]
    prepared_root(root / "single", root / "start", ARGS)
    t0 = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        sft_main.main([*single_args, f"sft.max_steps={STEPS}"])
    single_s = time.time() - t0

    ranks_args = [f"run_root={root / 'ranks'}", "launcher.num_processes=2", *ARGS]
    prepared_root(root / "ranks", root / "start", ARGS)
    sft_dir = stage_dir(load_config(ranks_args), "sft")
    t0 = time.time()
    with open(root / "stopped.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "recipe.sft", *ranks_args, "sft.max_steps=100000"], cwd=ROOT,
                                env=env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if (sft_dir / "metrics.jsonl").exists() and len(records(sft_dir)) >= 2:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, (root / "stopped.log").read_text()[-4000:]
            proc.send_signal(signal.SIGTERM)  # the stage passes it on to torchrun, whose agent passes it on
            stopped_rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stopped_s = time.time() - t0
    stopped_log = (root / "stopped.log").read_text()
    stopped_records = records(sft_dir)
    ckpts = sorted(p.name for p in (sft_dir / "checkpoints").glob("checkpoint-*"))
    assert len(ckpts) == 1, (ckpts, stopped_log[-4000:])
    n = int(ckpts[0].split("-")[1])
    assert n < STEPS, f"the signal landed after step {n}: the rerun to {STEPS} would have nothing to do"
    stopped_files = sorted(p.name for p in (sft_dir / "checkpoints" / ckpts[0]).iterdir())

    damaged = sft_dir / "checkpoints" / f"checkpoint-{n + 1}"  # as a kill during its save would leave it
    shutil.copytree(sft_dir / "checkpoints" / ckpts[0], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    t0 = time.time()
    # torchrun itself this time (the command the relaunch execs, one interpreter start fewer)
    rerun = subprocess.run(roles.torchrun_command("recipe.sft", 2, [*ranks_args, f"sft.max_steps={STEPS}"]),
                           cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout[-2000:], rerun.stderr[-4000:])
    rerun_s = time.time() - t0
    print(f"\none process, {STEPS} steps: {single_s:.1f} s; 2 ranks: to the signal {stopped_s:.1f} s (stopped at "
          f"step {n}), the rerun to {STEPS} {rerun_s:.1f} s")
    return {"single": stage_dir(load_config(single_args), "sft"), "ranks": sft_dir, "n": n,
            "stopped": (stopped_rc, stopped_log, stopped_records, stopped_files), "rerun": rerun,
            "damaged": damaged}


@pytest.mark.slow  # 2 launches of 2 ranks under torchrun: 15-30 s each on 2 busy cores
def test_two_ranks_take_the_one_process_steps(runs):
    one, two = losses(runs["single"]), losses(runs["ranks"])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    worst = max(abs(two[s]["loss"] - one[s]["loss"]) / abs(one[s]["loss"]) for s in one)
    assert worst <= LOSS_RTOL, worst
    # the same examples each step: the same token counts (summed over the ranks), step by step
    assert [two[s]["num_tokens"] for s in two] == [one[s]["num_tokens"] for s in one]
    assert all(two[s]["learning_rate"] == one[s]["learning_rate"] for s in one)
    assert one[STEPS]["loss"] < 0.75 * one[1]["loss"]  # it learned: the curves compared are not flat
    print(f"per-step loss, 2 ranks against one process: at most {worst:.2e} relative")


@pytest.mark.slow
def test_sigterm_stops_both_ranks_after_the_same_step_and_the_rerun_resumes_from_it(runs):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    n, sft_dir = runs["n"], runs["ranks"]
    rc, log, stopped_records, files = runs["stopped"]
    assert rc == 143  # as in one process (the stage runs torchrun as its child: torchrun's own code would be 1)
    assert stop_lines(log) == sorted([  # every rank stops after step n, rank 0 names the checkpoint
        f"sft: stopped by SIGTERM; the next run resumes from checkpoint {sft_dir / 'checkpoints' / f'checkpoint-{n}'}",
        f"sft: stopped by SIGTERM; rank 1 stopped with rank 0 after step {n}"]), log[-3000:]
    assert [r["step"] for r in stopped_records if "loss" in r] == list(range(1, n + 1))
    assert "Unable to shutdown process" not in log  # every rank left by itself: none hung at exit (SIGKILLed)
    # the signal's checkpoint (save_steps is far away), saved by both ranks: each its RNG state, rank 0 the rest
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(files)

    out = runs["rerun"].stdout + runs["rerun"].stderr
    skipped = [ln for ln in re.split(r"[\r\n]", out) if ln.startswith("skipping ")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping checkpoint-{n + 1}: model.safetensors is")
    # rank 0 removed it; the rerun saved only its last step (save_steps is far away)
    assert {p.name for p in (sft_dir / "checkpoints").glob("checkpoint-*")} == {f"checkpoint-{n}",
                                                                                 f"checkpoint-{STEPS}"}
    resumed = [ln for ln in out.splitlines() if ln.startswith("resuming from")]  # rank 0 alone speaks
    assert resumed == [f"resuming from {sft_dir / 'checkpoints' / f'checkpoint-{n}'} (step {n})"]

    # one record a step, none twice (the rerun dropped nothing it had not redone)
    assert sorted(losses(sft_dir)) == list(range(1, STEPS + 1))
    assert max(r["step"] for r in records(sft_dir)) == STEPS
    # the files only rank 0 writes, once; the other rank took no lock and wrote nothing of its own here
    assert sorted(p.name for p in sft_dir.iterdir()) == [".lock", "DONE.json", "checkpoints", "config.yaml",
                                                         "manifest.json", "metrics.jsonl", "model"]
    manifest = json.loads((sft_dir / "manifest.json").read_text())
    assert manifest["stage"] == "sft" and "launcher.num_processes=2" in manifest["command"]
    card = ModelCard.load(sft_dir / "model" / "README.md")  # rank 0's, from the command torchrun gave it
    assert card.data.recipe["stage"] == "sft" and card.data.recipe["command"].startswith("make sft PRESET=tiny ARGS=")
    assert "launcher.num_processes=2" in card.data.recipe["command"]
    assert json.loads((sft_dir / "DONE.json").read_text())["config_hash"] == manifest["config_hash"]
    final = AutoModelForCausalLM.from_pretrained(sft_dir / "model")
    single = AutoModelForCausalLM.from_pretrained(runs["single"] / "model")
    a, b = single.state_dict(), final.state_dict()
    assert a.keys() == b.keys()
    # the same weights but for rounding (Adam's ~lr steps on the key biases' ~0 gradients: see LOSS_RTOL)
    worst = max((a[k] - b[k]).abs().max().item() for k in a if "k_proj.bias" not in k)
    assert worst < 1e-4, worst
    print(f"final weights, 2 ranks against one process: at most {worst:.1e} apart (key biases aside)")


# -- the relaunch, the batch check (no ranks) ----------------------------------------------------------------------

class Started:
    """What roles.relaunch starts (torchrun as its child), recorded instead of run."""

    def __init__(self, log: list, cmd: list, env: dict):
        log.append((cmd[0], cmd, env))

    def wait(self) -> int:
        return 0


def test_relaunch_runs_sft_under_torchrun_after_its_own_checks(tmp_path, monkeypatch, capsys):
    args = [f"run_root={tmp_path}", "launcher.num_processes=2", *ARGS]
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    execs = []
    monkeypatch.setattr(roles.subprocess, "Popen", lambda cmd, env, preexec_fn: Started(execs, cmd, env))
    with pytest.raises(SystemExit) as e:  # no finished data stage: the usual one line, and nothing started
        sft_main.main(args)
    assert e.value.code == 2 and "stage 'data' has not finished" in capsys.readouterr().err and not execs
    save_tiny_qa_model(tmp_path / "start")
    prepared_root(tmp_path, tmp_path / "start", ARGS)
    sft_main.main(args)
    (path, cmd, e), = execs
    assert path == sys.executable and cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc-per-node=2", "-m", "recipe.sft", *args]
    assert e["OMP_NUM_THREADS"] == "1"  # sft.threads
    write_atomic(stage_dir(load_config(args), "sft") / "DONE.json",
                 json.dumps({"config_hash": Stage(load_config(args), "sft").hash}))
    sft_main.main(args)  # finished: said here, no rank started
    assert "sft: already done" in capsys.readouterr().out and len(execs) == 1


def test_relaunch_runs_base_under_torchrun_after_its_own_checks(tmp_path, monkeypatch, capsys):
    args = [f"run_root={tmp_path}", "launcher.num_processes=2", "base.threads=1"]
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    execs = []
    monkeypatch.setattr(roles.subprocess, "Popen", lambda cmd, env, preexec_fn: Started(execs, cmd, env))
    with pytest.raises(SystemExit) as e:
        base_main.main(args)
    assert e.value.code == 2 and "stage 'data' has not finished" in capsys.readouterr().err and not execs
    cfg = load_config(args)
    write_atomic(stage_dir(cfg, "data") / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    base_main.main(args)
    (path, cmd, e), = execs
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "recipe.base", *args]
    assert e["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("main, key", [(sft_main.main, "sft"), (base_main.main, "base")])
def test_a_global_batch_the_ranks_cannot_split_evenly_is_refused_before_any_rank_starts(tmp_path, monkeypatch,
                                                                                         capsys, main, key):
    execs = []
    monkeypatch.setattr(roles.subprocess, "Popen", lambda cmd, env, preexec_fn: Started(execs, cmd, env))
    with pytest.raises(SystemExit) as e:
        main([f"run_root={tmp_path}", "launcher.num_processes=4", f"{key}.batch_size=6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not execs and err.count("\n") == 1
    assert err == (f"error: config error: {key}.batch_size=6 is the global batch and is split evenly over "
                   f"launcher.num_processes=4 ranks: make it a multiple of 4\n")
    assert not (tmp_path / "tiny").exists()  # refused before the stage took its folder


def test_each_rank_takes_its_share_of_the_global_batch():
    cfg = TrainConfig(batch_size=8)
    assert [per_device_batch(cfg, "sft", n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ConfigError, match=r"sft\.batch_size=8 .* launcher\.num_processes=3"):
        per_device_batch(cfg, "sft", 3)  # also in the ranks, whoever started them (world size 3)


# -- FSDP2 on GPU ranks; sharded checkpoints (no ranks) --------------------------------------------------------------

def test_fsdp2_is_asked_for_gpu_ranks_only(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_qa_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    cpu = torch.device("cpu")
    two = World(0, 2, cpu)
    assert sharding(model, TrainConfig(), two, use_cpu=True) == {}  # DDP
    assert sharding(model, TrainConfig(), World(0, 1, cpu), use_cpu=False) == {}  # one process
    got = sharding(model, TrainConfig(gradient_checkpointing=True), two, use_cpu=False)
    assert got == {"fsdp": True,
                   "fsdp_config": {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                   "transformer_layer_cls_to_wrap": ["Glm4MoeDecoderLayer"],
                                   "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                                   "activation_checkpointing": True}}


def sharded_checkpoint(folder: Path) -> Path:
    """A checkpoint as the Trainer writes it under FSDP2 with SHARDED_STATE_DICT (one process writes the
    torch.distributed.checkpoint folders here, as every rank would its shards)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    torch.save({"last_epoch": 3}, folder / "scheduler.pt")
    torch.save({"python": 0}, folder / "rng_state_0.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}},
                 storage_writer=dcp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")))
        dcp.save({"optimizer": {"exp_avg": torch.randn(64, 64)}},
                 storage_writer=dcp.FileSystemWriter(str(folder / "optimizer_0")))
    return folder


@pytest.mark.parametrize("damage, problem", [
    (None, None),
    (lambda c: (c / "pytorch_model_fsdp_0" / ".metadata").unlink(), "pytorch_model_fsdp_0/.metadata is missing"),
    (lambda c: (c / "optimizer_0" / ".metadata").write_bytes(b"\x80"), "optimizer_0/.metadata does not read"),
    (lambda c: (c / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink(), "pytorch_model_fsdp_0/__0_0.distcp is missing"),
    (lambda c: (c / "optimizer_0" / "__0_0.distcp").write_bytes(b"x" * 100), "optimizer_0/__0_0.distcp is 100 bytes"),
    (lambda c: shutil.rmtree(c / "optimizer_0"), "optimizer_0/.metadata is missing"),
    (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt is missing"),
], ids=["whole", "no-model-metadata", "bad-optimizer-metadata", "no-shard", "short-shard", "no-optimizer",
        "no-scheduler"])
def test_a_sharded_checkpoint_is_checked_from_its_metadata(tmp_path, damage, problem):
    ckpt = sharded_checkpoint(tmp_path / "checkpoint-3")
    if damage:
        damage(ckpt)
    got = checkpoint_problem(ckpt)
    assert got == problem if problem is None else got.startswith(problem), got


def test_the_base_ranks_get_rank_0s_tokenizer_unchanged():
    from recipe.model import build_tokenizer, tokenizer_from_str

    tok = build_tokenizer([f"Q{i} <think>t</think>{i * 7}" for i in range(50)], 200)
    copy = tokenizer_from_str(tok.backend_tokenizer.to_str())
    assert copy.get_vocab() == tok.get_vocab()
    text = tok.apply_chat_template([{"role": "user", "content": "Q12"}, {"role": "assistant", "content": "12"}],
                                   tokenize=False)
    assert copy.apply_chat_template([{"role": "user", "content": "Q12"}, {"role": "assistant", "content": "12"}],
                                    tokenize=False) == text
    assert copy.encode(text) == tok.encode(text)
    assert (copy.eos_token_id, copy.pad_token_id, copy.padding_side) == (tok.eos_token_id, tok.pad_token_id, "left")
