"""Logic: reasoning-gym tasks, scored by each task's own scorer from the stored reasoning-gym entry."""
from __future__ import annotations

import json
from functools import lru_cache

from recipe.envs.base import Environment


@lru_cache(maxsize=None)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def logic_correct(answer: str, row: dict) -> float:
    info = json.loads(row["info"])
    return float(_scorer(info["task"])(answer, info["entry"]))


class LogicEnv(Environment):
    name = "logic"
    rubric = [("correct", logic_correct, 1.0)]
