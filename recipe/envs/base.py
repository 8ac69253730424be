"""The environment interface.

An environment turns a schema row into a prompt, parses the final answer out of a completion (the text after
</think>), and scores it with a rubric: weighted reward functions whose weighted sum is the reward. A reward
function that raises is caught, counted and reported; it never stops a run, unless it raises a RecipeError (a
missing prerequisite, e.g. no sandbox here can isolate code: every sample would fail alike). One that raises
MaskSample (the verifier itself could not judge, e.g. a broken sandbox) masks the sample: it is neither right nor
wrong, so eval leaves it out of its metrics (and RL can drop it, from RewardResult.masked) rather than count it
as 0.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from recipe.chat import parse_final_answer
from recipe.errors import RecipeError

log = logging.getLogger(__name__)


class RewardTimeout(Exception):
    pass


class _RewardWorker(threading.Thread):
    """A daemon thread that runs reward calls one after another. Starting a thread costs about 130 us of CPU here,
    and an RL run scores tens of thousands of samples on the trainer's core; a worker is reused instead."""

    def __init__(self):
        super().__init__(daemon=True, name="reward-fn")
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args), or None: stop
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # (True, value) or (False, exception)
        self.start()

    def run(self):
        while (job := self.jobs.get()) is not None:
            fn, args = job
            try:
                self.results.put((True, fn(*args)))
            except BaseException as e:  # handed to the caller
                self.results.put((False, e))


_IDLE_WORKERS: list[_RewardWorker] = []
_IDLE_LOCK = threading.Lock()
_MAX_IDLE_WORKERS = 32  # more than the samples ever scored at once (rollout.score_in_threads)


def _forget_workers():  # a forked child has none of its parent's threads
    global _IDLE_LOCK
    _IDLE_LOCK = threading.Lock()
    _IDLE_WORKERS.clear()


os.register_at_fork(after_in_child=_forget_workers)


def call_with_timeout(fn, args: tuple, timeout_s: float):
    """fn(*args) in a daemon worker thread; past timeout_s the run moves on without it (a thread cannot be killed,
    so a verifier stuck for good costs a thread, never the run): that worker is told to stop once it is done and
    is never used again."""
    with _IDLE_LOCK:
        worker = _IDLE_WORKERS.pop() if _IDLE_WORKERS else None
    worker = worker or _RewardWorker()
    worker.jobs.put((fn, args))
    try:
        ok, value = worker.results.get(timeout=timeout_s)
    except queue.Empty:
        worker.jobs.put(None)
        raise RewardTimeout(f"no result after {timeout_s:g} s") from None
    with _IDLE_LOCK:
        idle = len(_IDLE_WORKERS) < _MAX_IDLE_WORKERS
        if idle:
            _IDLE_WORKERS.append(worker)
    if not idle:
        worker.jobs.put(None)
    if not ok:
        raise value
    return value


class MaskSample(Exception):
    """Raised by a reward function when the sample cannot be judged; the message says why."""


@dataclass
class RewardResult:
    reward: float
    metrics: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    masked: bool = False  # not judged (infrastructure failure): drop the sample, do not score it 0
    mask_reason: str | None = None
    counts: dict = field(default_factory=dict)  # events the RL orchestrator adds to its counters (judge_calls, ...)


class Environment:
    name = "base"
    # the rubric: (name, function(answer, row) -> float, weight)
    rubric: list[tuple[str, Callable, float]] = []
    reward_timeout_s: float = 30.0  # per reward function call; a verifier that hangs costs the sample only
    score_in_parallel: bool = False  # its samples may be scored several at a time (sandboxed processes)
    multi_turn: bool = False  # the environment replies to tool calls (tool_reply) and the model goes on
    uses_judge: bool = False  # its constructor takes judge= (recipe.envs.judge.Judge or None): get_env passes it
    max_turns: int = 1  # model turns per sample, the final answer included

    def prompt(self, row: dict) -> list[dict]:
        return [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]

    def tool_reply(self, turn: str, row: dict) -> str | None:
        """The environment's reply to one model turn, or None when the turn is final."""
        return None

    def score(self, completion: str, row: dict) -> RewardResult:
        answer = parse_final_answer(completion)
        metrics, errors, total, masked = {"formatted": float(answer is not None)}, [], 0.0, []
        for name, fn, weight in self.rubric:
            try:
                value = float(call_with_timeout(fn, (answer, row), self.reward_timeout_s)) if answer is not None else 0.0
            except MaskSample as e:
                masked.append(f"{name}: {e}")
                value = 0.0
            except RecipeError:  # a missing prerequisite (no sandbox can isolate code here): every sample alike
                raise
            except Exception as e:  # a verifier bug must cost one sample, not the run
                log.warning("reward function %s.%s failed: %s", self.name, name, e)
                errors.append(f"{name}: {type(e).__name__}: {e}")
                value = 0.0
            metrics[name] = value
            total += weight * value
        if masked:
            return RewardResult(reward=0.0, metrics=metrics, errors=errors, masked=True, mask_reason="; ".join(masked))
        return RewardResult(reward=total, metrics=metrics, errors=errors)
