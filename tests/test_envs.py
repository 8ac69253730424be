import json

import pytest

from recipe.chat import parse_final_answer
from recipe.envs import get_env
from recipe.envs.base import Environment


def _row(env, answer, info=None):
    return {"env": env, "answer": answer, "info": json.dumps(info or {}), "prompt": []}


def test_parser_takes_text_after_last_think_end():
    assert parse_final_answer("<think>a</think>\n 42 ") == "42"
    assert parse_final_answer("<think>a</think>b</think>c") == "c"
    assert parse_final_answer("42") is None


def test_math_env_uses_math_verify_equivalence():
    env = get_env("math")
    row = _row("math", "1/2")
    assert env.score("<think>x</think>\n\\boxed{0.5}", row).reward == 1.0
    assert env.score("<think>x</think>\n\\boxed{\\frac{1}{2}}", row).reward == 1.0
    assert env.score("<think>x</think>\n\\boxed{3}", row).reward == 0.0
    assert env.score("\\boxed{0.5}", row).reward == 0.0  # no </think>: the format was not followed


def test_math_verdicts_are_reused_for_a_repeated_answer_but_not_under_a_timeout(monkeypatch):
    import math_verify

    import recipe.envs.math as math_env

    timeouts = []  # parsing_timeout of every math-verify parse (imported where it is called: recipe.envs.math)
    real_parse = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: timeouts.append(kw["parsing_timeout"]) or
                        real_parse(text, **kw))
    math_env._cached_verify.cache_clear()
    env, row = get_env("math"), _row("math", "1/2")
    for _ in range(3):  # a group's samples with the same final answer
        assert env.score("<think>a</think>\n\\boxed{0.5}", row).reward == 1.0
    assert timeouts == [None, None]  # reference and answer parsed once, in score's worker thread
    assert env.score("<think>b</think>\n\\boxed{3}", row).reward == 0.0  # another answer is verified
    assert env.score("<think>c</think>\n\\boxed{3}", _row("math", "3")).reward == 1.0  # ... and another reference
    assert len(timeouts) == 6
    # on the main thread math-verify's timeouts are in force: such a verdict is not kept
    for _ in range(2):
        assert math_env.math_correct("\\boxed{0.5}", row) == 1.0
    assert timeouts[6:] == [5, 5, 5, 5]


def test_logic_env_uses_reasoning_gym_scorer():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("spell_backward", size=1, seed=3)[0]
    row = _row("logic", entry["answer"], {"task": "spell_backward", "entry": {
        "question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}})
    env = get_env("logic")
    assert env.score(f"<think>t</think>\n{entry['answer']}", row).reward == 1.0
    assert env.score("<think>t</think>\nzzzzzzzzzz", row).reward < 1.0


def test_a_raising_reward_function_is_caught_and_reported():
    def broken(answer, row):
        raise RuntimeError("verifier bug")

    class Broken(Environment):
        name = "broken"
        rubric = [("ok", lambda a, r: 1.0, 0.5), ("bad", broken, 0.5)]

    res = Broken().score("<think></think>x", {})
    assert res.reward == 0.5 and res.metrics["bad"] == 0.0
    assert res.errors and "verifier bug" in res.errors[0]


def test_a_reward_function_that_hangs_times_out_and_the_sample_scores_0():
    import time

    class Hanging(Environment):
        name = "hanging"
        reward_timeout_s = 0.3
        rubric = [("ok", lambda a, r: 1.0, 0.5), ("stuck", lambda a, r: time.sleep(30), 0.5)]

    t0 = time.perf_counter()
    res = Hanging().score("<think></think>x", {})
    assert time.perf_counter() - t0 < 5
    assert res.reward == 0.5 and res.metrics["stuck"] == 0.0
    assert res.errors and "stuck: RewardTimeout" in res.errors[0] and "0.3 s" in res.errors[0]


def test_reward_calls_reuse_a_worker_thread_but_never_one_that_timed_out():
    import multiprocessing
    import threading

    from recipe.envs.base import RewardTimeout, call_with_timeout

    def where(x):
        return threading.get_ident(), x

    first, _ = call_with_timeout(where, (1,), 5)
    assert first != threading.get_ident()  # not the caller's thread
    before = threading.active_count()
    assert [call_with_timeout(where, (i,), 5) for i in range(50)] == [(first, i) for i in range(50)]
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="verifier bug"):  # a reward function's error reaches the caller
        call_with_timeout(lambda: (_ for _ in ()).throw(ValueError("verifier bug")), (), 5)

    release, stuck = threading.Event(), []
    with pytest.raises(RewardTimeout, match="0.2 s"):
        call_with_timeout(lambda: stuck.append(threading.get_ident()) or release.wait(30), (), 0.2)
    assert stuck == [first]  # the idle worker took the call, and is still in it
    for i in range(5):  # ... and is not handed another one
        assert call_with_timeout(where, (i,), 5)[0] != first
    release.set()  # it ends its call, finds it was let go and stops
    [thread] = [t for t in threading.enumerate() if t.ident == first]
    thread.join(5)
    assert not thread.is_alive()

    # a forked child has none of its parent's threads: it starts workers of its own
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(call_with_timeout, (sum, ([1, 2],), 5), ) == 3


def test_unknown_environment_names_itself():
    try:
        get_env("nope")
    except KeyError as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("expected KeyError")


def test_code_verdicts_are_reused_for_a_repeated_program(monkeypatch):
    import recipe.envs.code as code_env
    from recipe.envs import get_env

    calls = []

    class Report:
        passed, total, sandbox_error = 1, 2, None

    class Broken(Report):
        sandbox_error = "worker crashed"

    monkeypatch.setattr(code_env, "run_tests", lambda src, tests, limits=None: calls.append(src) or
                        (Broken() if "broken" in src else Report()))
    monkeypatch.setattr(code_env, "_VERDICTS", {})
    row = {"id": "r", "info": '{"tests": [{"fn": "f", "args": [1], "expected": 2}]}'}
    env = get_env("code", partial_credit=False)
    a = env.score("<think></think>```python\ndef f(x):\n    return 2\n```", row)
    b = env.score("<think></think>```python\ndef f(x):\n    return 2\n```", row)
    assert a.reward == b.reward == 0.0 and len(calls) == 1  # 1 of 2 tests: not all of them
    for _ in range(2):  # a sandbox failure is never remembered: the next sample tries again
        assert env.score("<think></think>```python\n# broken\n```", row).masked
    assert len(calls) == 3


def test_a_program_its_group_repeats_runs_once_though_the_samples_are_scored_at_the_same_time(monkeypatch):
    """The orchestrator scores a group's samples in several threads (rollout.score_in_threads): samples that
    repeat a program wait for its one run rather than each starting a sandbox; a failed run is not shared, each
    sample that waited on it tries again."""
    import time

    import recipe.envs.code as code_env
    from recipe.envs import get_env
    from recipe.rollout import score_in_threads

    calls = []

    class Report:
        passed, total, sandbox_error = 1, 1, None

    class Broken(Report):
        sandbox_error = "worker crashed"

    def run_tests(src, tests, limits=None):
        calls.append(src)
        time.sleep(0.2)  # every thread of the pool asks while the first run is still going
        return Broken() if "broken" in src else Report()

    monkeypatch.setattr(code_env, "run_tests", run_tests)
    monkeypatch.setattr(code_env, "_VERDICTS", {})
    row = {"id": "r", "info": '{"tests": [{"fn": "f", "args": [1], "expected": 2}]}'}
    env = get_env("code", partial_credit=False)
    a, b = ("<think></think>```python\ndef f(x):\n    return %d\n```" % v for v in (2, 3))
    results = score_in_threads(lambda text: env.score(text, row), [a] * 5 + [b] * 3, lambda text: True)
    assert [r.reward for r in results] == [1.0] * 8 and len(calls) == 2
    calls.clear()
    broken = "<think></think>```python\n# broken\n```"
    results = score_in_threads(lambda text: env.score(text, row), [broken] * 3, lambda text: True)
    assert all(r.masked for r in results) and len(calls) == 3


def fake_sandbox(monkeypatch, failing=()):
    """The code environment's sandbox, in-process: a test passes unless its argument is in `failing`; a program
    that says `crash` brings the sandbox down. Returns the list of test lists it was asked to run."""
    import recipe.envs.code as code_env

    runs = []

    class Report:
        def __init__(self, tests, error=None):
            self.total, self.sandbox_error = len(tests), error
            self.passed = 0 if error else sum(t["args"][0] not in failing for t in tests)

    def run_tests(source, tests, limits=None):
        runs.append(tests)
        return Report(tests, "worker crashed" if "crash" in source else None)

    monkeypatch.setattr(code_env, "run_tests", run_tests)
    monkeypatch.setattr(code_env, "_VERDICTS", {})
    return runs


def code_row(n: int, row_id: str = "r") -> dict:
    return {"id": row_id, "info": json.dumps({"tests": [{"fn": "f", "args": [i], "expected": i} for i in range(n)]})}


PROGRAM = "<think></think>```python\ndef f(x):\n    return x\n```"


def test_code_reward_is_1_only_when_every_test_passes(monkeypatch):
    """Without partial credit (prime-rl's i3-code, rl.code_partial_credit=false in intellect3)."""
    from recipe.envs import get_env

    fake_sandbox(monkeypatch)
    assert get_env("code", partial_credit=False).score(PROGRAM, code_row(5)).reward == 1.0
    fake_sandbox(monkeypatch, failing={3})
    res = get_env("code", partial_credit=False).score(PROGRAM, code_row(5))
    assert res.reward == 0.0 and not res.masked  # 4 of 5 is a wrong answer, not 0.8
    assert get_env("code", partial_credit=False).score("<think></think>no program", code_row(5)).reward == 0.0


def test_code_partial_credit_is_the_share_passed_unless_the_row_asks_for_every_test(monkeypatch):
    """The tiny preset's choice (rl.code_partial_credit=true) and eval's default: 4 of 5 gives 0.8; a row with
    `all_tests_must_pass` (LiveCodeBench) still needs every test."""
    from recipe.envs import get_env

    fake_sandbox(monkeypatch, failing={3})
    assert get_env("code").score(PROGRAM, code_row(5)).reward == pytest.approx(0.8)
    strict = code_row(5)
    strict["info"] = json.dumps({**json.loads(strict["info"]), "all_tests_must_pass": True})
    assert get_env("code").score(PROGRAM, strict).reward == 0.0


def test_code_runs_at_most_max_tests_the_same_ones_every_time(monkeypatch):
    from recipe.envs import get_env
    from recipe.envs.code import select_tests

    env = get_env("code", max_tests=15, partial_credit=False)
    chosen = []
    for _ in range(2):  # a fresh sandbox each time: no verdict remembered
        runs = fake_sandbox(monkeypatch)
        assert env.score(PROGRAM, code_row(20)).reward == 1.0
        chosen.append([t["args"][0] for t in runs[0]])
    first = chosen[0]
    assert chosen[1] == first and len(first) == 15 and first == sorted(set(first))  # 15 distinct, in row order
    # the same 15 in every process and every call (seeded by the row's id), other ones for another row
    tests = json.loads(code_row(20)["info"])["tests"]
    assert [t["args"][0] for t in select_tests(tests, code_row(20), 15)] == first
    assert select_tests(tests, code_row(20), 15) == select_tests(tests, code_row(20), 15)
    assert select_tests(tests, code_row(20, "other"), 15) != select_tests(tests, code_row(20), 15)
    # a failing test outside the 15 is never run; one inside fails the problem
    outside, inside = min(set(range(20)) - set(first)), first[0]
    fake_sandbox(monkeypatch, failing={outside})
    assert env.score(PROGRAM, code_row(20)).reward == 1.0
    fake_sandbox(monkeypatch, failing={inside})
    assert env.score(PROGRAM, code_row(20)).reward == 0.0
    # eval's environment (no cap) and a problem of 15 tests or fewer run every test
    runs = fake_sandbox(monkeypatch)
    get_env("code").score(PROGRAM, code_row(20))
    env.score(PROGRAM, code_row(15))
    assert [len(r) for r in runs] == [20, 15]


def test_a_sandbox_failure_masks_the_code_sample(monkeypatch):
    from recipe.envs import get_env

    fake_sandbox(monkeypatch)
    res = get_env("code").score("<think></think>```python\n# crash\n```", code_row(3))
    assert res.masked and res.reward == 0.0 and "worker crashed" in res.mask_reason and not res.errors


def test_score_in_threads_keeps_order_and_runs_only_the_picked_items_in_parallel():
    import threading
    import time

    from recipe.rollout import score_in_threads

    main, seen = threading.get_ident(), {}

    def slow_square(x):
        seen[x] = threading.get_ident()
        time.sleep(0.1 if x % 2 else 0)
        return x * x

    t0 = time.perf_counter()
    out = score_in_threads(slow_square, list(range(8)), parallel=lambda x: x % 2 == 1)
    assert out == [x * x for x in range(8)]
    assert all(seen[x] == main for x in range(0, 8, 2)) and all(seen[x] != main for x in range(1, 8, 2))
    assert time.perf_counter() - t0 < 0.35  # four 0.1 s items at once, not one after another
