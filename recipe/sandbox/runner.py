"""One sandboxed run of untrusted Python: isolation, limits, bounded output, and an honest verdict.

Backends, picked once per process by `backend()`:
- "bwrap" (bubblewrap) and "unshare" (util-linux unshare, when bwrap is missing or broken) isolate alike: user,
  pid, net, ipc, uts, cgroup and mount namespaces; a fresh root holding only a read-only /usr (plus the
  interpreter's own prefix), a fresh /proc, a minimal read-only /dev, and size-capped tmpfs at /tmp (4x file_mb;
  cwd and HOME) and /dev/shm (1x file_mb) as the only writable places. The repository, runs/ (hidden tests),
  /root and the host's /tmp are not there at all, and nothing is left on the host to clean up. The program runs
  as uid nobody of a namespace of its own, without capabilities; its processes die with the run's pid
  namespace, whatever they do (setsid, double fork, an empty environment). No network: an empty net namespace.
  "unshare" builds that root itself (_inside.py, as root of the new user namespace) before the program starts.
  Under bwrap, runs go to warm sandboxes (warm.py) where this bwrap can make / read-only and size its tmpfs: a
  sandbox kept up between runs whose server forks a fresh process for each, one run at a time, and before the
  next kills every process the run left and empties /tmp and /dev/shm (RECIPE_SANDBOX_WARM=0: a sandbox a run).
- "rlimit": no namespaces, only the limits, the filter and, as root, a private uid. It can read whatever its
  uid may (the repository and runs/ are usually world-readable), so it never starts by itself: it needs
  RECIPE_SANDBOX_UNISOLATED=1, and then says so loudly. Its folder is removed without following any link the
  program may have planted; as root, every process of its uid is killed and its files in /tmp, /var/tmp and
  /dev/shm removed; without root, processes are found by session and an environment token (not watertight).

On every backend:
- As root, each run (each warm sandbox, whose runs come one after another) has a private uid (random, high
  range): sibling runs cannot signal, trace or read each other, and RLIMIT_NPROC counts exactly the run's own
  processes and the sandbox's. Without root, the caller's uid.
- rlimits (CPU, address space, processes, file size, open files, no core files), set by the harness
  (_inside.py) on itself once it has read its payload, before any of the program is compiled or run; a limit
  that cannot be set stops the run as a sandbox failure. The sandbox's own processes (bwrap's) do not run under
  them.
- A seccomp filter (seccomp.py: x86_64 and aarch64) denies ptrace, namespaces and mounts, memfd_create, SysV
  IPC and POSIX message queues, sched_setaffinity (CPU affinity cannot be widened), io_uring, bpf, keyrings,
  kernel modules, the clock, and every socket but AF_UNIX.
- Memory: RLIMIT_AS per process. What it does not count is bounded too: memfd and SysV shared memory are
  denied, and under the namespaced backends /tmp and /dev/shm are size-capped tmpfs (under "rlimit" the host's
  /dev/shm is bounded only per file, by RLIMIT_FSIZE, and by the cgroup). Where a memory cgroup can be made
  (cgroup.py), the run's processes together are held to 2x memory_mb + 5x file_mb (a warm sandbox's: that and
  its server's warm.SERVER_MB), shared memory and tmpfs included; an OOM kill there is a "memory" verdict, and
  the cgroup is one more way every process is killed.
- Deadlines are fixed when they start: the run's at start (wall_s); in a functional run each case's when the
  harness begins it (step_s), and never past `until`, which the caller fixes for the whole group of cases.
  Messages on the control channel (the program can write there too) never move a deadline later.
- stdout and stderr read as they come and cut at a bound.

Set RECIPE_SANDBOX=bwrap or =unshare to force a backend (an error if it does not work here); =rlimit, the older
name for "not bubblewrap", now means the unshare fallback, or the rlimit backend where only it can run.
"""
from __future__ import annotations

import json
import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from recipe.errors import SandboxError
from recipe.sandbox import seccomp, unisolated, warm
from recipe.sandbox.cgroup import Cgroup

NOBODY = 65534
PRIVATE_UIDS = (2_100_000_000, 1 << 24)  # first uid and count of the range private uids are drawn from
SANDBOX_PROCS = 4  # the sandbox's own processes (bwrap's two, unshare and its pid 1), under the run's uid
MARSHAL_VERSION = 2  # the payload's format (host to sandbox only): every Python 3 reads it
CONTROL_BYTES = 1 << 20  # the host's side channel from the harness (function results), bounded like output
EXIT_GRACE_S = 0.5  # after the program exits, how long leftover children may keep its pipes open
STEP_GRACE_S = 0.5  # functional tests: slack over a case's wall limit before the host kills the process
INSIDE = (Path(__file__).with_name("_inside.py")).read_text()
# Starts the harness from its code object, compiled once by the sandbox's interpreter (argv[4]: a memfd of it):
# compiling _inside.py cost about 2 ms of every run.
BOOT = ("import marshal, os, sys\nfd, parts = int(sys.argv[4]), []\nwhile True:\n    part = os.read(fd, 1 << 20)\n"
        "    if not part:\n        break\n    parts.append(part)\nos.close(fd)\nexec(marshal.loads(b''.join(parts)))\n")
COMPILE = ("import marshal, sys\n"
           "sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.buffer.read(), '<sandbox harness>', 'exec')))\n")
PATH = "/usr/local/bin:/usr/bin:/bin"
# -S: no site, so no .pth file of the host's Python runs code before the harness (about a quarter of an
# interpreter's start here) and a program sees the standard library only, whatever the host has installed;
# the harness gives it exit() and quit(), which site would have. -B: no .pyc files written.
PYTHON_FLAGS = ("-S", "-B")
UNISOLATED_OPT_IN = "RECIPE_SANDBOX_UNISOLATED"


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 2.0          # RLIMIT_CPU (whole seconds, rounded up)
    wall_s: float = 5.0         # the whole run is killed after this
    memory_mb: int = 256        # RLIMIT_AS; the run's memory cgroup, where there is one, holds 2x this + 5x file_mb
    max_procs: int = 32         # RLIMIT_NPROC: the run's own processes and threads
    file_mb: int = 8            # RLIMIT_FSIZE; the tmpfs at /tmp holds 4x this in all, /dev/shm 1x
    open_files: int = 64        # RLIMIT_NOFILE
    output_bytes: int = 65536   # stdout and stderr each cut at this bound


@dataclass
class RunResult:
    status: str          # "ok" | "error" | "timeout" | "memory" | "killed" | "sandbox_error"
    returncode: int | None  # -N when killed by signal N; None on timeout or sandbox error
    stdout: str
    stderr: str
    truncated: bool
    wall_s: float
    reason: str

    @property
    def sandbox_failed(self) -> bool:
        """The sandbox failed, not the program: the sample is masked, not scored 0."""
        return self.status == "sandbox_error"


# ---------------------------------------------------------------------------------------------- backend choice

_choice_lock = threading.Lock()  # held while probing, which runs sandboxes: not the lock those take
_lock = threading.Lock()
_backend: str | None = None


def backend() -> str:
    """ "bwrap" when bubblewrap starts a sandbox here, else "unshare" (one note on stderr), else "rlimit" if the
    user opted in (one loud warning), else SandboxError."""
    global _backend
    with _choice_lock:
        if _backend is None:
            _backend = _choose(os.environ.get("RECIPE_SANDBOX", ""))
        return _backend


def _choose(forced: str) -> str:
    if forced not in ("", "bwrap", "unshare", "rlimit"):
        raise SandboxError(f"RECIPE_SANDBOX={forced!r}: expected 'bwrap', 'unshare' or 'rlimit'")
    why = {}
    for use in ("bwrap", "unshare"):
        if forced in ("", use) or (forced == "rlimit" and use == "unshare"):
            why[use] = _probe(use)
            if why[use] is None:
                if use == "unshare" and "bwrap" in why:
                    print(f"note: sandbox: bubblewrap unusable ({why['bwrap']}); model-written code runs in "
                          "namespaces made with util-linux unshare instead", file=sys.stderr)
                return use
            if forced == use:
                raise SandboxError(f"RECIPE_SANDBOX={use} but it cannot start a sandbox here: {why[use]}")
    tried = "; ".join(f"{k}: {v}" for k, v in why.items())
    if os.environ.get(UNISOLATED_OPT_IN) != "1":
        raise SandboxError(f"sandbox: no isolating sandbox works here ({tried}); install bubblewrap "
                           f"(apt-get install bubblewrap) or allow user namespaces, or set {UNISOLATED_OPT_IN}=1 "
                           "to run model-written code without isolation (it can then read the hidden tests)")
    print(f"WARNING: sandbox: {UNISOLATED_OPT_IN}=1: model-written code runs WITHOUT ISOLATION ({tried}); it "
          "can read this repository and runs/ (hidden tests), and every file its uid may. Do not trust rewards "
          "or scores from this run.", file=sys.stderr)
    return "rlimit"


def _probe(use: str) -> str | None:
    """None when a real sandbox of this kind runs a program here, else why not."""
    tools = [use] + (["setpriv"] if os.geteuid() == 0 else [])
    missing = [t for t in tools if shutil.which(t, path=PATH) is None]  # found as the sandbox's command is
    if missing:
        return f"{', '.join(missing)} not found"
    if use == "unshare" and seccomp.machine() not in seccomp.PIVOT_ROOT:
        return f"no system call numbers for {seccomp.machine()}"
    res, _ = execute({"code": "print('ok')"}, "", Limits(wall_s=30), "script", use=use)  # a busy host is no failure
    if res.status == "ok" and res.stdout.strip() == "ok":
        return None
    return f"{res.status}: {res.reason}"


_features: set | None = None


def _bwrap_features() -> set:
    """Options that came with later bwrap versions, used only where this one has them."""
    global _features
    if _features is None:
        try:
            text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        _features = {opt for opt in ("--disable-userns", "--size", "--perms", "--remount-ro") if opt in text}
    return _features


# ------------------------------------------------------------------------------------------------ private uids

_uids_in_use: set[int] = set()


def _take_uid() -> int | None:
    """A uid of the run's own (root only); None: the caller's."""
    if os.geteuid() != 0:
        return None
    with _lock:
        while True:
            uid = PRIVATE_UIDS[0] + secrets.randbelow(PRIVATE_UIDS[1])
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _release_uid(uid: int | None) -> None:
    with _lock:
        _uids_in_use.discard(uid)


def _tasks_of(uid: int) -> int:
    """Tasks (threads count) the uid runs now: RLIMIT_NPROC counts them all."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return n


def _usable_by_others(path: str) -> bool:
    """Can another uid execute this file (every folder above searchable, the file readable and executable)?"""
    try:
        p = Path(path)
        if p.stat().st_mode & 0o005 != 0o005:
            return False
        return all(d.stat().st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


_interp: str | None = None


def interpreter() -> str:
    """The Python the sandbox runs: this one's base interpreter (no venv packages), or a system python3 when a
    private uid cannot reach this one (e.g. a pyenv or uv Python under /root)."""
    global _interp
    if _interp is None:
        own = os.path.realpath(sys.executable)
        system = shutil.which("python3", path=PATH)
        candidates = [own] + ([os.path.realpath(system)] if system else [])
        usable = [c for c in candidates if os.geteuid() != 0 or _usable_by_others(c)]
        _interp = (usable or candidates)[0]
    return _interp


_harness_codes: dict[str, bytes | None] = {}
_code_lock = threading.Lock()


def _harness_code(exe: str) -> bytes | None:
    """_inside.py compiled and marshalled by `exe` itself (a code object only loads in the Python that made it),
    once per interpreter; None, and the source is compiled each run, where that fails."""
    with _code_lock:
        if exe not in _harness_codes:
            try:
                out = subprocess.run([exe, *PYTHON_FLAGS, "-c", COMPILE], input=INSIDE.encode(), capture_output=True,
                                     timeout=30, env={"PATH": PATH})
                _harness_codes[exe] = out.stdout if out.returncode == 0 and out.stdout else None
            except (OSError, subprocess.SubprocessError):
                _harness_codes[exe] = None
        return _harness_codes[exe]


# ------------------------------------------------------------------------------------------------ the command

def _rlimits(limits: Limits, cpu_s: float, uid: int | None) -> dict[str, tuple[int, int]]:
    cpu = max(1, math.ceil(cpu_s))
    one = lambda v: (v, v)  # noqa: E731
    # a private uid runs nothing else; the caller's own uid counts what it runs already
    procs = limits.max_procs + SANDBOX_PROCS + (0 if uid is not None else _tasks_of(os.getuid()))
    return {"cpu": (cpu, cpu + 1), "as": one(limits.memory_mb << 20), "nproc": one(procs),
            "fsize": one(limits.file_mb << 20), "nofile": one(limits.open_files), "core": one(0)}


_RUN_ON_CORES: set[int] | None = None  # set by run_on_cores()


def run_on_cores(cores) -> None:
    """Run programs on these cores, whatever the caller's own affinity. The RL trainer pins itself to one core
    and scores rollouts on it: its programs would be pinned there too and slow its own training step."""
    global _RUN_ON_CORES
    _RUN_ON_CORES = set(cores) if cores else None


class _OnCores:
    """Around starting a run: this thread's CPU affinity widened to run_on_cores' cores, and then put back. Linux
    keeps an affinity per thread and a new process takes its creating thread's, so the run starts there without a
    taskset process (about a millisecond of CPU a run) and the caller's other threads keep theirs. A warm sandbox
    starts in the starter thread, on the cores of its key."""

    def __init__(self, cores: set[int] | None = None):
        self.cores = cores

    def __enter__(self):
        self.old, cores = None, self.cores if self.cores is not None else _RUN_ON_CORES
        if cores is not None and hasattr(os, "sched_setaffinity"):
            mine = os.sched_getaffinity(0)  # 0: the calling thread
            if mine != cores:
                os.sched_setaffinity(0, cores)
                self.old = mine

    def __exit__(self, *exc):
        if self.old is not None:
            os.sched_setaffinity(0, self.old)


def _layout(limits: Limits, exe: str) -> list[list]:
    """The sandbox's file system, in order: what bwrap's options say and what _inside.py builds for unshare."""
    ops: list[list] = [["bind", "/usr"]]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            ops.append(["link", os.readlink(top), top])
        elif os.path.isdir(top):
            ops.append(["bind", top])
    ops += [["bind", f] for f in ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group")
            if os.path.isfile(f)]
    ops += [["proc", "/proc"], ["dev", "/dev"], ["tmpfs", "/dev/shm", limits.file_mb << 20], ["ro", "/dev"],
            ["tmpfs", "/tmp", 4 * limits.file_mb << 20]]
    prefix = str(Path(exe).parent.parent)
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        ops.append(["bind", prefix])  # after /tmp: the prefix may live below it
    return ops


def _bwrap(layout: list[list], seccomp_fd: int | None) -> list[str]:
    feats = _bwrap_features()
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--uid", str(NOBODY), "--gid",
           str(NOBODY), "--hostname", "sandbox", "--cap-drop", "ALL"]
    if "--disable-userns" in feats:
        cmd.append("--disable-userns")  # no nested namespaces from inside (the filter denies them too)
    for kind, path, *arg in layout:
        if kind == "bind":
            cmd += ["--ro-bind", path, path]
        elif kind == "link":
            cmd += ["--symlink", path, arg[0]]
        elif kind in ("proc", "dev"):
            cmd += [f"--{kind}", path]
        elif kind == "tmpfs":
            if "--size" in feats:
                cmd += ["--size", str(arg[0])]
            if "--perms" in feats:
                cmd += ["--perms", "1777"]
            cmd += ["--tmpfs", path]
        elif kind == "ro" and "--remount-ro" in feats:
            cmd += ["--remount-ro", path]
    if "--remount-ro" in feats:
        cmd += ["--remount-ro", "/"]  # bwrap's root is a tmpfs without a size: read-only, as _inside.py makes it
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    return cmd + ["--chdir", "/tmp", "--"]


UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--kill-child", "--net", "--ipc", "--uts", "--mount",
           "--cgroup", "--"]


# ------------------------------------------------------------------------------------------------- execution

def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _exited(pid: int) -> bool:
    """Has the child exited? Leaves it unreaped, so its pid (our process group id) cannot be reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Stream:
    def __init__(self, cap: int):
        self.cap, self.data, self.truncated = cap, bytearray(), False

    def feed(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        self.data += chunk[:max(room, 0)]


_filter: bytes | None = None


def _seccomp_filter() -> bytes | None:
    global _filter
    if _filter is None:
        _filter = seccomp.filter_bytes() or b""
    return _filter or None


def _run_env(token: str) -> dict:
    return {"PATH": PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "RECIPE_SANDBOX_RUN": token,
            "HOME": "/tmp", "TMPDIR": "/tmp"}


def execute(payload: dict, stdin: str, limits: Limits, mode: str, use: str | None = None,
            step_s: float | None = None, cpu_s: float | None = None, until: float | None = None,
            ) -> tuple[RunResult, list[dict]]:
    """Run the payload's code once. Returns the verdict and the control messages of the inside harness.

    Functional tests (mode "fn", step_s set): the program's import, and then each case from the moment the
    harness begins it, has step_s; the whole run never goes past `until` (time.monotonic()), which the caller
    fixes once for all the runs of a group of cases. Only the harness's first "started" and its "begin" of the
    case due next start a step; nothing the program writes moves a deadline later than that.
    """
    use = use or backend()
    cpu_s = limits.cpu_s if cpu_s is None else cpu_s
    payload = dict(payload)
    if "cases" in payload:  # a function gets JSON's values (lists, string keys), as the tests' files give them
        payload["cases"] = json.loads(json.dumps(payload["cases"]))
    if use == "bwrap" and warm_usable():
        try:
            return _execute_warm(payload, stdin, limits, mode, step_s, cpu_s, until)
        except warm.WarmStartError as e:
            warm.disable(str(e))
    exe = interpreter()
    filt = _seccomp_filter()
    token = uuid.uuid4().hex
    env = _run_env(token)
    start = time.monotonic()
    uid = _take_uid()
    opened: list[int] = []
    workdir = cgroup = proc = None
    try:
        cgroup = Cgroup.make((2 * limits.memory_mb + 5 * limits.file_mb) << 20)
        cwd = None
        if use == "bwrap":
            if filt:
                opened.append(_memfd("sandbox-seccomp", filt))
            sandbox = _bwrap(_layout(limits, exe), opened[-1] if filt else None)
        elif use == "unshare":
            sandbox = UNSHARE
            payload["setup"] = {"layout": _layout(limits, exe), "pivot_root": seccomp.PIVOT_ROOT[seccomp.machine()],
                                "at": "/tmp"}  # a folder every host has, to build the new root on
        else:
            sandbox = []
            workdir = unisolated.Workdir(uid)
            cwd = workdir.home
            env.update(HOME=workdir.home, TMPDIR=workdir.home)
        if filt and use != "bwrap":
            payload["seccomp"] = filt.hex()
        payload["rlimits"] = _rlimit_list(limits, cpu_s, uid)
        ctl_r, ctl_w = os.pipe()
        opened += [ctl_r, ctl_w]
        src = _memfd("sandbox-payload", marshal.dumps(payload, MARSHAL_VERSION))
        opened.append(src)
        stdin_fd = _memfd("sandbox-stdin", stdin.encode()) if stdin else subprocess.DEVNULL
        if stdin:
            opened.append(stdin_fd)
        cmd = cgroup.join() if cgroup else []
        if uid is not None:
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        cmd += sandbox + [exe, *PYTHON_FLAGS, "-c"] + _harness_args(exe, [mode, str(ctl_w), str(src)], opened)
        with _OnCores():
            proc = subprocess.Popen(cmd, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                    env=env, pass_fds=[fd for fd in opened if fd != ctl_r], start_new_session=True)
    except OSError as e:
        for fd in opened:
            os.close(fd)
        _finish(use, uid, exe, cgroup, workdir)
        return RunResult("sandbox_error", None, "", "", False, time.monotonic() - start,
                         f"sandbox failed to start ({use}): {e}"), []
    for fd in opened:
        if fd != ctl_r:
            os.close(fd)

    run = _Watch(limits, start, step_s, until, payload, proc.stdout.fileno(), proc.stderr.fileno(), ctl_r)
    try:
        run.watch(exited=lambda: _exited(proc.pid), after_exit=lambda: _killpg(proc.pid))
    finally:  # also on an exception here (KeyboardInterrupt): nothing of the program outlives the call
        run.sel.close()
        _killpg(proc.pid)
        if cgroup:
            cgroup.kill_all()
        if use == "rlimit" and uid is None:  # before reaping: until then no other process can take the session id
            unisolated.kill_escaped(token, proc.pid, os.getuid())
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(ctl_r)
        oom = cgroup.oom_kills() if cgroup else 0
        _finish(use, uid, exe, cgroup, workdir)
    return run.result(proc.returncode, usage.ru_utime + usage.ru_stime, limits, cpu_s, use, wall, oom)


def _rlimit_list(limits: Limits, cpu_s: float, uid: int | None) -> list[list]:
    return [[f"RLIMIT_{k.upper()}", soft, hard] for k, (soft, hard) in _rlimits(limits, cpu_s, uid).items()]


def _harness_args(exe: str, args: list[str], opened: list[int]) -> list[str]:
    """What follows `python -c`: the harness's source and its arguments, or BOOT with the harness's code object
    in a memfd (appended to opened) as its last argument."""
    code = _harness_code(exe)
    if code is None:
        return [INSIDE, *args]
    opened.append(_memfd("sandbox-harness", code))
    return [BOOT, *args, str(opened[-1])]


class _Watch:
    """A run seen from the host: its stdout, stderr and control pipe read as they come (bounded), its deadlines,
    the harness's messages; then its verdict."""

    def __init__(self, limits: Limits, start: float, step_s: float | None, until: float | None, payload: dict,
                 out_fd: int, err_fd: int, ctl_fd: int):
        self.out, self.err, self.ctl = (_Stream(limits.output_bytes), _Stream(limits.output_bytes),
                                        _Stream(CONTROL_BYTES))
        self.streams = {out_fd: self.out, err_fd: self.err, ctl_fd: self.ctl}
        self.ctl_fd, self.step_s = ctl_fd, step_s
        self.sel = selectors.DefaultSelector()
        for fd in self.streams:
            self.sel.register(fd, selectors.EVENT_READ)
        self.ceiling = math.inf if until is None else until
        self.deadline = min(self.ceiling, start + limits.wall_s)  # the sandbox's start and, for a script, the run
        self.due = [c[0] for c in payload.get("cases", [])]
        self.messages: list[dict] = []
        self.timed_out = False

    def watch(self, exited, after_exit=None, other: dict | None = None) -> None:
        """Until the run has exited (exited() true) and its pipes closed or EXIT_GRACE_S passed, or the deadline.
        after_exit: called once it has exited. other: {fd: callback} read here too; a callback returns True when
        the run has exited."""
        for fd in other or {}:
            self.sel.register(fd, selectors.EVENT_READ)
        up, begun = False, 0  # the harness said "started"; cases it began
        line, exited_at = bytearray(), None
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                self.timed_out = True
                return
            if exited_at is None and exited():
                exited_at = now
                if after_exit:
                    after_exit()  # children still holding the pipes go with it
            if exited_at is not None and (not self.sel.get_map() or now - exited_at > EXIT_GRACE_S):
                return
            if not self.sel.get_map():  # it closed its output but runs on: its verdict waits for its end
                time.sleep(min(self.deadline - now, 0.02))
                continue
            for key, _ in self.sel.select(timeout=min(self.deadline - now, 0.1)):
                if other and key.fd in other:
                    if other[key.fd]():
                        self.sel.unregister(key.fd)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    self.sel.unregister(key.fd)
                    continue
                self.streams[key.fd].feed(chunk)
                if key.fd != self.ctl_fd or self.ctl.truncated:
                    continue
                line += chunk
                nl = line.find(b"\n", len(line) - len(chunk))
                while nl != -1:
                    msg = _parse(bytes(line[:nl]))
                    del line[:nl + 1]
                    if msg is not None:
                        self.messages.append(msg)
                        if self.step_s is not None and _starts_step(msg, up, self.due, begun):
                            self.deadline = min(self.ceiling, time.monotonic() + self.step_s)
                            begun, up = begun + up, True
                    nl = line.find(b"\n")

    def result(self, returncode: int, cpu_used: float, limits: Limits, cpu_s: float, use: str, wall: float,
               oom: int) -> tuple[RunResult, list[dict]]:
        stdout = self.out.data.decode("utf-8", "replace")
        stderr = self.err.data.decode("utf-8", "replace")
        started = any(m.get("started") for m in self.messages)
        status, code, reason = _verdict(started, self.timed_out, returncode, cpu_used, stderr, limits, cpu_s, use,
                                        wall, oom)
        return (RunResult(status, code, stdout, stderr, self.out.truncated or self.err.truncated, wall, reason),
                self.messages)


def warm_usable() -> bool:
    """Warm sandboxes are on and this bwrap can host them (a read-only / and sized tmpfs)."""
    return warm.enabled() and {"--remount-ro", "--size"} <= _bwrap_features()


class WarmKey(NamedTuple):
    """Runs that may share a warm sandbox: the same interpreter, memory and file limits, and cores."""
    interpreter: str
    memory_mb: int
    file_mb: int
    cores: frozenset  # empty where affinity is unknown


def warm_key(limits: Limits) -> WarmKey:
    """The cores are run_on_cores', or else the calling thread's, which a cold run inherits: a warm sandbox's runs
    keep the cores it started on."""
    cores = _RUN_ON_CORES
    if cores is None and hasattr(os, "sched_getaffinity"):
        cores = os.sched_getaffinity(0)
    return WarmKey(interpreter(), limits.memory_mb, limits.file_mb, frozenset(cores or ()))


def _start_warm(key: WarmKey, limits: Limits) -> warm.WarmSandbox:
    """A warm sandbox for runs of these limits (warm.py): bwrap as for a cold run, with the server in it."""
    exe = interpreter()
    filt = _seccomp_filter()
    uid = _take_uid()
    opened: list[int] = []
    cgroup = None
    host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cgroup = Cgroup.make((2 * limits.memory_mb + 5 * limits.file_mb + warm.SERVER_MB) << 20)
        if filt:
            opened.append(_memfd("sandbox-seccomp", filt))
        cmd = cgroup.join() if cgroup else []
        if uid is not None:
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        cmd += _bwrap(_layout(limits, exe), opened[-1] if filt else None)
        cmd += [exe, *PYTHON_FLAGS, "-c"] + _harness_args(exe, ["serve", str(server_end.fileno()), "-"], opened)
        with _OnCores(set(key.cores) or None):
            return warm.start(key, cmd, _run_env("warm"), opened + [server_end.fileno()], host_end, cgroup, uid,
                              release=lambda: _finish("bwrap", uid, exe, cgroup, None))
    except warm.WarmStartError:
        raise
    except OSError as e:
        host_end.close()
        _finish("bwrap", uid, exe, cgroup, None)
        raise warm.WarmStartError(str(e)) from None
    finally:
        server_end.close()
        for fd in opened:
            os.close(fd)


def _execute_warm(payload: dict, stdin: str, limits: Limits, mode: str, step_s: float | None, cpu_s: float,
                  until: float | None) -> tuple[RunResult, list[dict]]:
    """execute() in a warm sandbox (warm.py). WarmStartError when none can be started."""
    key = warm_key(limits)
    start = time.monotonic()
    for attempt in (1, 2):  # an idle sandbox may have gone meanwhile (killed from outside): then a new one
        box = warm.take(key, lambda: _start_warm(key, limits))
        payload["rlimits"] = _rlimit_list(limits, cpu_s, box.uid)
        oom_before = box.cgroup.oom_kills() if box.cgroup else 0
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, control: (read, write)
        stdin_fd = _memfd("sandbox-stdin", stdin.encode()) if stdin else os.open(os.devnull, os.O_RDONLY)
        try:
            try:
                box.submit(marshal.dumps([mode, payload], MARSHAL_VERSION), [stdin_fd] + [w for _, w in pipes])
            finally:
                for fd in [stdin_fd] + [w for _, w in pipes]:
                    os.close(fd)
            break
        except OSError as e:
            for r, _ in pipes:
                os.close(r)
            box.close()
            if attempt == 2:
                return RunResult("sandbox_error", None, "", "", False, time.monotonic() - start,
                                 f"sandbox failed to start (bwrap, warm): {e}"), []
    reply: dict = {}
    reusable = False

    def answered() -> bool:
        try:
            got = box.read_reply()
        except (OSError, ValueError, EOFError):  # the server is gone: whatever its run did, it ended there
            reply["status"] = None
            return True
        if got is not None:
            reply.update(got)
        return got is not None

    run = _Watch(limits, start, step_s, until, payload, pipes[0][0], pipes[1][0], pipes[2][0])
    try:
        run.watch(exited=lambda: bool(reply), other={box.sock.fileno(): answered})
        reusable = reply.get("status") is not None and reply.get("clean") is True and not run.timed_out
    finally:
        run.sel.close()
        wall = time.monotonic() - start
        oom = (box.cgroup.oom_kills() - oom_before) if box.cgroup else 0
        for r, _ in pipes:
            os.close(r)
        if reusable:
            warm.give_back(box)
        else:
            box.close()
    status = reply.get("status")
    if status is None:  # killed with its sandbox, as a cold run's pid 1 reports it
        returncode = 128 + signal.SIGKILL
    elif os.WIFSIGNALED(status):
        returncode = 128 + os.WTERMSIG(status)
    else:
        returncode = os.waitstatus_to_exitcode(status)
    return run.result(returncode, float(reply.get("cpu") or 0.0), limits, cpu_s, "bwrap", wall, oom)


def _finish(use: str, uid: int | None, exe: str, cgroup: Cgroup | None, workdir: unisolated.Workdir | None) -> None:
    """After the run: every process of it gone first, then its files, its cgroup and its uid."""
    if use == "rlimit" and uid is not None:
        unisolated.kill_uid(uid, exe)
    if workdir:
        workdir.remove()
    if use == "rlimit" and uid is not None:
        unisolated.remove_files_of(uid)
    if cgroup:
        cgroup.remove()
    _release_uid(uid)


def _starts_step(msg: dict, up: bool, due: list, begun: int) -> bool:
    """The harness's first "started" (sent before any of the program runs) or its "begin" of the case due next:
    the only messages that start a step. The program can forge the second, but only to end its time sooner."""
    if not up:
        return msg.get("started") is True
    return begun < len(due) and type(msg.get("begin")) is int and msg["begin"] == due[begun]


def _parse(line: bytes) -> dict | None:
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):  # the program can write on this channel too
        return None
    return msg if isinstance(msg, dict) else None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _verdict(started: bool, timed_out: bool, rc: int, cpu_used: float, stderr: str, limits: Limits,
             cpu_s: float, use: str, wall: float, oom_kills: int = 0) -> tuple[str, int | None, str]:
    if not started:
        # nothing of the program ran: whatever went wrong is the sandbox's (or the host's) fault
        why = "timed out" if timed_out else f"exit {rc}"
        return "sandbox_error", None, f"sandbox failed to start ({use}, {why}): {_last_line(stderr) or 'no message'}"
    if timed_out:
        return "timeout", None, f"wall time limit {limits.wall_s:g} s exceeded"
    namespaced = use in ("bwrap", "unshare")  # their pid 1 reports a signal as 128 + signal
    sig = -rc if rc < 0 else (rc - 128 if namespaced and 128 < rc < 128 + 65 else 0)
    cpu_limit = max(1, math.ceil(cpu_s))
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_limit - 0.05):
            return "timeout", -sig, f"cpu time limit {cpu_limit} s exceeded"
        if sig == signal.SIGXFSZ:
            return "error", -sig, f"file size limit {limits.file_mb} MB exceeded ({name})"
        if sig == signal.SIGKILL and oom_kills:
            return "memory", -sig, "memory limit of the run's cgroup exceeded (killed)"
        return "killed", -sig, f"killed by {name}"
    if rc == 0:
        return "ok", 0, f"exit 0 in {wall:.2f} s"
    last = _last_line(stderr)
    if last.startswith("MemoryError") or "Cannot allocate memory" in last:
        return "memory", rc, f"memory limit {limits.memory_mb} MB exceeded (MemoryError)"
    return "error", rc, f"exit {rc}: {last or 'no message'}"


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run a program (as __main__) with stdin in the sandbox."""
    return execute({"code": code}, stdin, limits, "script")[0]
