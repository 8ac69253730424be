"""Math: answers graded by math-verify against the reference, as INTELLECT-3's math environment does; with a judge
(rl.judge.enabled), the answers math-verify rejects are judged again by the LLM judge (recipe/envs/judge.py)."""
from __future__ import annotations

import functools
import threading

from recipe.envs.judge import JudgedEnvironment

# The instruction INTELLECT-3's math environment puts before each question.
INSTRUCTION = "Solve the following math problem. Explain your reasoning and put the final answer in \\boxed{}."


def _timeouts():
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _verify(answer: str, reference: str, t: int | None) -> float:
    from math_verify import parse, verify  # sympy: about a second to import, in the processes that grade only

    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=t)
    pred = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=t))


# Verdicts by answer and reference: a group's samples often give the same final answer, and math-verify (sympy)
# costs about a millisecond a call on the tiny preset's answers, far more on long ones. Without a timeout in force
# (every call through Environment.score, whose worker thread cannot set SIGALRM) the verdict depends on the two
# strings only; a call under a timeout is not kept, as its verdict can depend on the machine's load.
@functools.lru_cache(maxsize=8192)
def _cached_verify(answer: str, reference: str) -> float:
    return _verify(answer, reference, None)


def math_correct(answer: str, row: dict) -> float:
    t = _timeouts()
    reference = str(row["answer"])
    return _cached_verify(answer, reference) if t is None else _verify(answer, reference, t)


class MathEnv(JudgedEnvironment):
    name = "math"
    rubric = [("correct", math_correct, 1.0)]
