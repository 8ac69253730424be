"""Exact match (HLE's exactMatch rows): math-verify first, then a normalised string comparison.

The candidate is the last \\boxed{...} of the final answer, else the text after the last "Answer:", else the
whole final answer. math-verify only sees gold answers that look mathematical (no words outside TeX commands):
it parses "ab" as a*b, so "Albert Einstein" would equal "Einstein Albert". HLE itself grades with an LLM judge
(o3-mini); this rule-based grader is a documented deviation: it is stricter on paraphrased free-form answers.
"""
from __future__ import annotations

import re

from recipe.envs.answers import candidate, normalize
from recipe.envs.base import Environment
from recipe.envs.math import math_correct


def looks_math(text: str) -> bool:
    return re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", text)) is None


def exact_correct(answer: str, row: dict) -> float:
    cand = candidate(answer)
    if looks_math(str(row["answer"])) and math_correct(f"\\boxed{{{cand}}}", row) >= 1.0:
        return 1.0
    return float(normalize(cand) == normalize(str(row["answer"])))


class ExactEnv(Environment):
    name = "exact"
    rubric = [("correct", exact_correct, 1.0)]
