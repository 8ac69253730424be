"""Warm sandboxes: a bwrap sandbox that stays up between runs, whose Python forks a fresh process for each.

A cold run (runner.execute) starts a shell that joins the run's cgroup, setpriv, bwrap and an interpreter: about
17 ms of CPU a run here, half of it the interpreter's start, and the RL verifier runs about 20 programs a step. A
warm sandbox pays that once: its server (_inside.py `_serve`) forks a child for each run, which sets the run's
rlimits, reports "started" and runs the program exactly as a cold run's harness does.

What each run still has of its own: a fresh interpreter state (a fork of a server that never ran a program), its
rlimits, stdin, stdout, stderr and control pipe. Before the server answers, it has killed every other process of
the sandbox's pid namespace (kill(-1) from inside: however the program daemonized, nothing of it runs on into the
next run) and emptied /tmp and /dev/shm; if it cannot, the host ends the sandbox. What the runs of one sandbox
share, one after the other: its uid (a private one as root), its namespaces, its memory cgroup (the run's limit
plus SERVER_MB for the server) and its read-only root. The seccomp filter denies what would outlive a process
there (SysV message queues and semaphores, POSIX message queues, as it denies SysV shared memory). A program can
kill the server; that ends the sandbox, and since the run had already started, the verdict is the program's
("killed"), never a sandbox failure. A timeout, a server that dies or an answer out of protocol also end it; the
next run starts a new one. One difference a program can see: what its leftover processes write after it exits is
not waited for (a cold run's host reads on for EXIT_GRACE_S), they are killed when it exits.

Used for the bwrap backend where bwrap can make / read-only and size its tmpfs; RECIPE_SANDBOX_WARM=0 turns it
off. The sandboxes are started from one long-lived thread: bwrap's --die-with-parent follows the thread that
started it, and scoring threads come and go. That thread starts each on the cores its runs are for (the key's, as
a cold run would have them: runner.warm_key), and a server that exits before it is ready sends the run cold at once.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from recipe.cores import tree_cpu_s
from recipe.sandbox.cgroup import Cgroup

SERVER_MB = 32  # the server's own memory, added to a run's cgroup limit
READY_S = 30.0  # a busy host is no failure
MAX_IDLE = 8  # idle sandboxes kept for one kind of run (the scoring threads use 4 at once)
SWITCH = "RECIPE_SANDBOX_WARM"


class WarmStartError(OSError):
    """A warm sandbox did not come up; the run goes cold."""


class WarmSandbox:
    def __init__(self, key: tuple, proc: subprocess.Popen, sock: socket.socket, cgroup: Cgroup | None,
                 uid: int | None, release):
        self.key, self.proc, self.sock, self.cgroup, self.uid = key, proc, sock, cgroup, uid
        self.release = release  # after the last process: the cgroup removed, the uid given back
        self.buffer = bytearray()

    def submit(self, payload: bytes, fds: list[int]) -> None:
        """Start a run: its payload (marshal of [mode, payload]) and its stdin, stdout, stderr and control pipe."""
        data = len(payload).to_bytes(8, "little") + payload
        sent = socket.send_fds(self.sock, [data], fds)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def read_reply(self) -> dict | None:
        """After the socket said readable: the server's answer once it is whole, else None. EOFError when the
        server has gone (the run's program may have killed it)."""
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        line, _, rest = bytes(self.buffer).partition(b"\n")
        if rest:
            raise EOFError  # more than one answer to one run: out of protocol
        self.buffer.clear()
        reply = json.loads(line)
        if not isinstance(reply, dict) or not isinstance(reply.get("status"), int):
            raise EOFError
        return reply

    def close(self) -> None:
        """End the sandbox and every process in it."""
        with _pool_lock:
            _live.discard(self)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup:
            self.cgroup.kill_all()
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stderr:
            self.proc.stderr.close()
        self.release()


_pool_lock = threading.Lock()
_idle: dict[tuple, list[WarmSandbox]] = {}
_live: set[WarmSandbox] = set()  # started and not yet closed, idle or running a program
_starter: ThreadPoolExecutor | None = None
_disabled: str | None = None  # why warm sandboxes are off in this process


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0" and _disabled is None


def take(key: tuple, start) -> WarmSandbox:
    """An idle sandbox of this kind, or a new one from start() (run in the starter thread)."""
    global _starter
    gone = []
    with _pool_lock:
        idle = _idle.get(key) or []
        while idle and idle[-1].proc.poll() is not None:  # ended while idle (killed from outside)
            gone.append(idle.pop())
        box = idle.pop() if idle else None
        if box is None and _starter is None:
            _starter = ThreadPoolExecutor(1, thread_name_prefix="sandbox-starter")
        starter = _starter
    for dead in gone:
        dead.close()
    return box if box is not None else starter.submit(start).result()


def give_back(box: WarmSandbox) -> None:
    with _pool_lock:
        idle = _idle.setdefault(box.key, [])
        if len(idle) < MAX_IDLE:
            idle.append(box)
            return
    box.close()


def disable(why: str) -> None:
    """No more warm sandboxes in this process (one note): runs go cold."""
    global _disabled
    if _disabled is None:
        _disabled = why
        print(f"note: sandbox: warm sandboxes are off ({why}); every run starts its own", file=sys.stderr)


def cpu_s() -> float:
    """CPU seconds the live warm sandboxes and their runs have used (recipe.cores.tree_cpu_s): this process's own
    work, which os.times counts only once a sandbox has ended."""
    with _pool_lock:
        roots = [b.proc.pid for b in _live]
    return tree_cpu_s(roots)


def close_all() -> None:
    with _pool_lock:
        boxes = [b for idle in _idle.values() for b in idle]
        _idle.clear()
    for box in boxes:
        box.close()


def _forget_in_child() -> None:
    # a forked child must not use (or end) its parent's sandboxes
    global _starter
    _idle.clear()
    _live.clear()
    _starter = None


atexit.register(close_all)
os.register_at_fork(after_in_child=_forget_in_child)


def _answered(sock: socket.socket, proc: subprocess.Popen) -> bool:
    """Whether the server wrote to sock within READY_S. A server that exits first (bwrap cannot start its
    interpreter, say) gives no end of file, as this process holds the socket's other end until the start returns:
    its exit is watched, so the run goes cold at once, not READY_S later."""
    deadline = time.monotonic() + READY_S
    while True:
        left = deadline - time.monotonic()
        if select.select([sock], [], [], max(0.0, min(left, 0.05)))[0]:
            return True
        if left <= 0 or proc.poll() is not None:
            return bool(select.select([sock], [], [], 0)[0])  # it may have answered just before it went


def start(key: tuple, cmd: list[str], env: dict, pass_fds: list[int], sock: socket.socket,
          cgroup: Cgroup | None, uid: int | None, release) -> WarmSandbox:
    """Start the server (cmd) and wait for its "ready"; WarmStartError if it does not say it."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, pass_fds=pass_fds, start_new_session=True)
    box = WarmSandbox(key, proc, sock, cgroup, uid, release)
    with _pool_lock:
        _live.add(box)
    try:
        line = sock.recv(1 << 10) if _answered(sock, proc) else b""
        if line.strip() != b'{"ready": true}':
            raise WarmStartError("no answer" if not line else f"said {line[:80]!r}")
    except (OSError, WarmStartError) as e:
        try:
            proc.kill()
            err = proc.communicate(timeout=10)[1].decode("utf-8", "replace").strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            err = []
        box.close()
        raise WarmStartError(f"{e}{': ' + err[-1][:200] if err else ''}") from None
    proc.stderr.close()
    proc.stderr = None
    return box
