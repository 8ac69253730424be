"""The orchestrator through its public API (constructor, next_batch, state_dict/load_state_dict, start/close,
counters and the in_flight_groups / ready_groups counts), driven by scripted engines."""
import json
import time

import pytest

from recipe.config import RLConfig
from recipe.inference.engine import Cancelled
from recipe.rl.orchestrator import Orchestrator
from tests.fakes import CharTokenizer, ScriptedEngine


def rl_cfg(**kw):
    return RLConfig(**{"batch_size": 2, "rollouts_per_example": 4, "env_mix": {"math": 1.0}, **kw})


def math_rows(n=20, difficulty=0.5):
    return [{"id": f"q{i}", "env": "math", "task": "add", "prompt": [{"role": "user", "content": f"Q{i}"}],
             "answer": str(i), "info": "{}", "difficulty": difficulty} for i in range(n)]


def answer_by_index(correct_samples):
    """Problem i answers correctly in the samples listed for it (by sample index within the group)."""
    def fn(prompt, rid):
        i = int(prompt.split("Q")[1].split("<")[0])
        return f"<think>t</think>{i if (rid % 4) in correct_samples(i) else -1}"
    return fn


def problem(sample) -> str:
    """The question a sample answers ("Q7")."""
    return "".join(map(chr, sample.prompt_ids)).split("<user>")[1].split("<")[0]


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_advantages_are_reward_minus_group_mean_and_flat_groups_are_dropped():
    # even problems: 1 of 4 correct; odd problems: all correct (no signal: dropped)
    eng = ScriptedEngine(answer_by_index(lambda i: {0} if i % 2 == 0 else {0, 1, 2, 3}))
    orch = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert len(samples) == 2 * 4
    assert sorted(s.advantage for s in samples) == [-0.25] * 6 + [0.75] * 2
    assert stats["filtered_all_correct"] >= 1 and stats["filtered_groups"] == stats["filtered_all_correct"]


def test_without_the_online_filter_flat_groups_stay_with_advantage_zero():
    # prime-rl's production run: no online filter; a flat group trains with advantage 0 and counts its tokens
    eng = ScriptedEngine(answer_by_index(lambda i: {0} if i % 2 == 0 else {0, 1, 2, 3}))
    orch = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(online_filter=False, batch_size=4), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert len(samples) == 4 * 4 and stats["filtered_groups"] == 0 and orch.filter_rate == 0.0
    flat = [s for s in samples if int(problem(s)[1:]) % 2]
    assert flat and all(s.advantage == 0.0 for s in flat) and stats["groups_without_signal"] >= len(flat) // 4
    assert sorted(s.advantage for s in samples if s not in flat) == [-0.25] * 6 + [0.75] * 2


def test_sync_level_submits_nothing_ahead_async_level_keeps_next_batch_in_flight():
    fn = answer_by_index(lambda i: {0})
    sync_eng, async_eng = ScriptedEngine(fn, batch=4), ScriptedEngine(fn, batch=4)
    sync = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=0), sync_eng, seed=0)
    asyn = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=1), async_eng, seed=0)
    sync.next_batch(0)
    asyn.next_batch(0)
    assert sync.in_flight_groups + sync.ready_groups == 0 and not sync_eng.pending
    assert asyn.in_flight_groups + asyn.ready_groups == 2 and len(async_eng.pending) == 2 * 4


def test_groups_older_than_max_async_level_are_dropped_as_stale():
    fn = answer_by_index(lambda i: {0})
    eng = ScriptedEngine(fn, batch=4)
    orch = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=1), eng, seed=0)
    orch.start()
    try:
        orch.next_batch(0)  # leaves the next batch in flight
        wait_until(lambda: orch.ready_groups == 2)  # the engine writes it with version 0 while the trainer works
        assert orch.in_flight_groups == 0
        eng.update_weights(None, 2)  # two trainer steps later
        samples, stats = orch.next_batch(3)  # needs version >= 2: the ready version-0 groups are stale
    finally:
        orch.close()
    assert stats["stale_groups"] == 2 and orch.counters["groups_stale"] == 2
    assert all(s.policy_version >= 2 for s in samples)
    assert stats["staleness"] == {1: 8}


class CancelFirstSubmit(ScriptedEngine):
    """Hands the first submitted requests back as Cancelled (too stale), as the engine process does."""

    def __init__(self, answer_fn):
        super().__init__(answer_fn)
        self.cancelled, self.log = [], []

    def submit(self, requests):
        self.log.extend(requests)
        if not self.cancelled:
            self.cancelled = list(requests)
            self.events.append(Cancelled([r.id for r in requests]))
            return
        super().submit(requests)


def test_cancelled_requests_are_rescheduled():
    eng = CancelFirstSubmit(answer_by_index(lambda i: {0}))
    orch = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=0), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert len(eng.cancelled) == 8  # level 0 sends the batch's two groups in one submit call
    assert stats["cancelled_requests"] == 8 and len(samples) == 8
    # the same samples (prompt and sampling seed) went back to the engine under new request ids
    again = [r for r in eng.log[len(eng.cancelled):] if r.params.seed in {c.params.seed for c in eng.cancelled}]
    assert sorted((r.params.seed, tuple(r.prompt_ids)) for r in again) == \
        sorted((r.params.seed, tuple(r.prompt_ids)) for r in eng.cancelled)
    assert not {r.id for r in again} & {r.id for r in eng.cancelled}
    cancelled_problems = {"".join(map(chr, r.prompt_ids)).split("<user>")[1].split("<")[0] for r in eng.cancelled}
    assert len(cancelled_problems) == 2  # both groups, rescheduled, made up the batch
    assert sorted(problem(s) for s in samples) == sorted(p for p in cancelled_problems for _ in range(4))


def test_rl_takes_the_rows_as_make_data_filtered_them_and_refuses_an_env_without_rows():
    # the offline pass-rate filter is make data's alone (data.max_pass_rate): RL has no filter of its own to
    # disagree with, whatever a row's pass rate
    import inspect

    rows = [dict(r, id=f"{r['id']}-{d}") for d in (1.0, 0.9, 0.1, float("nan")) for r in math_rows(5, difficulty=d)]
    orch = Orchestrator(rows, CharTokenizer(), rl_cfg(), ScriptedEngine(lambda p, r: ""), seed=0)
    assert len(orch.rows["math"]) == 20
    assert "max_pass_rate" not in inspect.signature(Orchestrator).parameters
    assert not hasattr(RLConfig(), "max_pass_rate")
    with pytest.raises(ValueError, match="logic"):
        Orchestrator(math_rows(), CharTokenizer(), rl_cfg(env_mix={"math": 0.5, "logic": 0.5}),
                     ScriptedEngine(lambda p, r: ""), seed=0)


def test_state_round_trip_resumes_the_same_prompt_stream():
    fn = answer_by_index(lambda i: {0})

    def make():  # synchronous: nothing is in flight between batches, so the state is all there is
        return Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=0), ScriptedEngine(fn), seed=5)

    def stream(orch, batches):  # the problems of the next batches (the engine stays at version 0: step 0)
        return [problem(s) for _ in range(batches) for s in orch.next_batch(0)[0][::4]]

    a = make()
    stream(a, 4)
    assert a.in_flight_groups == 0 and a.ready_groups == 0
    state = json.loads(json.dumps(a.state_dict()))
    b = make()
    b.load_state_dict(state)
    assert b.counters == a.counters
    later = 10  # 20 more prompts after the first 8: past the end of the first epoch over the 20 rows
    rest_a = stream(a, later)
    assert stream(b, later) == rest_a
    assert stream(make(), later) != rest_a  # without the state, the stream would start over


def test_prompts_retired_as_easy_or_hard_are_not_drawn_again_and_the_pools_survive_a_resume():
    # problems 0-4 always right (mean 1: easy), 5-9 always wrong (mean 0: hard), the rest 1 sample in 4 right
    fn = answer_by_index(lambda i: {0, 1, 2, 3} if i < 5 else set() if i < 10 else {0})

    def drawn(orch, batches):  # every problem a group was drawn for, filtered ones too (level 0: one batch a call)
        out = []
        for _ in range(batches):
            orch.next_batch(0)
        for r in orch.engine.log:
            out.append(int("".join(map(chr, r.prompt_ids)).split("<user>")[1].split("<")[0][1:]))
        return out[::4]

    class Logged(ScriptedEngine):
        def __init__(self, f):
            super().__init__(f)
            self.log = []

        def submit(self, requests):
            self.log.extend(requests)
            super().submit(requests)

    def make(**kw):
        return Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=0, **kw), Logged(fn), seed=0)

    plain = drawn(make(), 12)  # 24 groups with signal: several epochs over the 20 problems
    assert sum(p < 10 for p in plain[20:]) >= 5  # without pools the flat problems come back every epoch
    pools = make(easy_border=0.9, hard_border=0.1)
    seen = drawn(pools, 12)
    first = {}
    for k, p in enumerate(seen):
        first.setdefault(p, k)
    assert all(k == first[p] for k, p in enumerate(seen) if p < 10)  # each flat problem drawn once, never again
    assert set(pools.retired) == {f"q{i}" for i in range(10) if i in first}
    assert {pools.retired[f"q{i}"] for i in range(5) if i in first} <= {"easy"}
    assert {pools.retired[f"q{i}"] for i in range(5, 10) if i in first} <= {"hard"}
    # the counters (metrics retired_easy / retired_hard) count prompts, each once
    for pool in ("easy", "hard"):
        assert pools.counters[f"prompts_retired_{pool}"] == sum(v == pool for v in pools.retired.values())
    assert len(pools.retired) > 0
    # only the easy pool: the always-wrong problems come back
    easy_only = drawn(make(easy_border=0.9), 12)
    assert sum(p < 5 for p in easy_only) == len({p for p in easy_only if p < 5})
    assert sum(5 <= p < 10 for p in easy_only) > len({p for p in easy_only if 5 <= p < 10})
    # the pools are part of the state: a resumed orchestrator passes over the same prompts
    state = json.loads(json.dumps(pools.state_dict()))
    again = make(easy_border=0.9, hard_border=0.1)
    again.load_state_dict(state)
    assert again.retired == pools.retired
    assert drawn(again, 4) == drawn(pools, 4)[len(seen):]
    # every prompt retired: drawing goes on over them rather than stopping
    everything = make(easy_border=0.9, hard_border=0.1)
    everything.retired = {f"q{i}": "easy" for i in range(20)}
    assert len(everything.next_batch(0)[0]) == 2 * 4


def test_more_groups_are_kept_in_flight_when_many_come_back_filtered():
    with_signal = ScriptedEngine(answer_by_index(lambda i: {0}), batch=4)
    # three problems in four are answered right by every sample: their groups carry no signal
    mostly_flat = ScriptedEngine(answer_by_index(lambda i: {0} if i % 4 == 0 else {0, 1, 2, 3}), batch=4)
    a = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=1), with_signal, seed=0)
    b = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(max_async_level=1), mostly_flat, seed=0)
    _, stats_a = a.next_batch(0)
    _, stats_b = b.next_batch(0)
    assert stats_a["filtered_groups"] == 0 and stats_b["filtered_groups"] >= 2
    assert a.in_flight_groups == 2  # exactly the next batch
    assert b.in_flight_groups > 2  # more, since some of them will come back filtered


def test_masked_samples_leave_the_loss_and_the_group_mean(monkeypatch):
    # sample 3 of every group could not be judged (a broken sandbox, say); sample 0 is right, 1 and 2 wrong
    from recipe.envs.base import MaskSample
    from recipe.envs.math import MathEnv

    def judged_or_masked(answer, row):
        if answer == "masked":
            raise MaskSample("sandbox down")
        return float(answer == row["answer"])

    monkeypatch.setattr(MathEnv, "rubric", [("correct", judged_or_masked, 1.0)])

    def fn(prompt, rid):
        i = int(prompt.split("Q")[1].split("<")[0])
        return "<think>t</think>" + {0: str(i), 1: "-1", 2: "-1", 3: "masked"}[rid % 4]

    orch = Orchestrator(math_rows(), CharTokenizer(), rl_cfg(), ScriptedEngine(fn), seed=0)
    samples, stats = orch.next_batch(0)
    assert stats["masked_samples"] >= 2  # counted over every group scored, also those ahead of this batch
    masked = [s for s in samples if not any(s.loss_mask)]
    assert len(masked) == 2 and all(s.advantage == 0 for s in masked)
    judged = sorted(round(s.advantage, 6) for s in samples if any(s.loss_mask))
    assert judged == [round(-1 / 3, 6)] * 4 + [round(2 / 3, 6)] * 2  # mean over the 3 judged samples
    assert stats["reward"] == pytest.approx(1 / 3)


class Recording(ScriptedEngine):
    """Keeps every request it is given."""

    def __init__(self, answer_fn):
        super().__init__(answer_fn)
        self.requests = []

    def submit(self, requests):
        self.requests += requests
        super().submit(requests)


def test_prompts_that_leave_no_room_in_the_context_are_left_out_with_one_line(capsys):
    from recipe.chat import encode_prompt
    from recipe.errors import StageError

    rows = math_rows(20)  # Q0..Q9 encode one token shorter than Q10..Q19
    short = len(encode_prompt(CharTokenizer(), rows[0]["prompt"]))
    cfg = rl_cfg(max_new_tokens=10, max_async_level=0)
    eng = Recording(answer_by_index(lambda i: {0}))
    orch = Orchestrator(rows, CharTokenizer(), cfg, eng, seed=0, context=short + 1)
    err = capsys.readouterr().err.splitlines()
    assert orch.too_long == 10 and sorted(r["id"] for r in orch.rows["math"]) == sorted(f"q{i}" for i in range(10))
    assert err == [f"rl: left out 10 of 20 prompts that leave no room for a completion in the model's context "
                   f"({short + 1})"]
    samples, _ = orch.next_batch(0)
    assert all(int(problem(s)[1:]) < 10 for s in samples)
    assert {r.params.max_new_tokens for r in eng.requests} == {1}  # what the context leaves, not max_new_tokens
    with pytest.raises(StageError, match=r"every one of the 20 RL prompts leaves no room .* model's context"):
        Orchestrator(rows, CharTokenizer(), cfg, ScriptedEngine(lambda p, r: ""), seed=0, context=short)


def test_seq_len_caps_prompt_plus_completion_and_leaves_out_prompts_without_room(capsys):
    from recipe.chat import encode_prompt
    from recipe.errors import StageError

    rows = math_rows(20)  # Q0..Q9: `short` tokens; Q10..Q19: short + 1
    short = len(encode_prompt(CharTokenizer(), rows[0]["prompt"]))

    def requests(seq_len, context=short + 500):
        eng = Recording(answer_by_index(lambda i: {0}))
        orch = Orchestrator(rows, CharTokenizer(), rl_cfg(max_new_tokens=10, max_async_level=0, seq_len=seq_len),
                            eng, seed=0, context=context)
        orch.next_batch(0)
        return orch, [(int(problem(r)[1:]), r) for r in eng.requests]

    orch, reqs = requests(None)  # the model's context leaves room for max_new_tokens: no cap
    assert orch.context == short + 500 and {r.params.max_new_tokens for _, r in reqs} == {10}
    orch, reqs = requests(short + 4)  # the least of the model's context and seq_len
    assert orch.context == short + 4 and orch.too_long == 0
    assert all(len(r.prompt_ids) + r.params.max_new_tokens == short + 4 for _, r in reqs)
    assert {r.params.max_new_tokens for i, r in reqs if i < 10} <= {4}
    assert {r.params.max_new_tokens for i, r in reqs if i >= 10} <= {3}
    capsys.readouterr()
    orch, reqs = requests(short + 1, context=None)  # seq_len alone: Q10..Q19 leave no room
    assert orch.too_long == 10 and all(i < 10 for i, _ in reqs) and {r.params.max_new_tokens for _, r in reqs} == {1}
    assert capsys.readouterr().err.splitlines() == [
        f"rl: left out 10 of 20 prompts that leave no room for a completion in rl.seq_len ({short + 1})"]
    requests(short + 1, context=short + 2)
    assert capsys.readouterr().err.splitlines() == [
        f"rl: left out 10 of 20 prompts that leave no room for a completion in the context ({short + 1}: the least "
        f"of the model's {short + 2} and rl.seq_len {short + 1})"]
    with pytest.raises(StageError, match=r"every one of the 20 RL prompts leaves no room .* rl.seq_len"):
        Orchestrator(rows, CharTokenizer(), rl_cfg(seq_len=short), ScriptedEngine(lambda p, r: ""), seed=0)


def code_rows(n=8):
    tests = json.dumps({"tests": [{"fn": "f", "args": [i], "expected": i} for i in range(3)]})
    return [{"id": f"c{i}", "env": "code", "task": "fn", "prompt": [{"role": "user", "content": f"Q{i}"}],
             "answer": "", "info": tests, "difficulty": 0.5} for i in range(n)]


@pytest.mark.parametrize("mask", [True, False])
def test_a_sandbox_failure_is_masked_or_with_the_switch_off_scores_0(monkeypatch, mask):
    # sample 3 of every group: the sandbox itself fails; sample 0 passes every test, 1 and 2 fail one of three
    import recipe.envs.code as code_env

    class Report:
        def __init__(self, passed, error=None):
            self.passed, self.total, self.sandbox_error = passed, 3, error

    def run_tests(source, tests, limits=None):
        return Report(0, "worker crashed") if "crash" in source else Report(3 if "good" in source else 2)

    monkeypatch.setattr(code_env, "run_tests", run_tests)
    monkeypatch.setattr(code_env, "_VERDICTS", {})
    program = {0: "good", 1: "bad", 2: "bad", 3: "crash"}
    eng = ScriptedEngine(lambda p, rid: f"<think>t</think>```python\n# {program[rid % 4]}\n```")
    orch = Orchestrator(code_rows(), CharTokenizer(), rl_cfg(env_mix={"code": 1.0}, mask_sandbox_failures=mask,
                                                             code_partial_credit=False), eng, seed=0)
    samples, stats = orch.next_batch(0)
    failed = [s for s in samples if "crash" in "".join(map(chr, s.completion_ids))]
    assert len(failed) == 2 and all(s.reward == 0.0 for s in failed)
    assert sorted(s.reward for s in samples) == [0.0] * 6 + [1.0] * 2  # all tests or nothing: 2 of 3 is 0
    if mask:  # out of the loss and the group mean: the other three share it
        assert all(not any(s.loss_mask) and s.advantage == 0 for s in failed)
        assert stats["masked_samples"] >= 2 and stats["unjudged_scored_0"] == 0
        assert sorted(round(s.advantage, 6) for s in samples if s not in failed) == \
            [round(-1 / 3, 6)] * 4 + [round(2 / 3, 6)] * 2
    else:  # prime-rl: a wrong answer like any other, in the loss with the group's advantage
        assert all(all(s.loss_mask) and s.advantage == -0.25 for s in failed)
        assert stats["masked_samples"] == 0 and stats["unjudged_scored_0"] >= 2


def test_the_code_environment_gets_rl_code_max_tests():
    orch = Orchestrator(code_rows(), CharTokenizer(), rl_cfg(env_mix={"code": 1.0}, code_max_tests=4),
                        ScriptedEngine(lambda p, r: ""), seed=0)
    assert orch.envs["code"].max_tests == 4


# -- rl.staleness=prime_rl: prime-rl's rule (src/prime_rl/orchestrator/scheduler.py at PR 1272) ---------------
def prime(**kw):
    return rl_cfg(staleness="prime_rl", **kw)


class HoldGroupZero(ScriptedEngine):
    """Starts every request at once; answers all but those of group 0 (sampling seed gid * 1000 + sample, with
    rl.seed=0), which stay running until cancelled."""

    def __init__(self, answer_fn):
        super().__init__(answer_fn)
        self.running = {}  # request id -> request, started and not finished

    def poll(self, timeout=None):
        held = [r for r in self.pending if r.params.seed // 1000 == 0]
        self.running.update((r.id, r) for r in held)
        self.pending = [r for r in self.pending if r.params.seed // 1000 != 0]
        return super().poll(timeout)

    def cancel(self, request_ids):
        super().cancel(request_ids)
        for rid in request_ids:
            self.running.pop(rid, None)


def test_prime_rl_a_group_lives_through_nine_updates_and_is_cancelled_running_at_the_tenth():
    eng = HoldGroupZero(answer_by_index(lambda i: {0}))
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=1, max_off_policy_steps=8), eng, seed=0)
    orch.next_batch(0)
    group0 = sorted(eng.running)
    assert len(group0) == 4 and 0 in orch.inflight  # running on the engine, not finished
    for v in range(1, 10):  # nine updates: it lives through each (its count is never above 8 at an update)
        eng.update_weights(None, v)
        _, stats = orch.next_batch(v)
        assert stats["cancelled_groups"] == 0 and orch.inflight[0].off_policy_steps == v
    assert stats["off_policy_level_max"] == 9 and sorted(eng.running) == group0
    submitted = orch.counters["groups_submitted"]
    eng.update_weights(None, 10)  # the tenth: its count (9) is above 8, so it is cancelled on the engine
    _, stats = orch.next_batch(10)
    assert eng.cancels == [group0] and not eng.running  # its running requests too
    assert 0 not in orch.inflight and not any(gid == 0 for gid, _ in orch.requests.values())
    assert stats["cancelled_groups"] == 1 and stats["rescheduled_groups"] == 1
    assert orch.counters["groups_submitted"] >= submitted + 1  # a new group in its place
    # a result of a cancelled request that was already on its way is ignored
    from recipe.inference.engine import Done
    from recipe.rollout import Completion
    eng.events.append(Done([(group0[0], Completion([ord("x")], [-1.0], "stop", 0))], 0.0))
    eng.update_weights(None, 11)
    orch.next_batch(11)
    assert orch.counters["results_of_cancelled_requests"] == 1 and orch.counters["groups_cancelled_off_policy"] == 1


def test_prime_rl_a_finished_group_older_than_max_async_level_is_used_not_dropped():
    eng = ScriptedEngine(answer_by_index(lambda i: {0}), batch=4)
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=1), eng, seed=0)
    orch.start()
    try:
        orch.next_batch(0)  # leaves the next batch in flight
        wait_until(lambda: orch.ready_groups >= 2)  # written by version 0 while the trainer works
        eng.update_weights(None, 2)
        samples, stats = orch.next_batch(3)  # drop_stale would drop both (version 0 < 3 - 1)
    finally:
        orch.close()
    assert stats["stale_groups"] == 0 and orch.counters["groups_stale"] == 0
    assert all(s.policy_version == 0 for s in samples) and stats["staleness"] == {3: 8}


def test_prime_rl_batch_n_is_assembled_only_once_the_weights_of_step_n_minus_1_are_on_the_engine():
    # prime-rl's generate_batch(n) takes each finished group into batch n and submits a new one in its place at
    # once; the orchestrator goes on to step n + 1 as soon as batch n is full, and waits there for checkpoint n
    fn = answer_by_index(lambda i: {0})
    eng = ScriptedEngine(fn)
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=1), eng, seed=0)
    orch.next_batch(0)
    orch.next_batch(1)  # policy 0 is enough for step 1
    sent = len(eng.sent)
    # the groups that replaced batch 1's went out as it was assembled, under policy 0
    assert orch.in_flight_groups == 2 and all(r.submitted_version == 0 for r in eng.sent)
    with pytest.raises(RuntimeError, match="step 2 waits for policy version 1"):
        orch.next_batch(2)  # they finish, but none joins batch 2 and none is replaced before policy 1
    assert len(eng.sent) == sent and orch.ready_groups == 2 and orch.in_flight_groups == 0
    eng.update_weights(None, 1)
    samples, stats = orch.next_batch(2)
    assert len(samples) == 8 and stats["staleness"] == {2: 8}  # written by policy 0: two steps back
    assert len(eng.sent) == sent + 8 and all(r.submitted_version == 1 for r in eng.sent[sent:])

    # with the event loop in a thread: batch 2 waits, ready, for update_weights(1), and is taken at once then
    eng = ScriptedEngine(fn)
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=1), eng, seed=0)
    orch.start()
    try:
        orch.next_batch(0)
        orch.next_batch(1)
        wait_until(lambda: orch.ready_groups == 2 and orch.in_flight_groups == 0)
        sent = len(eng.sent)
        time.sleep(0.3)
        assert len(eng.sent) == sent
        eng.update_weights(None, 1)
        wait_until(lambda: len(eng.sent) > sent)
        assert orch.next_batch(2)[1]["staleness"] == {2: 8}
    finally:
        orch.close()
    assert all(r.submitted_version == 1 for r in eng.sent[sent:])


def test_prime_rl_keeps_batch_size_groups_in_flight_or_ready():
    eng = ScriptedEngine(answer_by_index(lambda i: {0}), batch=4)
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=2, online_filter=False), eng, seed=0)
    orch.next_batch(0)
    assert orch.in_flight_groups + orch.ready_groups == 2  # batch_size, whatever max_async_level (s.py:48)


def test_the_state_for_a_checkpoint_is_a_copy_that_later_draws_leave_alone():
    # the event loop draws prompts on while the trainer writes the checkpoint: the state must be the one taken
    orch = Orchestrator(math_rows(), CharTokenizer(), prime(max_async_level=1),
                        ScriptedEngine(answer_by_index(lambda i: {0})), seed=0)
    orch.next_batch(0)
    state = orch.state_dict()
    taken = json.dumps(state, sort_keys=True)
    for _ in range(3):
        orch._submit_new_group()
    assert json.dumps(state, sort_keys=True) == taken and orch.state_dict()["next_gid"] > state["next_gid"]
