"""Science: multiple choice (GPQA, MMLU-Pro, HLE's multiple-choice rows) graded on the option letter; rows
without options (INTELLECT-3-RL's science subset) graded by math-verify, as INTELLECT-3's science environment
does, and then, with a judge (rl.judge.enabled), the answers math-verify rejects judged again by the LLM judge
(recipe/envs/judge.py), as there. Multiple-choice rows are never sent to the judge: the letter decides.

A row is multiple choice when its info carries `letters` (the valid option letters) and its answer is the gold
letter. The letter is read from the final answer (after </think>) by the first rule that applies:
  1. the last \\boxed{...} holding a letter: \\boxed{B}, \\boxed{(B)}, \\boxed{\\text{B}}, \\boxed{B) 4 m/s}
  2. the last "answer: B" / "answer is (B)" / "**Answer:** B" (case of "answer" free, the letter upper case)
  3. the whole answer is the letter: "B", "(B)", "B.", "**B**"
  4. the answer opens with an option label: "(B) 4 m/s", "B) 4 m/s", "B. 4 m/s", "B: 4 m/s"
A letter outside the row's options, or none found, scores 0: a guess is never read out of free prose.
"""
from __future__ import annotations

import json
import re

from recipe.envs.answers import last_boxed, unwrap_tex
from recipe.envs.judge import JudgedEnvironment
from recipe.envs.math import math_correct

_LABEL = re.compile(r"^[\s*_]*[(\[]?\s*([A-Z])\s*(?:[)\].:]|$)")
_ANSWER = re.compile(r"(?i:answer)(?:\s+is)?\s*[:：]?[\s*_]*(?:(?i:option)\s+)?[(\[]?\s*([A-Z])(?![A-Za-z0-9])")
_ONLY = re.compile(r"^[\s*_$]*[(\[]?\s*([A-Z])\s*[)\]]?[\s*_.$]*$")


def extract_letter(answer: str, letters: str = "ABCDEFGHIJ") -> str | None:
    """The option letter the final answer commits to (rules in the module docstring), or None."""
    boxed = last_boxed(answer)
    if boxed is not None:
        m = _LABEL.match(unwrap_tex(boxed))
        if m:
            return m.group(1) if m.group(1) in letters else None
    found = _ANSWER.findall(unwrap_tex(answer))
    if found:
        return found[-1] if found[-1] in letters else None
    for rule in (_ONLY, _LABEL):
        m = rule.match(unwrap_tex(answer).strip())
        if m:
            return m.group(1) if m.group(1) in letters else None
    return None


def _letters(row: dict) -> str | None:
    return json.loads(row.get("info") or "{}").get("letters")


def science_correct(answer: str, row: dict) -> float:
    letters = _letters(row)
    if letters:
        return float(extract_letter(answer, letters) == str(row["answer"]).strip())
    return math_correct(answer, row)


class ScienceEnv(JudgedEnvironment):
    name = "science"
    rubric = [("correct", science_correct, 1.0)]

    def judgeable(self, row: dict) -> bool:
        return not _letters(row)  # multiple choice: graded on the letter alone, never judged
