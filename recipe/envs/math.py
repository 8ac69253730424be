"""Math: answers graded by math-verify against the reference, as INTELLECT-3's math environment does; with a judge
(rl.judge.enabled), the answers math-verify rejects are judged again by the LLM judge (recipe/envs/judge.py)."""
from __future__ import annotations

import threading

from math_verify import parse, verify

from recipe.chat import parse_final_answer
from recipe.envs.base import Environment, RewardResult
from recipe.envs.judge import Judge, question_of

# The instruction INTELLECT-3's math environment puts before each question.
INSTRUCTION = "Solve the following math problem. Explain your reasoning and put the final answer in \\boxed{}."


def _timeouts():
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_correct(answer: str, row: dict) -> float:
    t = _timeouts()
    gold = parse(f"\\boxed{{{row['answer']}}}", parsing_timeout=t)
    pred = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=t))


class MathEnv(Environment):
    name = "math"
    rubric = [("correct", math_correct, 1.0)]
    uses_judge = True

    def __init__(self, judge: Judge | None = None):
        self.judge = judge
        self.score_in_parallel = judge is not None  # a judge call waits on the network: several at a time

    def score(self, completion: str, row: dict) -> RewardResult:
        result = super().score(completion, row)
        if self.judge is None:
            return result
        return self.judge.recheck(result, parse_final_answer(completion), question_of(self.prompt(row)),
                                  row["answer"])
