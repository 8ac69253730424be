import json

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
    env = get_env("code")
    a = env.score("<think></think>```python\ndef f(x):\n    return 2\n```", row)
    b = env.score("<think></think>```python\ndef f(x):\n    return 2\n```", row)
    assert a.reward == b.reward == 0.5 and len(calls) == 1
    for _ in range(2):  # a sandbox failure is never remembered: the next sample tries again
        assert env.score("<think></think>```python\n# broken\n```", row).masked
    assert len(calls) == 3


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
