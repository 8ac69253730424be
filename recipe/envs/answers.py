"""Reading a final answer: the last \\boxed{...}, TeX wrappers, and one normal form for string comparison.

Shared by the environments that compare answers as text (exact match, science letters, tool results); math
answers go through math-verify instead.
"""
from __future__ import annotations

import re
import unicodedata

_BOXED = re.compile(r"\\boxed\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_ANSWER_LINE = re.compile(r"(?i:answer)\s*[:：]\s*(.+)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None when there is none (or it is unclosed)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[starts[-1]:i]
        i += 1
    return None


def unwrap_tex(text: str) -> str:
    """\\text{B}, \\mathbf{B}, ... -> B, nested wrappers included (\\text{\\textbf{B}} unwraps in two passes)."""
    prev = None
    while prev != text:
        prev, text = text, _WRAPPERS.sub(r"\1", text)
    return text


def candidate(answer: str) -> str:
    """The part of a final answer that is compared: the last \\boxed{...}, else the text after the last
    "Answer:", else the whole answer."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(answer)
    return lines[-1] if lines else answer


def normalize(text: str) -> str:
    """Case, spacing, TeX wrappers, dollar signs, markdown emphasis and trailing punctuation do not matter."""
    text = unwrap_tex(unicodedata.normalize("NFKC", text))
    text = text.replace("$", "").replace("**", "").replace("\\,", " ").replace("\\ ", " ")
    text = re.sub(r"\s+", " ", text).strip().strip(".;,").strip()
    return text.casefold()


def normalize_number(text: str) -> str:
    """normalize(), and digit grouping (1,234 or 1 234) does not matter either."""
    return normalize(text).replace(",", "").replace(" ", "")
