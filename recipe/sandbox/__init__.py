"""Running untrusted, model-written Python safely: every program a model writes runs here and nowhere else.

    run_python(code, stdin, limits) -> RunResult   one run, with a status and a one-line reason
    run_tests(code, tests, limits) -> TestReport   stdin/stdout and functional tests (LiveCodeBench's two kinds)
    backend() -> "bwrap" | "unshare" | "rlimit"    which isolation is in use (runner.py says what each gives)

A result whose sandbox failed (RunResult.sandbox_failed, TestReport.sandbox_error) says nothing about the
program: the sample is masked, not scored 0. A program cannot make its own run look like a sandbox failure: the
sandbox reports that it started before any of the program runs. Where no backend can isolate code, running any
raises SandboxError (one line for the user) unless RECIPE_SANDBOX_UNISOLATED=1 accepts the weaker "rlimit".
"""
from recipe.sandbox.grading import TestReport, run_tests
from recipe.sandbox.runner import Limits, RunResult, backend, run_python

__all__ = ["Limits", "RunResult", "TestReport", "backend", "run_python", "run_tests"]
