"""The hf engine in a process of its own, with its own CPU threads, so that generation overlaps training.

Protocol (two queues). In: ("generate", [Request]), ("update", weights_path, version), ("stop",).
Out: ("ready", version), ("done", [(request_id, Completion)], busy_seconds), ("updated", version),
("cancelled", [request_id]), ("error", message).

Requests run first in, first out, in batches. Weights are swapped between batches, while later requests wait:
each completion carries the policy version that wrote it. A request that waited past max_off_policy_steps
versions is cancelled and handed back to be rescheduled.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass

from recipe.inference import Completion, SamplingParams


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    submitted_version: int


def _die_with_parent() -> None:
    """Linux: be killed when the parent dies, even by kill -9, so no orphan engine keeps a core busy."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker(model_path, threads, batch_size, max_off_policy_steps, version, cpu, req_q, res_q):
    _die_with_parent()
    parent = os.getppid()
    import torch

    torch.set_num_threads(threads)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    try:
        from safetensors.torch import load_file

        from recipe.inference.hf import HFEngine

        engine = HFEngine.from_pretrained(model_path, batch_size=batch_size)
        engine.policy_version = version
    except Exception:
        res_q.put(("error", traceback.format_exc()))
        return
    res_q.put(("ready", version))
    pending: deque[Request] = deque()
    while True:
        try:
            msg = req_q.get(timeout=0 if pending else 1.0)
        except queue.Empty:
            msg = None
        if msg is None and os.getppid() != parent:
            return
        while msg is not None:
            if msg[0] == "stop":
                return
            if msg[0] == "generate":
                pending.extend(msg[1])
            elif msg[0] == "update":
                engine.update_weights(load_file(msg[1]), msg[2])
                res_q.put(("updated", msg[2]))
            try:
                msg = req_q.get_nowait()
            except queue.Empty:
                msg = None
        stale = [r.id for r in pending if engine.policy_version - r.submitted_version > max_off_policy_steps]
        if stale:
            pending = deque(r for r in pending if r.id not in set(stale))
            res_q.put(("cancelled", stale))
        if not pending:
            continue
        batch = [pending.popleft() for _ in range(min(batch_size, len(pending)))]
        t0 = time.perf_counter()
        try:
            params = batch[0].params
            outs = engine.generate([r.prompt_ids for r in batch], params)
        except Exception:
            res_q.put(("error", traceback.format_exc()))
            return
        res_q.put(("done", [(r.id, c) for r, c in zip(batch, outs)], time.perf_counter() - t0))


class HFEngineProcess:
    """Client side of the engine process."""

    def __init__(self, model_path: str, threads: int = 1, batch_size: int = 64, max_off_policy_steps: int = 8,
                 version: int = 0, cpu: int | None = None, start_timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.req_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_worker, daemon=True, args=(
            str(model_path), threads, batch_size, max_off_policy_steps, version, cpu, self.req_q, self.res_q))
        self.proc.start()
        event = self.poll(timeout=start_timeout)
        if not event or event[0] != "ready":
            self.close()
            raise RuntimeError(f"hf engine process failed to start: {event[1] if event else 'timed out'}")
        self.policy_version = version

    def submit(self, requests: list[Request]) -> None:
        self.req_q.put(("generate", requests))

    def update_weights(self, weights_path: str, version: int) -> None:
        self.req_q.put(("update", str(weights_path), version))
        self.policy_version = version

    def poll(self, timeout: float | None = None):
        """Next event from the engine, or None after timeout. An engine that died is an error."""
        try:
            event = self.res_q.get(timeout=timeout)
        except queue.Empty:
            if not self.proc.is_alive():
                raise RuntimeError(f"hf engine process died (exit code {self.proc.exitcode})") from None
            return None
        if event[0] == "error":
            raise RuntimeError(f"hf engine process failed:\n{event[1]}")
        return event

    def close(self) -> None:
        if self.proc.is_alive():
            self.req_q.put(("stop",))
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
