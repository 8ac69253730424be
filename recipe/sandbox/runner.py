"""One sandboxed run of untrusted Python: isolation, limits, bounded output, and an honest verdict.

Two backends, picked once per process by `backend()`:
- "bwrap" (bubblewrap): user, pid, net, ipc, uts and cgroup namespaces; a read-only /usr (plus the interpreter's
  own prefix), a fresh /proc and /dev, and a size-bounded tmpfs at /tmp as the only writable place, cwd and HOME.
  Nothing else of the host's file system is visible: not the repository, not /root, not the host's /tmp.
- "rlimit" (no usable bwrap): the same limits, a clean environment and a private temporary cwd, sockets refused
  inside the interpreter (a subprocess or `import _socket` gets around that) and, as root, the unprivileged uid
  nobody. Weaker: files the uid may write elsewhere (/tmp) are writable, disk use is bounded per file only,
  concurrent runs share uid nobody (one may signal another), and without root the code runs as the caller's
  own uid and can touch whatever that uid can.

Both: rlimits (CPU, address space, processes, file size, open files, no core files) set by `prlimit` (util-linux)
before the sandbox starts; a new session so the whole process group is killed at the wall limit; stdout and stderr read
as they come and cut at a bound. As root the sandbox runs as uid nobody (65534): RLIMIT_NPROC does not bind
root, and nobody cannot signal or read the host's processes. RLIMIT_NPROC counts all tasks of a uid, so the
limit is max_procs above what that uid already runs.

Set RECIPE_SANDBOX=rlimit (or =bwrap) to force a backend.
"""
from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
CONTROL_BYTES = 1 << 20  # the host's side channel from the harness (function results), bounded like output
EXIT_GRACE_S = 0.5  # after the program exits, how long leftover children may keep its pipes open
STEP_GRACE_S = 0.5  # functional tests: slack over a case's wall limit before the host kills the process
INSIDE = (Path(__file__).with_name("_inside.py")).read_text()
PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 2.0          # RLIMIT_CPU (whole seconds, rounded up)
    wall_s: float = 5.0         # the whole process group is killed after this
    memory_mb: int = 256        # RLIMIT_AS
    max_procs: int = 32         # RLIMIT_NPROC, above what the sandbox uid already runs
    file_mb: int = 8            # RLIMIT_FSIZE; with bwrap the writable tmpfs holds 4x this in all
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

_lock = threading.Lock()
_backend: str | None = None


def backend() -> str:
    """ "bwrap" when bubblewrap is on PATH and starts a sandbox here, else "rlimit" (with one warning line)."""
    global _backend
    with _lock:
        if _backend is None:
            forced = os.environ.get("RECIPE_SANDBOX", "")
            if forced not in ("", "bwrap", "rlimit"):
                raise ValueError(f"RECIPE_SANDBOX={forced!r}: expected 'bwrap' or 'rlimit'")
            why = "forced by RECIPE_SANDBOX=rlimit" if forced == "rlimit" else _probe_bwrap()
            if why is None:
                _backend = "bwrap"
            elif forced == "bwrap":
                raise RuntimeError(f"RECIPE_SANDBOX=bwrap but bubblewrap does not work here: {why}")
            else:
                _backend = "rlimit"
                print(f"warning: sandbox: bubblewrap unusable ({why}); model-written code runs under the weaker "
                      "rlimit-only isolation. Install it with `apt-get install bubblewrap`.", file=sys.stderr)
        return _backend


def _probe_bwrap() -> str | None:
    """None when a real bwrap sandbox runs a program here, else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap not on PATH"
    res, _ = execute({"code": "print('ok')"}, "", Limits(wall_s=30), "script", use="bwrap")  # a busy host is no failure
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
        _features = {opt for opt in ("--disable-userns", "--size") if opt in text}
    return _features


# ------------------------------------------------------------------------------------------------ the command

def _sandbox_uid() -> int | None:
    return NOBODY if os.geteuid() == 0 else None


def _usable_by_others(path: str) -> bool:
    """Can uid nobody execute this file (every folder above searchable, the file readable and executable)?"""
    try:
        p = Path(path)
        if p.stat().st_mode & 0o005 != 0o005:
            return False
        return all(d.stat().st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


_interp: str | None = None


def interpreter() -> str:
    """The Python the sandbox runs: this one's base interpreter (no venv packages), or a system python3 when
    uid nobody cannot reach this one (e.g. a pyenv or uv Python under /root)."""
    global _interp
    if _interp is None:
        own = os.path.realpath(sys.executable)
        system = shutil.which("python3", path=PATH)
        candidates = [own] + ([os.path.realpath(system)] if system else [])
        usable = [c for c in candidates if _sandbox_uid() is None or _usable_by_others(c)]
        _interp = (usable or candidates)[0]
    return _interp


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


def _rlimits(limits: Limits, cpu_s: float, uid: int) -> dict[str, tuple[int, int]]:
    cpu = max(1, math.ceil(cpu_s))
    one = lambda v: (v, v)  # noqa: E731
    return {"cpu": (cpu, cpu + 1), "as": one(limits.memory_mb << 20), "nproc": one(limits.max_procs + _tasks_of(uid)),
            "fsize": one(limits.file_mb << 20), "nofile": one(limits.open_files), "core": one(0)}


def _prlimit(rl: dict) -> list[str]:
    return ["prlimit"] + [f"--{k}={soft}:{hard}" for k, (soft, hard) in rl.items()] + ["--"]


_RUN_ON_CORES: set[int] | None = None  # set by run_on_cores()


def run_on_cores(cores) -> None:
    """Run programs on these cores, whatever the caller's own affinity. The RL trainer pins itself to one core
    and scores rollouts on it: its programs would be pinned there too and slow its own training step."""
    global _RUN_ON_CORES
    _RUN_ON_CORES = set(cores) if cores else None


def _cores_prefix() -> list[str]:
    if _RUN_ON_CORES is None or not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None:
        return []
    if os.sched_getaffinity(0) == _RUN_ON_CORES:
        return []
    return ["taskset", "--cpu-list", ",".join(str(c) for c in sorted(_RUN_ON_CORES))]


def _preexec(rl: dict):
    """Only without the prlimit tool: preexec_fn is not safe in threaded callers (the RL verifier's pool)."""
    import resource

    def apply():
        for k, v in rl.items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{k.upper()}"), v)
    return apply


def _bwrap(limits: Limits, exe: str) -> list[str]:
    feats = _bwrap_features()
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--uid", str(NOBODY), "--gid",
           str(NOBODY), "--hostname", "sandbox", "--cap-drop", "ALL"]
    if "--disable-userns" in feats:
        cmd.append("--disable-userns")  # no nested namespaces from inside
    cmd += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group"):
        cmd += ["--ro-bind-try", f, f]
    if "--size" in feats:
        cmd += ["--size", str(4 * limits.file_mb << 20)]
    cmd += ["--tmpfs", "/tmp"]
    prefix = str(Path(exe).parent.parent)
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        cmd += ["--ro-bind", prefix, prefix]  # after /tmp: the prefix may live below it
    return cmd + ["--chdir", "/tmp", "--"]


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


def _kill_escaped(token: str, sid: int, uid: int) -> None:
    """rlimit backend: kill the run's processes that left its process group (setpgid, setsid): same session, or
    still the run's token in their environment."""
    needle = f"RECIPE_SANDBOX_RUN={token}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                found = needle in f.read()
            if not found:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    found = int(f.read().rsplit(b")", 1)[1].split()[3]) == sid  # field 6: session id
            if found:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def _rmtree(path: str) -> None:
    def retry(func, p, exc):  # a program may leave folders without write permission
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry)


class _Stream:
    def __init__(self, cap: int):
        self.cap, self.data, self.truncated = cap, bytearray(), False

    def feed(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        self.data += chunk[:max(room, 0)]


def execute(payload: dict, stdin: str, limits: Limits, mode: str, use: str | None = None,
            step_s: float | None = None, cpu_s: float | None = None, hard_s: float | None = None,
            ) -> tuple[RunResult, list[dict]]:
    """Run the payload's code once. Returns the verdict and the control messages of the inside harness.

    step_s (functional tests): every harness message moves the deadline to now + step_s, never past hard_s.
    """
    use = use or backend()
    cpu_s = limits.cpu_s if cpu_s is None else cpu_s
    uid = _sandbox_uid()
    exe = interpreter()
    payload = {**payload, "block_network": use == "rlimit"}
    token = uuid.uuid4().hex
    env = {"PATH": PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "RECIPE_SANDBOX_RUN": token}
    workdir = None
    if use == "bwrap":
        cwd, prefix = None, _bwrap(limits, exe)
        env.update(HOME="/tmp", TMPDIR="/tmp")
    else:
        workdir = cwd = tempfile.mkdtemp(prefix="recipe-sandbox-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        prefix = []
        env.update(HOME=workdir, TMPDIR=workdir)
    rl = _rlimits(limits, cpu_s, os.getuid() if uid is None else uid)
    has_prlimit = shutil.which("prlimit") is not None

    start = time.monotonic()
    ctl_r, ctl_w = os.pipe()
    src = _memfd("sandbox-payload", json.dumps(payload).encode())
    stdin_fd = _memfd("sandbox-stdin", stdin.encode()) if stdin else subprocess.DEVNULL
    cmd = (_cores_prefix() + (_prlimit(rl) if has_prlimit else []) + prefix +
           [exe, "-s", "-B", "-c", INSIDE, mode, str(ctl_w), str(src)])
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        proc = subprocess.Popen(cmd, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env=env, pass_fds=(ctl_w, src), start_new_session=True,
                                preexec_fn=None if has_prlimit else _preexec(rl), **user)
    except OSError as e:
        for fd in (ctl_r, ctl_w, src) + ((stdin_fd,) if stdin else ()):
            os.close(fd)
        if workdir:
            _rmtree(workdir)
        return RunResult("sandbox_error", None, "", "", False, time.monotonic() - start,
                         f"sandbox failed to start: {e}"), []
    for fd in (ctl_w, src) + ((stdin_fd,) if stdin else ()):
        os.close(fd)

    out, err, ctl = _Stream(limits.output_bytes), _Stream(limits.output_bytes), _Stream(CONTROL_BYTES)
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, ctl_r: ctl}
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    deadline = start + limits.wall_s
    hard = start + (hard_s if hard_s is not None else limits.wall_s)
    messages, line, timed_out, exited_at = [], bytearray(), False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and _exited(proc.pid):
                exited_at = now
                _killpg(proc.pid)  # children still holding the pipes go with it
            if exited_at is not None and now - exited_at > EXIT_GRACE_S:
                break
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                streams[key.fd].feed(chunk)
                if key.fd != ctl_r or ctl.truncated:
                    continue
                line += chunk
                nl = line.find(b"\n", len(line) - len(chunk))
                while nl != -1:
                    msg = _parse(bytes(line[:nl]))
                    del line[:nl + 1]
                    if msg is not None:
                        messages.append(msg)
                        if step_s is not None:
                            deadline = min(hard, time.monotonic() + step_s)
                    nl = line.find(b"\n")
    finally:  # also on an exception here (KeyboardInterrupt): nothing of the program outlives the call
        sel.close()
        _killpg(proc.pid)
        if use == "rlimit":  # before reaping: until then no other process can take over the session id
            _kill_escaped(token, proc.pid, os.getuid() if uid is None else uid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(ctl_r)
        if workdir:
            _rmtree(workdir)

    stdout = out.data.decode("utf-8", "replace")
    stderr = err.data.decode("utf-8", "replace")
    started = any(m.get("started") for m in messages)
    status, code, reason = _verdict(started, timed_out, proc.returncode, usage.ru_utime + usage.ru_stime,
                                    stderr, limits, cpu_s, use, wall)
    return RunResult(status, code, stdout, stderr, out.truncated or err.truncated, wall, reason), messages


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
             cpu_s: float, use: str, wall: float) -> tuple[str, int | None, str]:
    if not started:
        # nothing of the program ran: whatever went wrong is the sandbox's (or the host's) fault
        why = "timed out" if timed_out else f"exit {rc}"
        return "sandbox_error", None, f"sandbox failed to start ({use}, {why}): {_last_line(stderr) or 'no message'}"
    if timed_out:
        return "timeout", None, f"wall time limit {limits.wall_s:g} s exceeded"
    sig = -rc if rc < 0 else (rc - 128 if use == "bwrap" and 128 < rc < 128 + 65 else 0)  # bwrap: 128 + signal
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
