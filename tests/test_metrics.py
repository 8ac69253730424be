import math

import pytest

from recipe.eval.metrics import breakdown, pass_at_k, summarize


def test_unbiased_pass_at_k_matches_hand_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert math.isclose(pass_at_k(4, 1, 1), 0.25)
    assert math.isclose(pass_at_k(4, 1, 2), 1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert math.isclose(pass_at_k(5, 2, 3), 1 - math.comb(3, 3) / math.comb(5, 3))  # 0.9
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summarize_avg_pass_and_stderr():
    s = summarize([[1, 0, 0, 0], [1, 1, 1, 1]], [1, 4])
    assert math.isclose(s["avg@4"], (0.25 + 1.0) / 2)
    assert math.isclose(s["pass@1"], (0.25 + 1.0) / 2)
    assert math.isclose(s["pass@4"], 1.0)
    assert math.isclose(s["stderr"], math.sqrt(((0.25 - 0.625) ** 2 + (1 - 0.625) ** 2) / 1 / 2))


def test_partial_credit_counts_in_avg_not_in_pass():
    s = summarize([[0.5, 0.5]], [1, 2])
    assert s["avg@2"] == 0.5 and s["pass@2"] == 0.0


def test_breakdown_per_env_and_task_and_overall_mean_of_envs():
    recs = [{"env": "math", "task": "add", "scores": [1, 1]}, {"env": "math", "task": "add", "scores": [1, 1]},
            {"env": "logic", "task": "x", "scores": [0, 0]}]
    b = breakdown(recs, [1])
    assert b["env"]["math"]["avg@2"] == 1.0 and b["env"]["logic"]["avg@2"] == 0.0
    assert b["overall"]["avg"] == 0.5  # mean over environments, not over problems
    assert set(b["task"]) == {"math/add", "logic/x"}
