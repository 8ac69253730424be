"""Score a program against test cases in the sandbox, the two kinds LiveCodeBench has.

stdin tests ({"input", "output"}): one sandboxed run per test (fresh stdin, fresh interpreter state); output
compared after stripping trailing whitespace per line and at the end. A program that does not compile is not
run again for the other tests.

functional tests ({"fn", "args", "expected"}): one sandboxed process imports the program and calls `fn` (or
`Solution().fn`) on every case, each case under its own wall and CPU timer. If a case brings the whole process
down (a crash, os._exit, a loop the timer cannot interrupt), that case gets the process's verdict and the cases
after it run again in a fresh process, so one bad case never hides the others. The group's deadline is fixed at
its start (a start, an import and one step per case): runs again after a crash share it, and no message on the
harness's channel moves it; cases it leaves no time for are "timeout". Expected values stay on the host: the
program can only report what its function returned.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from recipe.sandbox.runner import CONTROL_BYTES, STEP_GRACE_S, Limits, RunResult, execute


@dataclass
class TestReport:
    __test__ = False  # not a pytest class

    passed: int
    total: int
    results: list[str]         # per test: "pass" | "fail: ..." | "timeout" | "memory" | "sandbox_error"
    sandbox_error: str | None  # set when the sandbox failed: the caller masks the sample, it does not score it

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _short(value, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


def _process_verdict(res: RunResult) -> str:
    if res.status in ("timeout", "memory"):
        return res.status
    if res.status == "ok":
        return "fail: the program exited without an answer"
    return f"fail: {res.reason}"


def _judge_stdout(res: RunResult, expected: str, limits: Limits) -> str:
    if res.status != "ok":
        return _process_verdict(res)
    if res.truncated:
        return f"fail: output exceeded {limits.output_bytes} bytes"
    got, want = _normalize(res.stdout), _normalize(str(expected))
    if got == want:
        return "pass"
    got_lines, want_lines = got.split("\n"), want.split("\n")
    for k in range(max(len(got_lines), len(want_lines))):
        g = got_lines[k] if k < len(got_lines) else "<end>"
        w = want_lines[k] if k < len(want_lines) else "<end>"
        if g != w:
            return f"fail: wrong answer on line {k + 1}: got {g[:60]!r}, expected {w[:60]!r}"
    return "fail: wrong answer"


def _judge_value(msg: dict, expected) -> str:
    if "timeout" in msg:
        return "timeout"
    if "memory" in msg:
        return "memory"
    if "error" in msg:
        return f"fail: {str(msg['error'])[:300]}"
    if "value" not in msg:
        return "fail: no result"
    try:
        want = json.loads(json.dumps(expected))
        if msg["value"] == want:
            return "pass"
    except (TypeError, ValueError, RecursionError):
        return "fail: result could not be compared"
    return f"fail: wrong answer: got {_short(msg['value'])}, expected {_short(want)}"


def _args(test: dict) -> list:
    args = test.get("args", [])
    return list(args) if isinstance(args, (list, tuple)) else [args]  # a lone value is the one argument


def _run_functional(code: str, name: str, idxs: list[int], tests: list[dict], limits: Limits,
                    results: list) -> str | None:
    """Fill results for the functional tests idxs; returns the sandbox's failure, if any."""
    pending = list(idxs)
    step = limits.wall_s + STEP_GRACE_S
    # fixed now, for every process the group may take: the program's start, an import and each case's step;
    # whatever the program writes on the harness's channel, and however often it brings the process down
    until = time.monotonic() + limits.wall_s + (len(pending) + 1) * step
    while pending:
        if time.monotonic() >= until:  # earlier cases took the group's time: the rest do not run
            for i in pending:
                results[i] = "timeout"
            return None
        n = len(pending)
        payload = {"code": code, "fn": name, "cases": [[i, _args(tests[i])] for i in pending],
                   "case_wall_s": limits.wall_s, "case_cpu_s": limits.cpu_s, "max_result_bytes": CONTROL_BYTES // 2}
        res, msgs = execute(payload, "", limits, "fn", step_s=step, cpu_s=limits.cpu_s * (n + 1), until=until)
        if res.sandbox_failed:
            return res.reason
        waiting = set(pending)
        got, begun, fatal = {}, set(), None
        for m in msgs:  # the program shares the channel: trust nothing about the messages' shape
            i = m.get("i", m.get("begin"))
            if "fatal" in m or "compile_error" in m:
                fatal = fatal or str(m.get("fatal") or m.get("compile_error"))[:300]
            elif type(i) is int and i in waiting:
                if "begin" in m:
                    begun.add(i)
                else:
                    got[i] = m
        for i in pending:
            if i in got:
                results[i] = _judge_value(got[i], tests[i].get("expected"))
        rest = [i for i in pending if i not in got]
        if not rest:
            return None
        if fatal or rest[0] not in begun:  # the program failed before the tests: every case shares that
            verdict = f"fail: {fatal}" if fatal else _process_verdict(res)
            for i in rest:
                results[i] = verdict
            return None
        results[rest[0]] = _process_verdict(res)  # it took the process down: the rest get a fresh one
        pending = rest[1:]
    return None


def run_tests(code: str, tests: list[dict], limits: Limits = Limits()) -> TestReport:
    """Run the program on every test; a sandbox failure stops early and is reported for masking."""
    results: list[str | None] = [None] * len(tests)
    stdin_idx, fn_groups = [], {}
    for i, t in enumerate(tests):
        if "fn" in t:
            fn_groups.setdefault(str(t["fn"]), []).append(i)
        elif "output" in t:
            stdin_idx.append(i)
        else:
            results[i] = "fail: malformed test (needs input/output or fn/args/expected)"
    sandbox_error = None
    for k, i in enumerate(stdin_idx):
        res, msgs = execute({"code": code}, str(tests[i].get("input", "")), limits, "script")
        if res.sandbox_failed:
            sandbox_error = res.reason
            break
        results[i] = _judge_stdout(res, tests[i]["output"], limits)
        compile_error = next((m["compile_error"] for m in msgs if "compile_error" in m), None)
        if compile_error:  # same text, same failure: no need to run it again
            for j in stdin_idx[k:]:
                results[j] = f"fail: {str(compile_error)[:300]}"
            break
    for name, idxs in fn_groups.items():
        if sandbox_error:
            break
        sandbox_error = _run_functional(code, name, idxs, tests, limits, results)
    final = [r if r is not None else "sandbox_error" for r in results]
    return TestReport(sum(r == "pass" for r in final), len(tests), final, sandbox_error)
