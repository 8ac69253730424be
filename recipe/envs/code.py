"""Code: the last ```python block of the final answer, run against the row's tests in recipe.sandbox.

reward = 1 only when every test run passes, else 0 (prime-environments' i3-code: `passed`, weight 1, its share of
tests passed has weight 0; LiveCodeBench's criterion too). With partial_credit (rl.code_partial_credit: the tiny
preset's RL, and eval, where a row does not ask for all tests (`all_tests_must_pass`)), the share of tests passed
instead: on a small model it gives a gradient before whole programs pass. A problem with more than
max_tests tests runs max_tests of them, the same ones every time (sampled with the row's id as seed; i3-code's
max_num_tests = 15, the RL setting rl.code_max_tests); eval runs every test. A sandbox that fails
(sandbox_error) raises MaskSample: the program is never blamed for it; RL masks the sample or, with
rl.mask_sandbox_failures=false (prime-rl), scores it 0.

Tests come in the sandbox's format ({"input", "output"} for stdin programs, {"fn", "args", "expected"} for
functions), either as info["tests"] (benchmarks) or as INTELLECT-3-RL's info["entry"]["tests"]
({"fn_name", "inputs", "outputs"}), converted here.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import threading
from concurrent.futures import Future

from recipe.envs.base import Environment, MaskSample
from recipe.sandbox import run_tests

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = {"python", "py", "python3"}
# LiveCodeBench's harness runs every program after imports like these; LeetCode starter code relies on them
# (List, Optional, collections, ...). Prepended only where a row asks for it (info["prelude"]).
PRELUDE = ("from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
           "from heapq import *\nfrom bisect import *\nfrom math import *\nimport collections, functools, heapq, "
           "bisect, itertools, math, re, string, sys\n")


def extract_code(answer: str) -> str | None:
    """The last ```python (or py, python3) block; failing that, the last untagged block; else None."""
    blocks = _FENCE.findall(answer)
    tagged = [body for tag, body in blocks if tag.lower() in PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    chosen = tagged or untagged
    return chosen[-1] if chosen else None


def row_tests(row: dict) -> list[dict]:
    info = json.loads(row.get("info") or "{}")
    if isinstance(info.get("tests"), list):
        return info["tests"]
    raw = (info.get("entry") or {}).get("tests")
    if isinstance(raw, str):
        raw = json.loads(raw)
    if not isinstance(raw, dict):
        return []
    fn = raw.get("fn_name")
    if fn:
        return [{"fn": fn, "args": list(i), "expected": o} for i, o in zip(raw["inputs"], raw["outputs"])]
    return [{"input": i, "output": o} for i, o in zip(raw["inputs"], raw["outputs"])]


def program(code: str, tests: list[dict], prelude: bool) -> str:
    """The code as the sandbox runs it. LeetCode-style answers define `class Solution`; a module-level alias
    lets a sandbox that calls `fn(*args)` reach the method."""
    out = (PRELUDE if prelude else "") + code
    for fn in sorted({t["fn"] for t in tests if "fn" in t}):
        if "class Solution" in code and not re.search(rf"^def {re.escape(fn)}\s*\(", code, re.MULTILINE):
            out += f"\n\ndef {fn}(*args):\n    return Solution().{fn}(*args)\n"
    return out


# Verdicts by program and tests: the samples of a group often repeat a program, and each sandbox run costs a
# process start. A program's verdict is deterministic up to its limits, which do not change within a run.
# Each entry is a Future: samples scored at the same time (rollout.score_in_threads) wait for one run.
_VERDICTS: dict[str, Future] = {}
_VERDICTS_LOCK = threading.Lock()  # samples are scored from several threads at once


def _run_once(key: str, source: str, tests: list[dict]):
    """run_tests(source, tests), once for every sample that asks for the same key, at the same time or later.
    A sandbox failure is not kept: the samples that waited on it try again (one runs, the others wait)."""
    with _VERDICTS_LOCK:
        entry = _VERDICTS.get(key)
        mine = entry is None
        if mine:
            entry = _VERDICTS[key] = Future()
    if not mine:
        report = entry.result()
        return report if not report.sandbox_error else _run_once(key, source, tests)
    try:
        report = run_tests(source, tests)
    except BaseException as e:
        with _VERDICTS_LOCK:
            _VERDICTS.pop(key, None)
        entry.set_exception(e)
        raise
    with _VERDICTS_LOCK:
        if report.sandbox_error:
            _VERDICTS.pop(key, None)
        while len(_VERDICTS) > 4096:  # oldest first
            _VERDICTS.pop(next(iter(_VERDICTS)))
    entry.set_result(report)
    return report


def select_tests(tests: list[dict], row: dict, max_tests: int | None) -> list[dict]:
    """At most max_tests of the row's tests, in their order, the same ones every time: sampled with the row's id
    as seed (a string seed hashes the same in every process). None: every test."""
    if max_tests is None or len(tests) <= max_tests:
        return tests
    seed = f"code-tests:{row.get('id') or json.dumps(row.get('prompt'), sort_keys=True)}"
    keep = sorted(random.Random(seed).sample(range(len(tests)), max_tests))
    return [tests[i] for i in keep]


def code_passed(answer: str, row: dict, max_tests: int | None = None, partial_credit: bool = False) -> float:
    """1.0 when the answer's program passes every test run (at most max_tests of the row's), else 0.0; with
    partial_credit the share passed, unless the row asks for all (`all_tests_must_pass`). A repeated program runs
    once, also when its samples are scored at the same time. A sandbox failure raises MaskSample."""
    code = extract_code(answer)
    if code is None:
        return 0.0  # no program: the model's fault, scored 0
    tests = row_tests(row)
    if not tests:
        raise ValueError(f"row {row.get('id')} has no tests")
    tests = select_tests(tests, row, max_tests)
    info = json.loads(row.get("info") or "{}")
    source = program(code, tests, bool(info.get("prelude")))
    key = hashlib.sha256(json.dumps([source, tests], sort_keys=True).encode()).hexdigest()
    report = _run_once(key, source, tests)
    if report.sandbox_error:
        raise MaskSample(f"sandbox error: {report.sandbox_error}")
    if partial_credit and not info.get("all_tests_must_pass"):
        return report.passed / report.total if report.total else 0.0
    return float(report.total > 0 and report.passed == report.total)


class CodeEnv(Environment):
    name = "code"
    reward_timeout_s = 600.0  # the sandbox bounds every test (wall_s each); this only guards the harness
    score_in_parallel = True

    def __init__(self, max_tests: int | None = None, partial_credit: bool = True):
        """max_tests: run at most this many of a problem's tests (RL: rl.code_max_tests); None: all (eval).
        partial_credit: the share of tests passed where a row does not ask for all (RL: rl.code_partial_credit;
        eval keeps it, so held-out numbers stay comparable across versions)."""
        self.max_tests = max_tests
        self.rubric = [("passed", functools.partial(code_passed, max_tests=max_tests, partial_credit=partial_credit),
                        1.0)]
