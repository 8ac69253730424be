"""Fewer torch threads while other processes keep this machine's cores busy.

torch's CPU operations split across their threads and wait for the slowest one at the end of each operation. When
another process keeps one of two cores busy, the thread that shares its core runs in the scheduler's slices, and
every small operation waits on it: a tiny-model training step with 2 threads took 1.53 s against 0.29 s on an
idle machine, while 1 thread took 0.47 s either way (docs/performance.md, "Sharing the machine"). ThreadGovernor
measures, every `interval_s`, how many of the process's cores the other processes keep busy (the machine's busy
time from /proc/stat less the CPU time of this process and its children) and sets torch's thread count to the
cores left, never more than the configured number. Where /proc/stat cannot be read (not Linux) it leaves the
threads as they are. Used by the processes that run torch on several threads of their own: base and SFT on CPU
(between steps) and the eval stage's in-process hf engine (between chunks of problems); not by the RL stage, whose
trainer and engine run one thread each, pinned to a core each.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass


SLACK = 0.25  # cores: others this busy or less still leave a thread its core (a shell, a logger, the kernel)


def own_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_seconds(cores: list[int], stat_text: str | None = None) -> float | None:
    """Seconds these cores have spent busy since boot (every state but idle and iowait), from /proc/stat; None
    where it cannot be read or lacks one of them."""
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.read()
        except OSError:
            return None
    wanted = {f"cpu{c}" for c in cores}
    ticks, seen = 0, set()
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = [int(v) for v in rest.split()]
            # user nice system idle iowait irq softirq steal (guest time is counted in user already)
            ticks += sum(fields[:8]) - fields[3] - fields[4]
            seen.add(name)
    if seen != wanted:
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process (every thread) and of its children that have ended (the eval stage's sandboxed
    programs): neither is another process's load. Warm sandboxes stay up between runs: their CPU comes from
    tree_cpu_s (recipe.sandbox.warm.cpu_s)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds of the running processes `roots` and all their running descendants, each with the children it
    has reaped (/proc; 0 without it): os.times counts a child only once this process has reaped it."""
    kids: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0.0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            kids.setdefault(int(fields[1]), []).append(int(name))
            ticks[int(name)] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += kids.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    wall_s: float   # time.monotonic()
    busy_s: float   # busy_seconds of the cores
    own_s: float    # own_cpu_s()


def threads_for(others_busy: float, cores: int, most: int) -> int:
    """The threads to run when other processes keep `others_busy` of `cores` cores busy: one a core they leave,
    at least 1, at most `most`."""
    return max(1, min(most, math.floor(cores - others_busy + SLACK)))


class ThreadGovernor:
    """Call step() often (every training step); every interval_s it sets torch's threads from the load since the
    last sample. `changes`: (threads, others' busy cores) of every change so far."""

    def __init__(self, most: int, interval_s: float = 5.0, cores: list[int] | None = None, read_busy=busy_seconds,
                 own_cpu=own_cpu_s, clock=time.monotonic, set_threads=None):
        if set_threads is None:  # torch imported here: the sandbox imports this module, the data stage the sandbox
            import torch

            set_threads = torch.set_num_threads
        self.most, self.interval_s = most, interval_s
        self.cores = cores if cores is not None else own_cores()
        self.read_busy, self.own_cpu, self.clock, self.set_threads = read_busy, own_cpu, clock, set_threads
        self.threads = most
        self.others_busy: float | None = None
        self.changes: list[tuple[int, float]] = []
        self.last = self._sample()

    def _sample(self) -> Sample | None:
        busy = self.read_busy(self.cores)
        return None if busy is None else Sample(self.clock(), busy, self.own_cpu())

    def describe(self) -> str:
        """The stage's line for a change: the threads and why."""
        return (f"{self.threads} torch thread{'s' if self.threads > 1 else ''}, other processes keeping "
                f"{self.others_busy:.1f} of {len(self.cores)} cores busy")

    def step(self) -> int | None:
        """The new thread count when it changed, else None."""
        if self.last is None or self.clock() - self.last.wall_s < self.interval_s:
            return None
        now = self._sample()
        if now is None:
            self.last = None  # /proc/stat went away: leave the threads as they are from now on
            return None
        wall = now.wall_s - self.last.wall_s
        self.others_busy = max(0.0, (now.busy_s - self.last.busy_s) - (now.own_s - self.last.own_s)) / wall
        self.last = now
        threads = threads_for(self.others_busy, len(self.cores), self.most)
        if threads == self.threads:
            return None
        self.threads = threads
        self.set_threads(threads)
        self.changes.append((threads, round(self.others_busy, 2)))
        return threads
