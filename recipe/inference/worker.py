"""The hf engine in a process of its own, with its own CPU threads, so that generation overlaps training.

The client (HFEngineProcess) speaks the Engine contract of recipe.inference.engine. Inside, two queues:
commands in ("generate", [Request]), ("update", weights_path, version), ("cancel", [request id]), ("stop",); out
the contract's Done and Cancelled events, plus ("ready", version), ("updated", version) and ("error", traceback)
for the client alone.

Requests run first in, first out, continuously batched (recipe.inference.hf.DecodeBatch): between decode steps
waiting requests join the running rows, up to batch_size, together once a quarter of the batch is free or all of
them fit (joining_now), and every row that finished goes back at once (a Done event a step). A weight update is
loaded between two decode steps, as soon as it is read, while rows run (as vLLM runs prime-rl's update_weights
between engine steps): a running row's next tokens come from the new weights, their logprobs too (the trainer's
importance ratio is taken token by token), and its completion carries the version it started under, the oldest
that wrote any of it. A request that waited past max_off_policy_steps versions is cancelled and handed back to be
rescheduled (max_off_policy_steps=None: never; rl.staleness=prime_rl, where the orchestrator decides). A request the client
cancels leaves the queue, or, when it is running, its row leaves the batch at the next decode step (commands are
read between decode steps); nothing comes back for it.

On Linux the process is forked from the trainer's where that is safe (start_method): it starts with the trainer's
imports of torch and transformers instead of making its own, about 4 s of a start here.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections import deque

import torch

from recipe.inference.engine import Cancelled, Done, Event, Request
from recipe.inference.hf import DecodeBatch, HFEngine
from recipe.runs import PeriodicTrim


_live_pids: set[int] = set()  # the engine processes this process started and has not closed


def engine_pids() -> frozenset[int]:
    """The pids of the engine processes this process runs (`make soak` samples their memory as the engine's)."""
    return frozenset(_live_pids)


def start_method(threads: int) -> str:
    """fork where it is safe, else spawn. Forked, the engine starts without importing torch and transformers
    again (a bench-trl recipe arm took 27 and 30 s against 36 and 35 spawned: docs/performance.md). Safe here means
    Linux; one thread for the engine (a forked child must not run OpenMP regions with more threads, whose pool is
    the parent's; torch runs none with one thread, as in its DataLoader's forked workers); CUDA not initialised (a
    forked child cannot use it); and no process group (a rank's collective threads and sockets are not the
    engine's to hold)."""
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    if sys.platform == "linux" and threads == 1 and not torch.cuda.is_initialized() and not grouped:
        return "fork"
    return "spawn"


def _die_with_parent() -> None:
    """Linux: be killed when the parent dies, even by kill -9, so no orphan engine keeps a core busy."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def joining_now(engine: HFEngine, batch: DecodeBatch, pending: deque) -> list[Request]:
    """The waiting requests that join the running batch before its next decode step, taken off `pending`.

    A join costs a forward pass of its prompts, most of it fixed cost on the CPU (a prompt alone about as much as a
    decode step of 45 rows), so rows join together: only once the batch has room for a quarter of its size, or for
    every waiting request (HFEngine.should_admit), and then every one that fits, in order, while they share the
    batch's sampling settings. Joining as each row finished took a prefill for every 4 or 5 rows in the tiny RL
    stage (docs/performance.md)."""
    joining: list[Request] = []
    if engine.should_admit(len(batch), len(pending)):
        while pending and batch.accepts(pending[0].params) and len(batch) + len(joining) < engine.batch_size:
            joining.append(pending.popleft())
    return joining


def _worker(model_path, threads, batch_size, max_off_policy_steps, version, cpu, req_q, res_q):
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the stage stops at its next step and closes this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked: not the stage's handler, which only sets a flag
    parent = os.getppid()
    torch.set_num_threads(threads)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    try:
        engine = HFEngine.from_pretrained(model_path, batch_size=batch_size)
        engine.policy_version = version
    except Exception:
        res_q.put(("error", traceback.format_exc()))
        return
    res_q.put(("ready", version))
    pending: deque[Request] = deque()
    cancelled: set[int] = set()  # ids cancelled while their rows run
    batch: DecodeBatch | None = None
    busy = 0.0  # engine seconds not yet reported in a Done event
    trim = PeriodicTrim()

    def handle(msg) -> bool:
        """One command; False on stop."""
        nonlocal pending
        if msg[0] == "stop":
            return False
        if msg[0] == "generate":
            pending.extend(msg[1])
        elif msg[0] == "update":
            engine.update_weights(msg[1], msg[2])
            trim()  # the weights files read, now and then: RSS stays flat over a long run
            res_q.put(("updated", msg[2]))
        elif msg[0] == "cancel":
            drop = set(msg[1])
            pending = deque(r for r in pending if r.id not in drop)
            if batch is not None:
                cancelled.update(drop & set(batch.keys))
        return True

    while True:
        running = batch is not None and len(batch)
        try:  # wait for a command only when there is nothing to decode
            msg = req_q.get(timeout=0 if (running or pending) else 1.0)
        except queue.Empty:
            msg = None
        if msg is None and not running and not pending and os.getppid() != parent:
            return
        while msg is not None:
            if not handle(msg):
                return
            try:
                msg = req_q.get_nowait()
            except queue.Empty:
                msg = None
        stale = set() if max_off_policy_steps is None else \
            {r.id for r in pending if engine.policy_version - r.submitted_version > max_off_policy_steps}
        if stale:
            pending = deque(r for r in pending if r.id not in stale)
            res_q.put(Cancelled(sorted(stale)))
        t0 = time.perf_counter()
        try:
            if pending:
                if batch is None or not len(batch) and not batch.accepts(pending[0].params):
                    batch = DecodeBatch(engine, pending[0].params)
                joining = joining_now(engine, batch, pending)
                batch.admit([r.id for r in joining], [r.prompt_ids for r in joining], [r.params for r in joining])
            if batch is not None and len(batch):
                finished = batch.step(drop=cancelled)
                cancelled.intersection_update(batch.keys)
                busy += time.perf_counter() - t0
                if finished:
                    res_q.put(Done(finished, busy))
                    busy = 0.0
        except Exception:
            res_q.put(("error", traceback.format_exc()))
            return


class HFEngineProcess:
    """Client side of the engine process (the Engine contract)."""

    def __init__(self, model_path: str, threads: int = 1, batch_size: int = 64, max_off_policy_steps: int | None = 8,
                 version: int = 0, cpu: int | None = None, start_timeout: float = 300.0):
        method = start_method(threads)
        ctx = mp.get_context(method)
        self.req_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_worker, daemon=True, args=(
            str(model_path), threads, batch_size, max_off_policy_steps, version, cpu, self.req_q, self.res_q))
        if method == "fork":
            # what the parent holds now (its imports, the model) leaves the cyclic collector's reach, as Python's gc
            # docs advise before a fork: the child's collections then write into none of the parent's pages, and
            # the trainer's own full collections skip them (an arm's collections 0.2 s of CPU against 0.48 s). Unlike
            # recipe.runs.stage_main's freeze this one runs in any caller: garbage cycles pending at the fork are kept
            # (one engine a run; a full collection first would cost what the freeze saves)
            gc.freeze()
        self.proc.start()
        _live_pids.add(self.proc.pid)
        try:
            msg = self._next(timeout=start_timeout)
        except RuntimeError:  # it failed to start: it leaves no pid behind
            self.close()
            raise
        if not (isinstance(msg, tuple) and msg[0] == "ready"):
            self.close()
            raise RuntimeError("hf engine process failed to start: timed out")
        self.policy_version = version

    def submit(self, requests: list[Request]) -> None:
        self.req_q.put(("generate", requests))

    def cancel(self, request_ids: list[int]) -> None:
        self.req_q.put(("cancel", list(request_ids)))

    def update_weights(self, path, version: int) -> None:
        self.req_q.put(("update", str(path), version))
        self.policy_version = version

    def _next(self, timeout: float | None):
        """The next message from the process, or None after timeout. An engine that died or failed raises."""
        try:
            msg = self.res_q.get(timeout=timeout)
        except queue.Empty:
            if not self.proc.is_alive():
                raise RuntimeError(f"hf engine process died (exit code {self.proc.exitcode})") from None
            return None
        if isinstance(msg, tuple) and msg[0] == "error":
            raise RuntimeError(f"hf engine process failed:\n{msg[1]}")
        return msg

    def poll(self, timeout: float | None = None) -> Event | None:
        """The next Done or Cancelled event, or None after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self._next(left)
            if msg is None or isinstance(msg, (Done, Cancelled)):
                return msg
            # ("updated", version): the weights are in; nothing for the caller to do

    def close(self) -> None:
        if self.proc.is_alive():
            self.req_q.put(("stop",))
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
        _live_pids.discard(self.proc.pid)
