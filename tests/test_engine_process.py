"""HFEngineProcess: the hf engine in a spawned process, spoken to through the Engine contract.

One engine process serves most tests (spawning one costs seconds); each test first sends it the weights and
the policy version it starts from. Two sets of weights: the tiny model's own (v0 below) and the same model
with its output head zeroed (v1), under which every logit is 0, so greedy decoding writes token 0 (a stop
token) at once with logprob -log(vocab): completions show which weights wrote them.
"""
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recipe.chat import stop_token_ids
from recipe.config import TinyArch
from recipe.inference.engine import Cancelled, Done, Request
from recipe.inference.hf import HFEngine
from recipe.inference.worker import HFEngineProcess
from recipe.model import build_tiny_model, build_tokenizer
from recipe.rollout import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0)
MAX_OFF_POLICY = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model and tokenizer saved as a model folder, with the two weight files (v0, v1) beside it."""
    root = tmp_path_factory.mktemp("engine_process")
    tok = build_tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], vocab_size=128)
    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                    max_position_embeddings=128)
    model = build_tiny_model(arch, tok, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, root / "v0.safetensors")
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    save_file(state, root / "v1.safetensors")
    assert stop_token_ids(tok)[0] == 0  # what greedy decoding under v1 writes
    return root


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in this process, for the completions v0 must give."""
    return HFEngine.from_pretrained(str(model_dir / "model"), batch_size=2)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = HFEngineProcess(str(model_dir / "model"), threads=1, batch_size=2, max_off_policy_steps=MAX_OFF_POLICY,
                          start_timeout=120)
    yield eng
    eng.close()
    assert not eng.proc.is_alive()


def prompts(reference, n):
    return [reference.tokenizer(f"{a}+{b}=")["input_ids"] for a, b in [(1, 2), (12, 3), (7, 19), (3, 3)][:n]]


def collect(engine, ids, timeout=60.0):
    """Poll until every request id came back, done or cancelled: (events, {id: completion}, cancelled ids)."""
    events, done, cancelled = [], {}, []
    deadline = time.monotonic() + timeout
    while set(done) | set(cancelled) != set(ids):
        assert time.monotonic() < deadline, f"engine answered {sorted(done)} and cancelled {cancelled} of {ids}"
        event = engine.poll(timeout=1.0)
        if event is None:
            continue
        events.append(event)
        if isinstance(event, Done):
            for rid, c in event.results:
                assert rid not in done and rid not in cancelled, f"request {rid} came back twice"
                done[rid] = c
        else:
            cancelled += event.request_ids
    return events, done, cancelled


def written_by_v1(completion, vocab):
    return completion.token_ids == [0] and completion.logprobs == pytest.approx([-math.log(vocab)], abs=1e-5)


def test_submit_and_poll_return_one_completion_per_request_tagged_with_the_version(engine, model_dir, reference):
    engine.update_weights(model_dir / "v0.safetensors", 0)
    ps = prompts(reference, 3)
    engine.submit([Request(i, p, GREEDY, 0) for i, p in enumerate(ps)])
    events, done, cancelled = collect(engine, [0, 1, 2])
    assert not cancelled and sorted(done) == [0, 1, 2]
    assert all(isinstance(e, Done) and e.busy_s > 0 and len(e.results) <= 2 for e in events)  # batches of 2
    # the engine writes what the model does: the process takes requests first in, first out, two at a time
    expected = reference.generate(ps[:2], GREEDY) + reference.generate(ps[2:], GREEDY)
    for i, c in done.items():
        assert c.policy_version == 0
        assert c.token_ids == expected[i].token_ids
        assert c.logprobs == pytest.approx(expected[i].logprobs, abs=1e-4)
    assert not any(written_by_v1(c, len(reference.tokenizer)) for c in done.values())


def test_a_row_that_finishes_comes_back_while_the_others_of_its_batch_still_run(engine, model_dir, reference):
    """Continuous batching: a completion goes back the step its row finishes, not when its batch is done."""
    engine.update_weights(model_dir / "v0.safetensors", 0)
    p = prompts(reference, 1)[0]
    long = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    # a sample of several tokens beside one of a single token: two rows of one batch (batch_size 2) that end apart
    assert len(reference.generate_each([p], [long])[0].token_ids) > 2
    engine.submit([Request(20, p, long, 0), Request(21, p, SamplingParams(max_new_tokens=1, temperature=1.0), 0)])
    events, done, _ = collect(engine, [20, 21])
    first = [rid for rid, _ in events[0].results]
    assert first == [21] and len(done[21].token_ids) == 1


def test_requests_older_than_max_off_policy_steps_are_cancelled_not_generated(engine, model_dir, reference):
    engine.update_weights(model_dir / "v0.safetensors", 5)
    assert engine.policy_version == 5
    p = prompts(reference, 1)[0]
    # submitted under versions 3, 4, 5 and 2: those more than MAX_OFF_POLICY=1 versions behind 5 are too stale
    engine.submit([Request(10, p, GREEDY, 3), Request(11, p, GREEDY, 4), Request(12, p, GREEDY, 5),
                   Request(13, p, GREEDY, 2)])
    events, done, cancelled = collect(engine, [10, 11, 12, 13])
    assert sorted(cancelled) == [10, 13] and sorted(done) == [11, 12]
    assert isinstance(events[0], Cancelled)  # dropped before anything was generated
    assert all(c.policy_version == 5 for c in done.values())


def test_weights_are_swapped_between_batches_and_completions_carry_the_version_that_wrote_them(
        engine, model_dir, reference):
    vocab = len(reference.tokenizer)
    ps = prompts(reference, 4)
    expected_v0 = {tuple(p): c.token_ids for p, c in zip(ps, reference.generate(ps, GREEDY))}
    engine.update_weights(model_dir / "v0.safetensors", 0)
    engine.submit([Request(20 + i, p, GREEDY, 0) for i, p in enumerate(ps[:2])])
    _, before, _ = collect(engine, [20, 21])
    engine.update_weights(model_dir / "v1.safetensors", 1)
    assert engine.policy_version == 1
    engine.submit([Request(30 + i, p, GREEDY, 1) for i, p in enumerate(ps[:2])])
    _, after, _ = collect(engine, [30, 31])
    for i, c in before.items():  # finished before the update: version 0, the model's own greedy tokens
        assert c.policy_version == 0 and c.token_ids == expected_v0[tuple(ps[i - 20])]
    for c in after.values():  # submitted after it: version 1, the zeroed head's tokens
        assert c.policy_version == 1 and written_by_v1(c, vocab)

    # an update sent while requests wait or run: a row that joined under v0 says v0, and its tokens are v0's
    # up to the update, then v1's (greedy under v1: the stop token at once); a row that joined after says v1
    engine.update_weights(model_dir / "v0.safetensors", 0)
    ids = list(range(40, 46))
    engine.submit([Request(rid, ps[rid % 4], GREEDY, 0) for rid in ids])  # three batches of two
    engine.update_weights(model_dir / "v1.safetensors", 1)
    engine.submit([Request(46, ps[0], GREEDY, 1), Request(47, ps[1], GREEDY, 1)])
    events, done, cancelled = collect(engine, ids + [46, 47])
    assert not cancelled  # one version behind is within max_off_policy_steps
    for rid, c in done.items():
        if c.policy_version == 1:
            assert written_by_v1(c, vocab)
        else:
            v0 = expected_v0[tuple(ps[rid % 4])]
            assert c.policy_version == 0 and len(c.token_ids) >= 1
            assert c.token_ids == v0 or (c.token_ids[:-1] == v0[:len(c.token_ids) - 1] and c.token_ids[-1] == 0
                                         and c.logprobs[-1] == pytest.approx(-math.log(vocab), abs=1e-5))
    assert done[46].policy_version == done[47].policy_version == 1


def test_an_update_is_loaded_between_decode_steps_while_a_row_runs(engine, model_dir, reference):
    """In-flight weights, as vLLM loads prime-rl's update_weights between engine steps: an update sent while a row
    runs is loaded at the next decode step. The row's tokens are v0's up to there, then v1's (logprob -log(vocab)
    each: every logit 0); its completion carries v0, the version it started under."""
    vocab = len(reference.tokenizer)
    p = prompts(reference, 1)[0]
    long = SamplingParams(max_new_tokens=100, temperature=1.0, seed=5)
    alone = reference.generate_each([p], [long])[0]
    assert len(alone.token_ids) == 100  # no stop under v0: the row runs 100 steps
    for attempt in range(3):  # the update must reach the engine within those steps: under load, try again
        engine.update_weights(model_dir / "v0.safetensors", 0)
        long_id, short_id = 60 + 2 * attempt, 61 + 2 * attempt
        engine.submit([Request(long_id, p, long, 0), Request(short_id, p, SamplingParams(max_new_tokens=1), 0)])
        _, done, _ = collect(engine, [short_id])  # one step in: the long row runs on
        engine.update_weights(model_dir / "v1.safetensors", 1)
        _, done, _ = collect(engine, [long_id])
        c = done[long_id]
        by_v1 = [lp == pytest.approx(-math.log(vocab), abs=1e-5) for lp in c.logprobs]
        if any(by_v1):
            break
    assert any(by_v1), "the update waited for the row to finish"
    assert c.policy_version == 0
    switch = by_v1.index(True)
    assert 0 < switch and all(by_v1[switch:]), "the row went from v0's tokens to v1's once"
    assert c.token_ids[:switch] == alone.token_ids[:switch]
    assert c.logprobs[:switch] == pytest.approx(alone.logprobs[:switch], abs=1e-4)


def test_rows_cancelled_between_decode_steps_leave_the_batch_and_come_back_none(reference):
    ps = prompts(reference, 3)
    params = [SamplingParams(max_new_tokens=6, temperature=0.0, seed=i) for i in range(3)]
    full = reference.generate_each(ps, params)
    asked = []

    def cancelled():  # prompt 1 is cancelled after the first decode step
        asked.append(1)
        return {1} if len(asked) >= 2 else set()

    out = reference.generate_each(ps, params, cancelled=cancelled)
    assert out[1] is None and len(asked) >= 2
    for i in (0, 2):
        assert out[i].token_ids == full[i].token_ids
        assert out[i].logprobs == pytest.approx(full[i].logprobs, abs=1e-4)


def test_requests_the_client_cancels_never_come_back_queued_or_running(engine, model_dir, reference):
    engine.update_weights(model_dir / "v0.safetensors", 0)
    p = prompts(reference, 1)[0]
    long = SamplingParams(max_new_tokens=60, temperature=1.0, seed=3)
    # a batch of two runs (50, 51); 52 and 53 wait; 50 and 52 are cancelled, whether running or queued by then
    engine.submit([Request(50 + i, p, long, 0) for i in range(4)])
    engine.cancel([50, 52])
    events, done, cancelled = collect(engine, [51, 53])
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # and nothing else comes
        event = engine.poll(timeout=0.1)
        if event is not None:
            events.append(event)
    assert not cancelled and sorted(done) == [51, 53]
    assert all(rid in (51, 53) for e in events for rid, _ in getattr(e, "results", []))


PARENT = """
import sys, time
from recipe.inference.worker import HFEngineProcess
engine = HFEngineProcess(sys.argv[1], threads=1, batch_size=2, start_timeout=120)
print(engine.proc.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Running, not gone nor a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_the_engine_process_dies_with_its_parent_even_on_kill_9(model_dir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(model_dir / "model")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(parent.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=120)
        if not (line and line[0].strip().isdigit()):
            parent.kill()
            pytest.fail(f"the parent printed no engine pid ({line}): {parent.communicate(timeout=10)[1][-3000:]}")
        child = int(line[0])
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the engine process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_engine_without_its_model_fails_to_start_naming_the_path(tmp_path, engine):
    missing = tmp_path / "no_such_model"
    before = {p.pid for p in mp.active_children()}  # the module's engine
    with pytest.raises(RuntimeError, match="hf engine process failed") as err:
        HFEngineProcess(str(missing), start_timeout=120)
    assert str(missing) in str(err.value)
    deadline = time.monotonic() + 10  # and the failed process is gone, not left behind
    while {p.pid for p in mp.active_children()} - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {p.pid for p in mp.active_children()} - before


def test_waiting_requests_join_a_running_batch_together_not_one_prefill_for_each_free_row():
    """joining_now: with a batch of 128, requests wait until a quarter of it (32 rows) is free or all of them fit,
    then every one that fits joins, in order, while it shares the batch's sampling settings."""
    from collections import deque
    from types import SimpleNamespace

    from recipe.inference.worker import joining_now

    engine = SimpleNamespace(batch_size=128)
    engine.should_admit = lambda running, waiting: HFEngine.should_admit(engine, running, waiting)
    hot, cold = SamplingParams(temperature=1.0, max_new_tokens=8), SamplingParams(temperature=0.0, max_new_tokens=8)

    class Batch:
        def __init__(self, running):
            self.running = running

        def __len__(self):
            return self.running

        def accepts(self, params):
            return params.temperature == hot.temperature

    def queue(n, params=hot, first=0):
        return deque(Request(id=first + i, prompt_ids=[1, 2], params=params, submitted_version=0) for i in range(n))

    pending = queue(8)
    assert joining_now(engine, Batch(125), pending) == [] and len(pending) == 8  # 3 free rows: wait
    assert [r.id for r in joining_now(engine, Batch(120), pending)] == list(range(8)) and not pending  # all fit
    pending = queue(40)
    assert joining_now(engine, Batch(100), pending) == []  # 28 free, fewer than 32 and than the 40 waiting
    assert [r.id for r in joining_now(engine, Batch(96), pending)] == list(range(32)) and len(pending) == 8
    assert len(joining_now(engine, Batch(0), queue(200))) == 128  # an empty batch fills up at once
    pending = queue(3) + queue(2, cold, first=3) + queue(2, first=5)
    assert [r.id for r in joining_now(engine, Batch(10), pending)] == [0, 1, 2]  # up to another setting
    assert [r.id for r in pending] == [3, 4, 5, 6]


def test_the_engine_is_forked_where_that_is_safe_and_spawned_elsewhere_writing_the_same(engine, model_dir, reference):
    """A forked engine starts from this process's imports; with more than one thread (whose OpenMP pool would be
    this process's) it is spawned, and either writes what the model does. Both are known to the soak as engines."""
    from recipe.inference.worker import engine_pids, start_method

    assert start_method(1) == ("fork" if sys.platform == "linux" else "spawn") and start_method(2) == "spawn"
    assert type(engine.proc).__name__ == ("ForkProcess" if sys.platform == "linux" else "SpawnProcess")
    spawned = HFEngineProcess(str(model_dir / "model"), threads=2, batch_size=2, start_timeout=120)
    try:
        assert type(spawned.proc).__name__ == "SpawnProcess"
        assert {engine.proc.pid, spawned.proc.pid} <= engine_pids()
        ps = prompts(reference, 2)
        expected = reference.generate(ps, GREEDY)
        for eng in (engine, spawned):
            eng.update_weights(model_dir / "v0.safetensors", 0)
            eng.submit([Request(40 + i, p, GREEDY, 0) for i, p in enumerate(ps)])
            _, done, _ = collect(eng, [40, 41])
            assert [done[40 + i].token_ids for i in range(2)] == [e.token_ids for e in expected]
    finally:
        spawned.close()
    assert spawned.proc.pid not in engine_pids() and engine.proc.pid in engine_pids()


@pytest.mark.skipif(sys.platform != "linux", reason="the engine is forked on Linux only")
def test_a_forked_engine_takes_the_parents_objects_out_of_the_cyclic_collector(model_dir):
    """Before a fork the parent's objects are frozen (gc.freeze), so that neither the child's collections nor the
    trainer's full ones walk them; a spawned engine, which shares no pages, leaves the parent's collector as it was."""
    import gc

    gc.unfreeze()
    spawned = HFEngineProcess(str(model_dir / "model"), threads=2, batch_size=2, start_timeout=120)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        spawned.close()
    alive = len(gc.get_objects())
    forked = HFEngineProcess(str(model_dir / "model"), threads=1, batch_size=2, start_timeout=120)
    try:
        assert type(forked.proc).__name__ == "ForkProcess"
        assert gc.get_freeze_count() >= alive // 2  # the objects alive at the fork, in the permanent generation
    finally:
        forked.close()
        gc.unfreeze()


def test_a_rank_with_a_process_group_spawns_its_engine(tmp_path):
    """A forked engine would hold the rank's collective sockets and threads: under a process group, spawn."""
    import torch.distributed as dist

    from recipe.inference.worker import start_method

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert start_method(1) == "spawn"
    finally:
        dist.destroy_process_group()
    assert start_method(1) == ("fork" if sys.platform == "linux" else "spawn")
