"""The RL stage on several trainer ranks (recipe.rl.dist), shown with 2 CPU ranks over gloo under torchrun.

- the step's samples are split by tokens, deterministically (no ranks needed);
- 2 ranks (FSDP2) and 1 process take the same step on the same batch: same loss, same updated weights (fp32,
  within 1e-6), and the weights they publish are the same; Muon on FSDP2 shards takes the one-process
  step (bit for bit on the same gradients);
- a checkpoint saved by 2 ranks resumes on 1 and one saved by 1 resumes on 2, each giving the next step of the
  uninterrupted run (within 1e-6);
- `python -m recipe.rl` re-runs itself under torchrun after the stage's own checks;
- SIGTERM to torchrun stops both ranks after the same step, with a checkpoint of it;
- `python -m recipe.rl` on 2 ranks with the real hf engine process: kill -9 of either rank stops the whole job
  (torchrun exits non-zero, no process of it is left, the engine process included) and a rerun resumes from
  the last checkpoint; one metrics record a step, the files only rank 0 writes, a final model transformers
  loads, and a checkpoint of the 2 ranks resumes on 1.
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

from recipe.config import load_config
from recipe.launch import roles
from recipe.rl import __main__ as rl_main
from recipe.rl.dist import World, sample_tokens, split_by_tokens
from recipe.rl.orchestrator import Sample
from recipe.rl.trainer import checkpoint_model_state, load_checkpoint, publish_weights, save_checkpoint
from recipe.runs import Stage, StageError, stage_dir, write_atomic
from recipe.weights import INDEX_NAME, read_weights, write_weights
from tests import dist_ranks
from tests.dist_ranks import batches, step, trainer
from tests.fakes import save_tiny_qa_model, write_math_rl_data

ROOT = Path(__file__).resolve().parent.parent
HELPER = str(ROOT / "tests" / "dist_ranks.py")
SINGLE = World()


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", HELPER, *args]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# A key bias adds the same number to every score of a query, which the softmax ignores: its gradient is zero
# but for rounding, and Adam scales that rounding up to a step of about lr in a direction of its own. Where it
# is compared, it is compared against that bound (2 steps of RL_CFG's lr), not against 1e-6.
NOISE_ONLY = "self_attn.k_proj.bias"
NOISE_ATOL = 2 * dist_ranks.RL_CFG["lr"]


def close(a: dict, b: dict, atol: float) -> float:
    """The largest difference between two state dicts with the same keys and shapes (key biases aside)."""
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    diff = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}
    worst = max(d for k, d in diff.items() if NOISE_ONLY not in k)
    assert worst <= atol, (worst, max(diff, key=diff.get))
    assert all(d <= max(atol, NOISE_ATOL) for k, d in diff.items() if NOISE_ONLY in k), diff
    return worst


# -- the split (no ranks) -------------------------------------------------------------------------------------

def sample(n_prompt: int, n_comp: int, tag: int) -> Sample:  # the tag in the advantage, never 0
    return Sample([1] * n_prompt, [2] * n_comp, [-1.0] * n_comp, [1] * n_comp, float(tag + 1), 0.0, 0, "math")


def test_the_split_balances_tokens_deterministically_and_keeps_the_batch_order():
    lengths = [40, 3, 17, 17, 5, 28, 9, 9, 2, 33, 12, 6]
    samples = [sample(4, n, i) for i, n in enumerate(lengths)]
    for n in (1, 2, 3, 5):
        shares = split_by_tokens(samples, n)
        assert shares == split_by_tokens(samples, n) and len(shares) == n
        tags = [[s.advantage - 1 for s in share] for share in shares]
        assert sorted(t for share in tags for t in share) == [float(i) for i in range(len(samples))]  # each once
        assert all(share == sorted(share) for share in tags)  # in the batch's order
        loads = [sum(sample_tokens(s) for s in share) for share in shares]
        assert max(loads) - min(loads) <= max(sample_tokens(s) for s in samples)  # greedy's bound
    loads = [sum(sample_tokens(s) for s in share) for share in split_by_tokens(samples, 2)]
    assert loads == [115, 114]  # longest first onto the lighter share: 229 tokens split 115 / 114
    assert split_by_tokens(samples[:2], 3)[2] == []  # fewer samples than ranks: a rank gets none (and idles)
    # a sample of advantage 0 costs no pass (train_step skips it): it weighs nothing in the split
    flat = [Sample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, 0.0, 0.0, 0, "math") for s in samples[:4]]
    assert [sample_tokens(s) for s in flat] == [0] * 4
    loads = [sum(sample_tokens(s) for s in share) for share in split_by_tokens(flat + samples, 2)]
    assert loads == [115, 114]


# -- weights files (no ranks) ---------------------------------------------------------------------------------

def test_large_weights_are_written_as_shards_with_an_index_and_read_back_by_the_engine(tmp_path):
    from recipe.inference.hf import HFEngine
    from recipe.model import load_pretrained

    start = tmp_path / "start"
    save_tiny_qa_model(start)
    model, tok = load_pretrained(str(start))
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    small = write_weights(state, tmp_path / "w" / "policy_000001.safetensors")
    assert small.is_file() and small.name == "policy_000001.safetensors"
    big = write_weights(state, tmp_path / "w" / "policy_000002.safetensors", max_shard_bytes=40_000)
    assert big.is_dir() and big.name == "policy_000002"
    index = json.loads((big / INDEX_NAME).read_text())
    shards = sorted(p.name for p in big.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(state) and not list((tmp_path / "w").glob(".*"))
    for path in (small, big):
        got = read_weights(path)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    engine = HFEngine(model, tok, [0])
    engine.update_weights(big, 2)  # the engine contract takes a folder with an index as well as a file
    assert engine.policy_version == 2
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # publishing keeps the newest versions whatever their form
    for v in (3, 4, 5):
        publish_weights(model, tmp_path / "w", v)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == \
        ["LATEST", "policy_000003.safetensors", "policy_000004.safetensors", "policy_000005.safetensors"]


# -- 2 ranks against 1 process: steps, published weights, checkpoints ------------------------------------------

@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """The one-process run here; the 2-rank run under torchrun (tests/dist_ranks.py steps)."""
    folder = tmp_path_factory.mktemp("dist_steps")
    save_tiny_qa_model(folder / "start")
    single = folder / "single"
    model, opt, sch, cfg, tok = trainer(folder / "start", "adamw", SINGLE)
    a, b = batches(len(tok))
    stats = step(model, opt, sch, cfg, a, SINGLE, tok.pad_token_id)
    published = publish_weights(model, single / "weights", 1)
    save_checkpoint(single / "checkpoints", 1, model, opt, sch, {"from": "single"}, keep=2)
    step(model, opt, sch, cfg, b, SINGLE, tok.pad_token_id)
    after_b = {k: v.clone() for k, v in model.state_dict().items()}

    t0 = time.time()
    res = subprocess.run(torchrun("steps", str(folder)), cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks_s = time.time() - t0
    ranks = folder / "ranks"
    states = torch.load(ranks / "states.pt")

    # 2 -> 1: the checkpoint the ranks saved, then the same next step here
    model, opt, sch, cfg, _ = trainer(folder / "start", "adamw", SINGLE)
    at, orch = load_checkpoint(ranks / "checkpoints" / "step_000001", model, opt, sch)
    step(model, opt, sch, cfg, b, SINGLE, tok.pad_token_id)
    # Muon in one process: a train step on batch a, and two steps of the optimizer alone on fixed gradients
    model_m, opt_m, sch_m, cfg_m, _ = trainer(folder / "start", "muon", SINGLE)
    step(model_m, opt_m, sch_m, cfg_m, a, SINGLE, tok.pad_token_id)
    muon = {"step": dict(model_m.state_dict()),
            "matrices": [n for n, p in model_m.named_parameters()
                         if any(p is q for g in opt_m.optimizers[0].param_groups for q in g["params"])]}
    model_m, opt_m, _, _, _ = trainer(folder / "start", "muon", SINGLE)
    dist_ranks.fixed_gradient_steps(model_m, opt_m)
    muon["fixed"] = dict(model_m.state_dict())
    return {"folder": folder, "stats": (stats, json.loads((ranks / "stats.json").read_text())),
            "published": (read_weights(published), read_weights(ranks / "weights" / "policy_000001.safetensors")),
            "after_b": after_b, "ranks": states, "single_from_ranks": (at, orch, dict(model.state_dict())),
            "muon": {**muon, "ranks": states["muon"]}, "ranks_s": ranks_s}


@pytest.mark.slow  # the 2 ranks under torchrun: about 20 s, and the one-process references
def test_two_ranks_take_the_one_process_step_same_loss_same_weights(steps):
    one, two = steps["stats"]
    for k in ("loss", "grad_norm", "mean_ratio"):
        assert two[k] == pytest.approx(one[k], abs=1e-6), k
    for k in ("loss_tokens", "masked_share_high", "masked_share", "lr"):
        assert two[k] == one[k], k
    assert one["masked_share_high"] > 0 and one["loss_tokens"] == 68  # the batch has what it is meant to have
    a = batches(160)[0]
    assert [len(share) for share in split_by_tokens(a, 2)] == [4, 6]  # 2 and 3 micro-batches: an idle pass
    # the published weights are the updated weights: both runs publish the same, within 1e-6 (fp32)
    close(*steps["published"], atol=1e-6)
    single, ranks = steps["published"]
    close(single, steps["ranks"]["hsdp"], atol=1e-6)  # HSDP, 2 replicas: the same step
    # rank 0 alone read the weights; rank 1 built the model on the meta device and received its shards
    ranks_dir = steps["folder"] / "ranks"
    assert json.loads((ranks_dir / "loads_rank0.json").read_text()) == [False, True]
    assert json.loads((ranks_dir / "loads_rank1.json").read_text()) == [False]
    start = read_weights(steps["folder"] / "start" / "model.safetensors")
    # the step moved them (the start folder holds the experts per expert, as save_pretrained writes them, the
    # published weights fused, as the model holds them: compare the names both have)
    common = start.keys() & single.keys()
    assert len(common) > len(start) // 2 and any(not torch.equal(single[k], start[k]) for k in common)
    print(f"2 ranks under torchrun: {steps['ranks_s']:.1f} s")


@pytest.mark.slow  # the 2 ranks under torchrun: about 20 s, and the one-process references
def test_muon_on_fsdp2_shards_takes_the_one_process_step(steps):
    """recipe.rl.muon on FSDP2's DTensor shards: each rank orthogonalises its own experts (the 3-D tensors are
    sharded on the expert dim) and gathers each 2-D matrix whole, so every matrix goes through the bf16
    Newton-Schulz of one process. On the same gradients, two steps of the optimizer alone on 2 ranks are the
    one-process steps bit for bit (FSDP2, and HSDP's 2-D mesh). A train step, whose gradients round differently
    on 2 ranks (as in the AdamW test above), lands within 1e-6 of it."""
    m = steps["muon"]
    # attention (4 a layer), the dense MLP of layer 0, and in the MoE layer 1 the router, the shared expert and
    # the two 3-D expert tensors: everything with ndim >= 2 but the embeddings and the head
    assert len(m["matrices"]) == 17 and {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                                        "model.layers.1.mlp.experts.down_proj"} <= set(m["matrices"])
    fixed, ranks = m["fixed"], steps["ranks"]
    assert fixed.keys() == ranks["muon_fixed"].keys()
    for run in ("muon_fixed", "muon_fixed_hsdp"):
        unequal = [k for k in fixed if not torch.equal(fixed[k], ranks[run][k])]
        assert not unequal, (run, unequal)
    start = read_weights(steps["folder"] / "start" / "model.safetensors")
    assert not torch.equal(fixed["model.layers.0.self_attn.q_proj.weight"],
                           start["model.layers.0.self_attn.q_proj.weight"])
    worst = close(m["step"], ranks["muon"], atol=1e-6)
    print(f"muon: fixed gradients, 2 ranks == 1 process bit for bit; a train step within {worst:.1e}")


@pytest.mark.slow  # the 2 ranks under torchrun: about 20 s, and the one-process references
def test_checkpoints_resume_across_world_sizes_with_the_next_step_of_the_uninterrupted_run(steps):
    after_b = steps["after_b"]
    close(after_b, steps["ranks"]["after_b"], atol=1e-6)  # 2 ranks uninterrupted
    at, orch, state = steps["single_from_ranks"]
    assert at == 1 and orch == {"from": "ranks"}
    close(after_b, state, atol=1e-6)  # saved by 2 ranks, resumed by 1
    assert steps["ranks"]["resumed_step"] == 1
    close(after_b, steps["ranks"]["resumed_from_single"], atol=1e-6)  # saved by 1, resumed by 2
    ckpt = steps["folder"] / "ranks" / "checkpoints" / "step_000001"
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 1, "world_size": 2}
    assert sorted(p.name for p in (ckpt / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "rng_rank0.pt").exists() and (ckpt / "rng_rank1.pt").exists()
    close(checkpoint_model_state(ckpt), steps["published"][1], atol=0)  # the weights it holds, read alone


# -- python -m recipe.rl on 2 ranks: kill -9 of either rank, resume, finish; then resume on 1 ----------------------

RL_ARGS = ["rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8", "rl.micro_batch_size=2",
           "rl.pin_cores=false", "rl.seed=0", "rl.checkpoint_every=2", "rl.engine=hf", "rl.gen_batch_size=8",
           "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0",
           "launcher.collective_timeout_s=120"]
STEPS = 5


def prepared_root(root: Path, args: list[str]) -> None:
    """A run root with finished data and sft stages (the tiny test model as the SFT model) for `args`."""
    cfg = load_config([f"run_root={root}", *args])
    write_math_rl_data(cfg)
    save_tiny_qa_model(stage_dir(cfg, "sft") / "model")
    write_atomic(stage_dir(cfg, "sft") / "DONE.json", json.dumps({"config_hash": Stage(cfg, "sft").hash}))


def records(rl_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]


class FakeTorchrun:
    """What relaunch starts, recorded instead of run."""
    started: list = []

    def __init__(self, cmd, env, preexec_fn):
        self.started.append((cmd, env, preexec_fn))

    def wait(self):
        return 0


def test_relaunch_runs_the_stage_under_torchrun_after_its_own_checks(tmp_path, monkeypatch, capsys):
    args = [f"run_root={tmp_path}", "launcher.num_processes=2", *RL_ARGS]
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(roles.subprocess, "Popen", FakeTorchrun)
    FakeTorchrun.started = []
    with pytest.raises(SystemExit) as e:  # no finished sft stage: the usual one line, and nothing started
        rl_main.main(args)
    assert e.value.code == 2 and "stage 'sft' has not finished" in capsys.readouterr().err
    assert not FakeTorchrun.started
    prepared_root(tmp_path, args)
    rl_main.main(args)
    (cmd, e, preexec), = FakeTorchrun.started
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "recipe.rl", *args]
    assert e["OMP_NUM_THREADS"] == "1" and preexec is not None  # torchrun gets SIGTERM if this process dies
    with pytest.raises(StageError):  # the folder held by another run: refused before any rank starts
        with Stage(load_config(args), "rl").locked():
            rl_main.run(load_config(args), args)
    assert len(FakeTorchrun.started) == 1


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` now, with its start time (so a reused pid is not mistaken for it)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in out:
                out[child] = start_time(child)
                frontier.append(child)
    return {p: t for p, t in out.items() if t is not None}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
    return found[0] if found else None


def alive(pid: int, started: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return start_time(pid) == started and state != "Z"


def run_then_kill(args: list[str], rl_dir: Path, after: int, victim: int, log: Path) -> dict:
    """Start the ranks, wait for `after` metrics records, kill -9 rank `victim`: what torchrun did then."""
    seen: dict[int, str] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(torchrun("rl", *args), cwd=ROOT, env=env(), stdout=out, stderr=out)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                seen.update(descendants(proc.pid))
                if (rl_dir / "metrics.jsonl").exists() and len(records(rl_dir)) >= after:
                    break  # that step is checkpointed (a step's checkpoint comes before its record)
                time.sleep(0.05)
            assert proc.poll() is None, log.read_text()[-4000:]
            seen.update(descendants(proc.pid))
            target = [p for p in seen if rank_of(p) == victim and b"dist_ranks.py" in cmdline(p)]
            engines = [p for p in seen if b"multiprocessing" in cmdline(p)]  # rank 0's hf engine process
            os.kill(target[0], signal.SIGKILL)
            t_kill = time.time()
            rc = proc.wait(timeout=120)
            took = time.time() - t_kill
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    time.sleep(1)  # (an orphan would still be there a second later)
    return {"rc": rc, "took": took, "targets": len(target), "engines": len(engines), "processes": len(seen),
            "left": [(p, cmdline(p)) for p, t in seen.items() if alive(p, t)], "records": records(rl_dir)}


@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory):
    """`python -m recipe.rl` on 2 ranks with the real hf engine process, up to STEPS steps: killed -9 in rank 1
    after step 2, rerun and killed -9 in rank 0 after step 4, rerun to the end. Then a copy of the run root
    without its step-5 checkpoint and final model, resumed on 1 rank."""
    root = tmp_path_factory.mktemp("dist_rl")
    rest = [f"rl.max_steps={STEPS}", *RL_ARGS]
    args = [f"run_root={root / 'runs'}", "launcher.num_processes=2", *rest]
    prepared_root(root / "runs", args)
    rl_dir = stage_dir(load_config(args), "rl")
    t0 = time.time()
    kills = {1: run_then_kill(args, rl_dir, 2, 1, root / "kill_rank1.log")}
    kills[0] = run_then_kill(args, rl_dir, 4, 0, root / "kill_rank0.log")
    last = subprocess.run(torchrun("rl", *args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-4000:]
    ranks_s = time.time() - t0

    copy = root / "copy"
    shutil.copytree(root / "runs", copy)
    one = [f"run_root={copy}", "launcher.num_processes=1", *rest]
    copied = stage_dir(load_config(one), "rl")
    for p in (copied / "DONE.json", copied / "model", copied / "checkpoints" / f"step_{STEPS:06d}"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(dist_ranks.MathEnv, "score", dist_ranks.text_reward)
        rl_main.main(one)
    print(f"2 ranks, three runs: {ranks_s:.1f} s; " + "; ".join(
        f"rank {v} killed: torchrun exited {k['rc']} after {k['took']:.1f} s" for v, k in kills.items()))
    return {"kills": kills, "last": last, "rl_dir": rl_dir, "copied": copied, "one_out": out.getvalue()}


@pytest.mark.slow
def test_kill_minus_9_of_either_rank_stops_the_whole_job_and_the_rerun_resumes(rl_runs):
    for victim, k in rl_runs["kills"].items():
        assert k["targets"] == 1 and k["engines"] >= 1, k  # the rank killed; the engine process rank 0 started
        assert k["rc"] != 0 and k["took"] < 90, k  # torchrun stops the other rank and exits non-zero
        assert not k["left"], k  # no rank, no engine process left behind
    assert rl_runs["kills"][1]["records"][:2] == [1, 2] and len(rl_runs["kills"][1]["records"]) < STEPS
    assert rl_runs["kills"][0]["records"][:4] == [1, 2, 3, 4] and len(rl_runs["kills"][0]["records"]) < STEPS
    assert "rl: resuming from" in rl_runs["last"].stdout
    assert records(rl_runs["rl_dir"]) == list(range(1, STEPS + 1))  # one record a step, none twice


@pytest.mark.slow
def test_rl_on_two_ranks_writes_from_rank_0_only_and_its_checkpoint_resumes_on_one(rl_runs):
    from transformers import AutoModelForCausalLM

    rl_dir, last = rl_runs["rl_dir"], rl_runs["last"]
    assert "2 trainer ranks" in last.stdout and last.stdout.count("rl: ") == 2  # rank 0 alone speaks
    assert sorted(p.name for p in rl_dir.iterdir()) == [".lock", "DONE.json", "checkpoints", "config.yaml",
                                                        "manifest.json", "metrics.jsonl", "model", "weights"]
    ckpts = rl_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000005"]  # rl.keep_checkpoints=2
    for c in ckpts.iterdir():
        assert json.loads((c / "meta.json").read_text())["world_size"] == 2
        assert {p.name for p in (c / "state").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    final = AutoModelForCausalLM.from_pretrained(rl_dir / "model")
    close(dict(final.state_dict()), checkpoint_model_state(ckpts / "step_000005"), atol=0)
    close(read_weights(rl_dir / "weights" / "policy_000005.safetensors"), dict(final.state_dict()), atol=0)

    copied = rl_runs["copied"]
    assert f"rl: resuming from {copied / 'checkpoints' / 'step_000004'} (step 4)" in rl_runs["one_out"]
    assert records(copied) == list(range(1, STEPS + 1)) and (copied / "DONE.json").exists()
    assert json.loads((copied / "checkpoints" / "step_000005" / "meta.json").read_text())["world_size"] == 1
    assert AutoModelForCausalLM.from_pretrained(copied / "model") is not None


@pytest.mark.slow
def test_sigterm_to_the_stage_stops_both_ranks_after_checkpointing_the_same_step_and_exits_143(tmp_path):
    """`python -m recipe.rl launcher.num_processes=2` (the stage runs torchrun as its child): SIGTERM to it reaches
    every rank, each stops after the same step with one checkpoint of it, and the stage exits 143, as in one
    process. No online filter: the random test model rarely answers right, and a flat group still makes a step."""
    args = [f"run_root={tmp_path}", "launcher.num_processes=2", "rl.max_steps=1000", "rl.checkpoint_every=1000",
            *RL_ARGS, "rl.online_filter=false"]
    prepared_root(tmp_path, args)
    rl_dir = stage_dir(load_config(args), "rl")
    seen: dict[int, str] = {}
    with open(tmp_path / "log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "recipe.rl", *args], cwd=ROOT, env=env(), stdout=out,
                                stderr=out)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                seen.update(descendants(proc.pid))
                if (rl_dir / "metrics.jsonl").exists() and len(records(rl_dir)) >= 2:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, (tmp_path / "log").read_text()[-4000:]
            seen.update(descendants(proc.pid))
            assert {rank_of(p) for p in seen} - {None} == {0, 1}  # both ranks were running
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "log").read_text()
    lines = [ln for ln in re.split(r"[\r\n]", log) if "rl: stopped by SIGTERM" in ln]
    steps = records(rl_dir)
    n = steps[-1]
    assert steps == list(range(1, n + 1)) and n < 1000, log[-3000:]
    assert sorted(ln[ln.index("rl: stopped"):] for ln in lines) == sorted([  # every rank stops after step n
        f"rl: stopped by SIGTERM; the next run resumes from checkpoint {rl_dir / 'checkpoints' / f'step_{n:06d}'} "
        f"(step {n})", f"rl: stopped by SIGTERM; rank 1 stopped with rank 0 after step {n}"]), log[-3000:]
    assert json.loads((rl_dir / "checkpoints" / f"step_{n:06d}" / "meta.json").read_text()) == \
        {"step": n, "world_size": 2}  # checkpoint_every=1000: the signal's checkpoint, by both ranks
    assert rc == 143, log[-3000:]
    assert "Unable to shutdown process" not in log  # every rank left by itself: none hung at exit (SIGKILLed)
    time.sleep(1)
    assert not [p for p, t in seen.items() if alive(p, t)]
