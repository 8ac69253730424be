"""The RL loop's glue (recipe.rl.loop.run_rl) on a tiny model: metrics a step, checkpoints, and a resume that
continues from the newest checkpoint (model, prompt stream, policy version sent to the engine).

The engine is a scripted one on real token ids (no process is spawned): the first sample of every group
answers right and the second wrongly, so every group carries signal.
"""
import contextlib
import io
import json
import math
import re
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.inference.engine import Done
from recipe.rl import loop
from recipe.rl.trainer import checkpoint_model_state
from recipe.rollout import Completion
from recipe.runs import Stage, stage_dir, write_atomic
from tests.fakes import save_tiny_qa_model

RL_SEED = 0
MAX_GROUPS = 100  # a run of 4 steps of 2 groups needs about a dozen


class TokenEngine:
    """The Engine contract, scripted: answers at once, tagged with the current policy version. Records every
    update_weights (version, and the weights sent) and submit in order, and the prompt of each group."""

    def __init__(self, tokenizer, version):
        self.tok = tokenizer
        self.policy_version = version
        self.pending, self.log, self.weights = [], [], {}
        self.groups = {}  # group id (from the request's sampling seed) -> prompt text
        self.lock = threading.Lock()
        self.stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def submit(self, requests):
        if len(self.groups) > MAX_GROUPS:  # fail fast, rather than run on (the loop would wait 600 s)
            raise RuntimeError(f"{len(self.groups)} groups submitted for a few steps: are they all stale?")
        with self.lock:
            self.log.append(("submit", [r.submitted_version for r in requests]))
            self.pending.extend(requests)
            for r in requests:
                self.groups.setdefault(group_of(r), self.tok.decode(r.prompt_ids))

    def update_weights(self, path, version):
        with self.lock:
            self.log.append(("update", version))
            self.weights[version] = load_file(str(path))
            self.policy_version = version

    def poll(self, timeout=None):
        with self.lock:
            batch, self.pending = self.pending, []
            version = self.policy_version
        if not batch:
            time.sleep(min(timeout or 0, 0.01))
            return None
        out = []
        for r in batch:
            i = re.search(r"Q(\d+)", self.tok.decode(r.prompt_ids)).group(1)
            sample = r.params.seed % 1000
            ids = self.tok.encode(f"<think>t</think>{i if sample == 0 else -1}", add_special_tokens=False)
            ids = (ids + [self.stop_id])[:r.params.max_new_tokens]
            # about the tiny random model's own logprobs, so that the importance ratio masks little
            out.append((r.id, Completion(ids, [-math.log(len(self.tok))] * len(ids), "stop", version)))
        return Done(out, 0.01)

    def close(self):
        pass


def group_of(request) -> int:
    """The orchestrator seeds sample s of group g with rl.seed * 1_000_003 + g * 1000 + s."""
    return (request.params.seed - RL_SEED * 1_000_003) // 1000


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A start model, an RL data split (through its manifest), and the config of a tiny run."""
    root = tmp_path_factory.mktemp("rl_loop")
    start = root / "start_model"
    tok = save_tiny_qa_model(start)

    def cfg(max_steps):
        return load_config([f"run_root={root / 'runs'}", f"rl.max_steps={max_steps}", "rl.checkpoint_every=1",
                            "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8",
                            "rl.micro_batch_size=4", "rl.pin_cores=false", f"rl.seed={RL_SEED}", "rl.lr=1e-3",
                            "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0"])

    data = stage_dir(cfg(1), "data")  # what require_done(cfg, "data") and read_split(…, "rl") read
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "split": "rl", "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(40)]
    sha = write_rows(rows, data / "rl.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"rl.parquet": {"rows": 40, "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg(1), "data").hash}))
    return {"root": root, "tok": tok, "start": start, "cfg": cfg}


def run(world, monkeypatch, name, max_steps):
    """run_rl on stage folder `name` up to max_steps: (engine, printed output, final model folder)."""
    engines = []

    def make_engine(cfg, model_path, version, log_dir):
        engines.append(TokenEngine(world["tok"], version))
        return engines[-1]

    monkeypatch.setattr(loop, "make_engine", make_engine)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model = loop.run_rl(world["cfg"](max_steps), world["root"] / name, world["start"])
    assert len(engines) == 1
    return engines[0], out.getvalue(), model


def steps(stage):
    return [json.loads(ln)["step"] for ln in (stage / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(world):
    """Run A: 2 steps, then resumed to 4; run B: 4 steps uninterrupted."""
    mp = pytest.MonkeyPatch()
    try:
        a1 = run(world, mp, "rl_a", 2)
        stage = world["root"] / "rl_a"
        after_first = {"steps": steps(stage), "ckpt": sorted(p.name for p in (stage / "checkpoints").glob("step_*")),
                       "model_2": checkpoint_model_state(stage / "checkpoints" / "step_000002"),
                       "orch_2": json.loads((stage / "checkpoints" / "step_000002" / "orchestrator.json").read_text())}
        a2 = run(world, mp, "rl_a", 4)
        b = run(world, mp, "rl_b", 4)
    finally:
        mp.undo()
    return {"a1": a1, "a2": a2, "b": b, "after_first": after_first}


def test_one_metrics_record_a_step_and_a_checkpoint_a_step(runs, world):
    assert runs["after_first"]["steps"] == [1, 2]
    assert runs["after_first"]["ckpt"] == ["step_000001", "step_000002"]
    record = json.loads((world["root"] / "rl_a" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss_tokens"] > 0 and record["reward"] == pytest.approx(0.5)  # one right, one wrong a group
    assert "resuming" not in runs["a1"][1]


def test_a_second_run_resumes_from_the_last_checkpoint_without_repeating_a_step(runs, world):
    out = runs["a2"][1]
    assert re.search(r"rl: resuming from .*step_000002 \(step 2\)", out), out
    assert steps(world["root"] / "rl_a") == [1, 2, 3, 4]
    assert steps(world["root"] / "rl_b") == [1, 2, 3, 4]
    assert sorted(p.name for p in (world["root"] / "rl_a" / "checkpoints").glob("step_*")) == \
        ["step_000003", "step_000004"]  # rl.keep_checkpoints=2


def test_the_engine_gets_the_resumed_policy_before_generating(runs):
    first, resumed = runs["a1"][0], runs["a2"][0]
    assert [v for kind, v in first.log if kind == "update"] == [1, 2]
    assert resumed.log[0] == ("update", 2)  # before any request was submitted
    assert [v for kind, v in resumed.log if kind == "update"] == [2, 3, 4]
    assert all(min(versions) >= 2 for kind, versions in resumed.log if kind == "submit")
    sent, saved = resumed.weights[2], runs["after_first"]["model_2"]
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in saved)


def test_the_prompt_stream_continues_where_the_checkpoint_left_it(runs):
    first, resumed, whole = runs["a1"][0].groups, runs["a2"][0].groups, runs["b"][0].groups
    next_gid = runs["after_first"]["orch_2"]["next_gid"]
    assert next_gid >= 4 and min(resumed) == next_gid  # the resumed run numbers its groups on, none repeated
    assert sorted(resumed) == list(range(next_gid, next_gid + len(resumed)))
    # group g gets the same prompt as in the uninterrupted run: the resumed run draws the prompts that follow
    # the ones drawn before the checkpoint (groups still in flight at the checkpoint are not redone)
    for part in (first, resumed):
        common = set(part) & set(whole)
        assert len(common) >= 2
        assert all(part[g] == whole[g] for g in common)
    assert resumed[next_gid] != first[0]


def test_the_final_model_loads_with_transformers(runs, world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs["a2"][2]
    assert out == world["root"] / "rl_a" / "model"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(world["tok"])
    last = checkpoint_model_state(world["root"] / "rl_a" / "checkpoints" / "step_000004")
    start = AutoModelForCausalLM.from_pretrained(world["start"]).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], last[k]) for k in last)  # the model of the last step
    assert any(not torch.equal(state[k], start[k]) for k in last)  # trained
    with torch.no_grad():
        assert model(input_ids=torch.tensor([tok("Q1")["input_ids"]])).logits.isfinite().all()
