"""The sandbox against hostile programs: each must be contained, end with a verdict that scores it 0 (never a
sandbox failure, which would mask it), leave no process or file behind on the host, and the next run must work.

Every hostile program runs under both isolating backends, bwrap and unshare (its fallback), and, where the
program's harm is one a private uid alone prevents, under the unisolated rlimit backend as root too. Each names
the harm it tries and its check asserts that the harm did not happen."""
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from recipe.errors import SandboxError
from recipe.sandbox import Limits, TestReport, backend, run_python, run_tests
from recipe.sandbox import cgroup, runner, seccomp

ROOT = Path(__file__).resolve().parent.parent
FAST = Limits(cpu_s=1, wall_s=2)
ONE_S = Limits(cpu_s=1, wall_s=1)
SECRET = "recipe-secret-" + uuid.uuid4().hex
IS_ROOT = os.geteuid() == 0
NAMESPACED = ("bwrap", "unshare")
ALL = ("bwrap", "unshare", "rlimit")
ARCH = seccomp.machine()
COLUMN = seccomp.ARCH.get(ARCH, (0, 0))[0]
TMP_MODES = {d: os.stat(d).st_mode for d in {"/tmp", tempfile.gettempdir()}}


@functools.lru_cache(maxsize=None)
def why_not(use: str) -> str | None:
    return runner._probe(use)


def use_backend(monkeypatch, use: str) -> None:
    if use == "rlimit":
        if not IS_ROOT:
            pytest.skip("the unisolated rlimit backend keeps runs apart (private uids) only as root")
    elif why_not(use) is not None:
        pytest.skip(f"{use} does not work here: {why_not(use)}")
    monkeypatch.setattr(runner, "_backend", use)


@pytest.fixture(params=NAMESPACED)
def each_backend(request, monkeypatch):
    use_backend(monkeypatch, request.param)
    return request.param


# ------------------------------------------------------------------------------------ the host the programs see

class Listener:
    """A server on the host's loopback (TCP) or in its abstract unix namespace: no program may reach it."""

    def __init__(self, family=socket.AF_INET, address=("127.0.0.1", 0)):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.address, self.accepted, self.stop = self.sock.getsockname(), 0, False
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def _world_readable_runs() -> Path:
    """A runs/ folder as a real checkout has one: world-readable, the hidden tests inside."""
    runs = Path(tempfile.mkdtemp(prefix="fake-runs-"))
    tests = runs / "tiny" / "data" / "code"
    tests.mkdir(parents=True)
    (tests / "hidden_tests.json").write_text(json.dumps({"input": "", "output": SECRET}))
    for d in [runs, *runs.rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)
    return runs


@pytest.fixture(scope="module")
def host():
    tcp, unix = Listener(), Listener(socket.AF_UNIX, f"\0recipe-test-{uuid.uuid4().hex}")
    sleepers = [subprocess.Popen(["sleep", "600"])]
    if IS_ROOT:
        sleepers.append(subprocess.Popen(["sleep", "600"], user=runner.NOBODY, group=runner.NOBODY))
    runs = _world_readable_runs()
    fd, tmp_file = tempfile.mkstemp(prefix="recipe-host-secret-")
    os.write(fd, SECRET.encode())
    os.close(fd)
    os.chmod(tmp_file, 0o644)
    yield {"tcp": tcp, "unix": unix, "sleepers": sleepers, "runs": runs, "tmp_file": tmp_file}
    for p in sleepers:
        p.kill()
        p.wait()
    tcp.close()
    unix.close()
    subprocess.run(["rm", "-rf", str(runs), tmp_file])


@dataclass
class Ctx:
    host: dict
    outside: Path
    mark: str = field(default_factory=lambda: "sbx-" + uuid.uuid4().hex[:12])

    def fill(self, code: str) -> str:
        """Put the test's facts into a program: @NAME@ becomes a Python literal."""
        h = self.host
        values = {"MARK": self.mark, "OUTSIDE": str(self.outside), "SENTINEL": str(self.outside / "sentinel"),
                  "PORT": h["tcp"].address[1], "ABSTRACT": h["unix"].address, "HOSTPID": os.getpid(),
                  "HELPERS": [p.pid for p in h["sleepers"]], "ROOT": str(ROOT), "RUNS": str(h["runs"]),
                  "SECRET_FILE": str(next(h["runs"].rglob("hidden_tests.json"))), "HOST_TMP_FILE": h["tmp_file"],
                  "CLONE_NR": seccomp.CLONE.get(ARCH, 56)}
        values.update({f"NR_{name}": nrs[COLUMN] for name, nrs in seccomp.DENIED.items()})
        for name, value in values.items():
            code = code.replace(f"@{name}@", repr(value))
        return code


@pytest.fixture
def ctx(host, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("untouched")
    c = Ctx(host, outside)
    c.accepted = (host["tcp"].accepted, host["unix"].accepted)
    # the host's temporary folder for this test alone, made like /tmp: the rlimit backend's workdirs go there, and
    # "nothing left in it" counts this test's runs only (a test file running beside this one, under pytest -n,
    # makes workdirs of its own in /tmp)
    private = tempfile.mkdtemp(prefix="recipe-test-tmp-")
    os.chmod(private, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", private)
    c.workdirs = set(Path(private).glob("recipe-sandbox-*"))
    yield c
    subprocess.run(["rm", "-rf", private])  # (monkeypatch puts tempfile.tempdir back after)


def marked(mark: str, body: str) -> str:
    """The program re-executes itself with `mark` on its command line, so /proc shows every process of it."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {body!r}, {mark!r}])\n"


def processes_with(mark: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if mark.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def assert_contained(res, c: Ctx):
    """Not masked; nothing of the program left running; the host's files, folders, processes and servers as they
    were; nothing left in the host's temporary folder; and the sandbox still works."""
    assert not res.sandbox_failed, res
    assert res.reason
    deadline = time.monotonic() + 2  # a killed pid namespace is torn down by the kernel a moment later
    while processes_with(c.mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(c.mark) == []
    assert sorted(p.name for p in c.outside.iterdir()) == ["sentinel"]
    assert (c.outside / "sentinel").read_text() == "untouched"
    for p in c.host["sleepers"]:
        assert p.poll() is None and state(p.pid) in "SR", f"host process {p.pid} was disturbed"
    os.kill(os.getpid(), 0)
    assert (c.host["tcp"].accepted, c.host["unix"].accepted) == c.accepted, "a program reached a host server"
    assert {d: os.stat(d).st_mode for d in TMP_MODES} == TMP_MODES
    assert set(Path(tempfile.gettempdir()).glob("recipe-sandbox-*")) == c.workdirs
    again = run_python("print(int(input()) * 2)", "21", FAST)
    assert again.status == "ok" and again.stdout == "42\n", again


# ------------------------------------------------------------------------------------------- hostile programs

@dataclass
class Hostile:
    name: str
    code: str
    check: Callable
    on: tuple = ALL           # backends that must hold against it
    limits: Limits = FAST
    marked: bool = False      # re-executed with the marker, so that /proc shows every process of it
    count_peak: bool = False  # count its processes while it runs


def out(res) -> list[str]:
    return res.stdout.splitlines()


# A check asserts what it can and returns True when the harm did not happen; checks combine with `and`.

def status_is(*statuses, reason=None, max_wall=None):
    def check(res, c):
        assert res.status in statuses, res
        assert reason is None or reason in res.reason, res
        assert max_wall is None or res.wall_s < max_wall, res
        return True
    return check


def every_line(prefix: str, expect: str, at_least: int = 1):
    """Lines starting with prefix all end with expect (e.g. ' -1 1': the call failed with EPERM)."""
    def check(res, c):
        lines = [ln for ln in out(res) if ln.startswith(prefix)]
        assert len(lines) >= at_least and all(ln.endswith(expect) for ln in lines), res
        return True
    return check


def no_secret(res, c):
    assert SECRET not in res.stdout + res.stderr, res
    return True


def both(*checks):
    return lambda res, c: all(chk(res, c) is True for chk in checks)


def peak_within(limit: int):
    def check(res, c):
        assert res.status in ("timeout", "killed", "ok", "error"), res
        assert c.peak <= limit, f"{c.peak} processes at once"
        return True
    return check


def number_after(word: str, res) -> int:
    return int(next(ln for ln in out(res) if ln.startswith(word)).split()[1])


SYSCALLS = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
CONNECT_LOOPBACK = "s = socket.create_connection(('127.0.0.1', @PORT@), timeout=1)\ns.sendall(b'leak')\n"
DAEMON = """
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        os.closerange(0, 256)
        # no environment left to find it by, in a session and process group of its own
        os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', @MARK@], {})
    os._exit(0)
os.wait()
print('detached')
"""

HOSTILE = [
    # ---- limits: CPU, wall, processes, memory (shared memory too), disk, descriptors, output
    Hostile("cpu_burn", "while True: pass", status_is("timeout", reason="cpu"), marked=True),
    Hostile("cpu_burn_in_threads", "import threading\ndef spin():\n    while True: pass\n"
            "for _ in range(4): threading.Thread(target=spin).start()\nspin()",
            status_is("timeout", max_wall=3.5), marked=True),
    Hostile("sleep_past_wall", "import time; time.sleep(60)", status_is("timeout", reason="wall", max_wall=2.5),
            limits=ONE_S, marked=True),
    Hostile("stop_itself", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)",
            status_is("timeout", max_wall=2.5), limits=ONE_S, marked=True),
    Hostile("close_pipes_and_linger", "import os, time\nos.close(1); os.close(2)\ntime.sleep(60)",
            status_is("timeout", max_wall=2.5), limits=ONE_S, marked=True),
    Hostile("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            peak_within(16 + runner.SANDBOX_PROCS), limits=Limits(cpu_s=1, wall_s=2, max_procs=16), marked=True,
            count_peak=True),
    Hostile("thread_bomb", "import threading, time\nn = 0\ntry:\n    while True:\n"
            "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
            "except RuntimeError:\n    print('threads', n)",
            lambda res, c: status_is("ok")(res, c) and number_after("threads", res) <= 16 + runner.SANDBOX_PROCS,
            limits=Limits(cpu_s=1, wall_s=2, max_procs=16), marked=True),
    # 64 MB, not the default 256: every page the bomb fills is a fresh one, and in a busy hour of this VM filling
    # 256 MB took more than the 1 s CPU limit (CI, 2026-12-07: "cpu time limit 1 s exceeded" instead of "memory")
    Hostile("memory_bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(8 << 20))", status_is("memory"),
            limits=Limits(cpu_s=1, wall_s=2, memory_mb=64)),
    Hostile("shared_mmap_bomb", "import mmap\nmaps = []\nwhile True:\n"
            "    m = mmap.mmap(-1, 32 << 20, mmap.MAP_SHARED)\n    m[::4096] = b'x' * (8192)\n    maps.append(m)",
            status_is("memory")),
    Hostile("memfd_hog", "import os\nfd = os.memfd_create('hog')\nfor _ in range(1300):\n"
            "    os.write(fd, b'x' * (1 << 20))\nprint('held')",
            both(status_is("error", reason="PermissionError"), lambda res, c: "held" not in res.stdout)),
    Hostile("memfd_by_syscall", SYSCALLS + "print('memfd', libc.syscall(@NR_memfd_create@, b'hog', 0), "
            "ctypes.get_errno())", every_line("memfd", " -1 1")),
    Hostile("sysv_shared_memory", SYSCALLS + "print('shmget', libc.shmget(0, 1 << 30, 0o1600), ctypes.get_errno())",
            every_line("shmget", " -1 1")),
    Hostile("ipc_that_outlives_the_run", SYSCALLS + "print('msgget', libc.syscall(@NR_msgget@, 0, 0o1600), "
            "ctypes.get_errno())\nprint('semget', libc.syscall(@NR_semget@, 0, 1, 0o1600), ctypes.get_errno())\n"
            "print('mq_open', libc.syscall(@NR_mq_open@, b'q', 0o100 | 2, 0o600, None), ctypes.get_errno())",
            every_line("", " -1 1", at_least=3)),
    Hostile("dev_shm_hog", "total = 0\ntry:\n    for i in range(200):\n"
            "        with open(f'/dev/shm/hog{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
            "        total += 1\nexcept OSError as e:\n    print('stopped', e.errno)\nprint('MB', total)",
            lambda res, c: number_after("MB", res) <= FAST.file_mb and "stopped 28" in res.stdout, on=NAMESPACED),
    Hostile("tmp_many_files", "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20)); i += 1",
            status_is("error", reason="No space left"), limits=Limits(cpu_s=1, wall_s=2, file_mb=2),
            on=NAMESPACED),
    Hostile("one_big_file", "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))",
            status_is("error", reason="File too large"), limits=Limits(cpu_s=1, wall_s=2, file_mb=2)),
    Hostile("write_into_dev", "try:\n    open('/dev/hog', 'wb').write(b'x'); print('wrote')\n"
            "except OSError as e:\n    print('denied', e.errno)", every_line("denied", " 30"), on=NAMESPACED),
    Hostile("descriptor_exhaustion", "import os\nfds = []\ntry:\n    while True:\n"
            "        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e:\n"
            "    print('open', len(fds), e.errno)",
            lambda res, c: every_line("open", " 24")(res, c) and number_after("open", res) < FAST.open_files),
    Hostile("huge_output",
            "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n    sys.stderr.write('y' * 65536)",
            lambda res, c: res.truncated and len(res.stdout) <= 4096 and len(res.stderr) <= 4096
            and res.status == "timeout", limits=Limits(cpu_s=1, wall_s=2, output_bytes=4096)),
    Hostile("deep_recursion", "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
            status_is("killed", "memory", "error", "timeout")),

    # ---- outliving the run, signals and tracing: the host's processes and the run's siblings
    Hostile("daemon_setsid_double_fork_empty_env", DAEMON, status_is("ok", max_wall=2)),
    Hostile("background_shells", "import subprocess\n"
            "subprocess.Popen(['sh', '-c', 'sleep 30; : ' + @MARK@])\n"
            "subprocess.Popen(['sh', '-c', 'sleep 30; : ' + @MARK@], start_new_session=True)\n"
            "subprocess.Popen(['sh', '-c', 'trap \"\" HUP TERM; sleep 40; : ' + @MARK@], start_new_session=True)\n"
            "print('spawned')", status_is("ok")),
    Hostile("kill_minus_one", "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n"
            "    print(type(e).__name__)\nprint('still here')", status_is("ok", "killed")),  # a warm sandbox's
    # server is in the program's reach (recipe/sandbox/warm.py): it goes, and the run with it, as "killed"
    Hostile("kill_parent_and_host_pids", "import os, signal\n"
            "for pid in [os.getppid(), 1, @HOSTPID@] + @HELPERS@:\n"
            "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n        try:\n            os.kill(pid, sig)\n"
            "        except OSError as e:\n            print(pid, type(e).__name__)", status_is("ok", "killed")),
    Hostile("ptrace_attach", SYSCALLS + "for pid in [os.getppid(), 1, @HOSTPID@] + @HELPERS@:\n"
            "    print('ptrace', pid, libc.ptrace(16, pid, 0, 0), ctypes.get_errno())",
            every_line("ptrace", " -1 1", at_least=3)),
    Hostile("read_memory_of_others", SYSCALLS + "buf = ctypes.create_string_buffer(64)\n"
            "iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)\n"
            "for pid in [os.getppid(), 1, @HOSTPID@]:\n"
            "    print('vm_readv', libc.process_vm_readv(pid, iov, 1, iov, 1, 0), ctypes.get_errno())\n"
            "    try:\n        open(f'/proc/{pid}/mem', 'rb').read(1); print('mem', pid, 'read')\n"
            "    except OSError as e:\n        print('mem', pid, 'denied')",
            both(every_line("vm_readv", " -1 1", at_least=3), every_line("mem", "denied", at_least=3))),

    # ---- escaping the sandbox: namespaces, mounts, the kernel's surface
    Hostile("new_namespaces", SYSCALLS + "import subprocess\n"
            "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "print('clone', libc.syscall(@CLONE_NR@, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
            "r = subprocess.run(['unshare', '-r', 'id'], capture_output=True)\nprint('tool', r.returncode)",
            lambda res, c: every_line("unshare", " -1 1")(res, c) and every_line("clone", " -1 1")(res, c)
            and "tool 0" not in res.stdout),
    Hostile("mount_and_chroot", SYSCALLS + "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), "
            "ctypes.get_errno())\nprint('umount', libc.umount2(b'/proc', 2), ctypes.get_errno())\n"
            "print('chroot', libc.chroot(b'/tmp'), ctypes.get_errno())", every_line("", " -1 1", at_least=3)),
    Hostile("kernel_surface", SYSCALLS + "for name, nr in [('bpf', @NR_bpf@), ('perf', @NR_perf_event_open@), "
            "('keyctl', @NR_keyctl@), ('userfaultfd', @NR_userfaultfd@), ('io_uring', @NR_io_uring_setup@), "
            "('personality', @NR_personality@), ('init_module', @NR_init_module@), "
            "('settime', @NR_clock_settime@), ('kexec', @NR_kexec_load@)]:\n"
            "    print(name, libc.syscall(nr, 0, 0, 0, 0, 0), ctypes.get_errno())",
            every_line("", " -1 1", at_least=9)),
    Hostile("widen_cpu_affinity", "import os, subprocess\ntry:\n"
            "    os.sched_setaffinity(0, set(range(os.cpu_count())))\n"
            "except OSError as e:\n    print('denied', e.errno)\n"
            "subprocess.run(['taskset', '-a', '-p', '-c', '0-63', str(os.getpid())], capture_output=True)\n"
            "print('cores', sorted(os.sched_getaffinity(0)))",
            lambda res, c: every_line("denied", " 1")(res, c) and every_line("cores", " [0]")(res, c)),

    # ---- the host's files: clean-up that follows links, permissions, writing outside
    Hostile("chmod_parents", "import os\nhome = os.getcwd()\n"
            "for p in ['..', '/tmp', '/', '.']:\n    try:\n        os.chmod(p, 0)\n    except OSError:\n        pass\n"
            "os.chmod(home, 0o700)\nos.makedirs(home + '/a/b')\nopen(home + '/a/b/f', 'w').write('x')\n"
            "os.chmod(home + '/a/b', 0)\nos.chmod(home + '/a', 0)\nos.chmod(home, 0o500)\nprint('done')",
            status_is("ok")),
    Hostile("symlink_swap_during_cleanup", """
import os, time
os.makedirs('d/e')
open('d/e/f', 'w').write('x')
os.symlink(@OUTSIDE@, 'link_dir')
os.symlink(@SENTINEL@, 'link_file')
os.symlink('/', 'root_link')
os.symlink('/tmp', 'e')
if os.fork() == 0:
    os.setsid()
    # swaps d for a link to the host's folder and back, while the host cleans up
    end = time.time() + 30
    while time.time() < end:
        try:
            os.rename('d', 'd.real'); os.symlink(@OUTSIDE@, 'd')
            os.unlink('d'); os.rename('d.real', 'd')
        except OSError:
            pass
    os._exit(0)
time.sleep(0.3)
print('swapping')""", status_is("ok"), marked=True),
    Hostile("hardlink_host_file", "import os\ntry:\n    os.link(@SENTINEL@, 'x'); print('linked')\n"
            "except OSError as e:\n    print('denied', e.errno)", lambda res, c: "linked" not in res.stdout),
    Hostile("write_outside_its_folder", "import os\n"
            "for path in [@SENTINEL@, @OUTSIDE@ + '/new', @ROOT@ + '/escape.txt', '/usr/x', '/etc/x']:\n"
            "    try:\n        open(path, 'w').write('pwned'); print('wrote', path)\n"
            "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
            "open('mine.txt', 'w').write('fine'); print('own folder ok')",
            lambda res, c: status_is("ok")(res, c) and "wrote" not in res.stdout
            and not (ROOT / "escape.txt").exists() and not Path("/usr/x").exists()),

    # ---- reading what it must not: the repository, runs/ (hidden tests), secrets, other users' files
    Hostile("read_the_repository", "import os\n"
            "for p in [@ROOT@ + '/pyproject.toml', @ROOT@ + '/recipe/sandbox/runner.py']:\n"
            "    try:\n        print(open(p).read()[:300])\n"
            "    except OSError as e:\n        print('denied', e.errno)\n"
            "try:\n    print(os.listdir(@ROOT@))\nexcept OSError as e:\n    print('denied', e.errno)",
            lambda res, c: every_line("denied", " 2", at_least=3)(res, c) and "[project]" not in res.stdout,
            on=NAMESPACED),
    Hostile("read_runs_hidden_tests", "import os\ntry:\n    print(open(@SECRET_FILE@).read())\nexcept OSError as e:\n"
            "    print('denied', e.errno)\nfor d, _, files in os.walk(@RUNS@):\n"
            "    for f in files:\n        print(open(os.path.join(d, f)).read())",
            both(no_secret, every_line("denied", " 2")),
            on=NAMESPACED),
    Hostile("read_host_tmp", "import os\nprint(os.listdir('/tmp'))\ntry:\n    print(open(@HOST_TMP_FILE@).read())\n"
            "except OSError as e:\n    print('denied', e.errno)", no_secret, on=NAMESPACED),
    Hostile("read_root_home", "import os\nfor p in ['/root', '/root/.ssh', '/home']:\n"
            "    try:\n        print('listed', p, os.listdir(p))\n"
            "    except OSError as e:\n        print('denied', p)\n"
            "try:\n    print('read', open('/etc/shadow').read()[:50])\nexcept OSError:\n    print('denied shadow')",
            lambda res, c: "listed /root" not in res.stdout and not any(ln.startswith("read ") for ln in out(res))),
    Hostile("environment_and_proc_secrets", "import os, subprocess\nprint(dict(os.environ))\n"
            "for pid in ['self', str(os.getppid()), '1', str(@HOSTPID@)] + os.listdir('/proc'):\n"
            "    for f in ('environ', 'cmdline'):\n        try:\n"
            "            print(pid, open(f'/proc/{pid}/{f}', 'rb').read())\n        except (OSError, ValueError):\n"
            "            pass\nsubprocess.run(['sh', '-c', 'env; echo secret=$RECIPE_TEST_SECRET'])",
            both(no_secret, lambda res, c: "PATH=" in res.stdout and not res.truncated),
            limits=Limits(wall_s=4, output_bytes=1 << 20)),
    Hostile("see_host_processes", "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print('count', len(pids))\nprint('host pid', str(@HOSTPID@) in pids)",
            lambda res, c: number_after("count", res) < 10 and "host pid False" in res.stdout, on=NAMESPACED),

    # ---- the network, four ways and more: the host's loopback, its abstract unix sockets, the outside
    Hostile("net_socket_module", "import socket\n" + CONNECT_LOOPBACK + "print('connected')",
            lambda res, c: res.status == "error" and "connected" not in res.stdout),
    Hostile("net_raw_socket_module", "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
            "s.settimeout(1)\ns.connect(('127.0.0.1', @PORT@))\nprint('connected')",
            lambda res, c: res.status == "error" and "connected" not in res.stdout),
    Hostile("net_from_a_subprocess", "import subprocess, sys\n"
            "code = 'import socket\\n' + " + repr(CONNECT_LOOPBACK) + " + 'print(\"connected\")'\n"
            "subprocess.run([sys.executable, '-c', code])\n"
            "subprocess.run(['bash', '-c', 'exec 3<>/dev/tcp/127.0.0.1/' + str(@PORT@) + ' && echo connected'])",
            lambda res, c: "connected" not in res.stdout),
    Hostile("net_by_syscall", SYSCALLS + "import struct, socket\nfd = libc.socket(2, 1, 0)\n"
            "print('socket', fd, ctypes.get_errno())\n"
            "addr = struct.pack('!HH4s8x', 2, @PORT@, socket.inet_aton('127.0.0.1'))\n"
            "addr = addr[:2][::-1] + addr[2:]  # sin_family in host order\n"
            "print('connect', libc.connect(fd, addr, len(addr)), ctypes.get_errno())",
            lambda res, c: "connect 0" not in res.stdout and every_line("socket", " -1 1")(res, c)),
    Hostile("net_raw_packet_and_netlink", "import socket\n"
            "for fam, kind in [(socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_NETLINK, socket.SOCK_RAW), "
            "(socket.AF_INET6, socket.SOCK_DGRAM), (socket.AF_INET, socket.SOCK_RAW)]:\n"
            "    try:\n        socket.socket(fam, kind); print('opened', fam)\n"
            "    except OSError as e:\n        print('denied', e.errno)", every_line("denied", " 1", at_least=4)),
    Hostile("net_external_and_dns", "import socket\nfor host in ('1.1.1.1', '8.8.8.8'):\n    try:\n"
            "        socket.create_connection((host, 53), timeout=1); print('connected', host)\n"
            "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
            "socket.getaddrinfo('example.com', 443)\nprint('resolved')",
            lambda res, c: res.stdout.count("blocked") == 2 and res.status == "error" and "resolved" not in res.stdout,
            limits=Limits(wall_s=4)),
    Hostile("net_host_abstract_unix_socket", "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            "s.connect(@ABSTRACT@)\nprint('connected')",
            lambda res, c: res.status == "error" and "connected" not in res.stdout, on=NAMESPACED),
]


@pytest.mark.parametrize("prog,use", [pytest.param(h, u, id=f"{h.name}-{u}") for h in HOSTILE for u in h.on])
def test_hostile_program_is_contained(prog, use, ctx, monkeypatch):
    use_backend(monkeypatch, use)
    monkeypatch.setenv("RECIPE_TEST_SECRET", SECRET)  # the host's environment must not reach the program
    if prog.name == "widen_cpu_affinity":
        if (os.cpu_count() or 1) < 2:
            pytest.skip("needs 2 cores")
        runner.run_on_cores({0})
    code = ctx.fill(prog.code)
    if prog.marked:
        code = marked(ctx.mark, code)
    ctx.peak, done = 0, threading.Event()

    def count():
        while not done.is_set():
            ctx.peak = max(ctx.peak, len(processes_with(ctx.mark)))
            time.sleep(0.01)

    watcher = threading.Thread(target=count)
    if prog.count_peak:
        watcher.start()
    try:
        res = run_python(code, "", prog.limits)
    finally:
        done.set()
        runner.run_on_cores(None)
        if prog.count_peak:
            watcher.join()
    assert prog.check(res, ctx) is True, res
    assert_contained(res, ctx)


def test_there_are_at_least_40_hostile_programs():
    assert len({h.name for h in HOSTILE}) == len(HOSTILE) >= 40


# ------------------------------------------------------------------------ what grading and the tools env expose

def test_hidden_tests_never_reach_the_program(each_backend, host):
    """The program looks for the expected answers in runs/ and in its own memory: it gets no reward."""
    path = str(next(host["runs"].rglob("hidden_tests.json")))
    reader = f"import json\nprint(json.load(open({path!r}))['output'])"
    report = run_tests(reader, [{"input": "", "output": SECRET}], FAST)
    assert report.passed == 0 and report.sandbox_error is None, report
    hunter = ("import gc\ndef f(x):\n"
              "    for o in gc.get_objects():\n"
              "        if isinstance(o, (list, dict)):\n"
              "            for v in (o if isinstance(o, list) else o.values()):\n"
              "                if isinstance(v, str) and v.startswith('want-'):\n"
              "                    return v\n    return None\n")
    want = "want-" + uuid.uuid4().hex
    report = run_tests(hunter, [{"fn": "f", "args": [1], "expected": want}], FAST)
    assert report.passed == 0 and report.sandbox_error is None, report


def test_python_tool_cannot_read_the_hidden_tests(each_backend, host):
    from recipe.envs.tools import run_python_tool

    path = str(next(host["runs"].rglob("hidden_tests.json")))
    reply = run_python_tool(f"import os\nprint(open({path!r}).read())\nprint(os.listdir({str(ROOT)!r}))")
    assert SECRET not in reply and "pyproject.toml" not in reply and reply.startswith("error"), reply


# --------------------------------------------------------------------------------------- samples of one group

HONEST = [  # (code, tests): each imports json and uses its folder while a hostile sibling runs
    ("import json, time\ntime.sleep(0.3)\nn = int(input())\nprint(json.dumps({'v': n * 2}))",
     [{"input": "21", "output": '{"v": 42}'}, {"input": "5", "output": '{"v": 10}'}]),
    ("import json\ndef f(x):\n    import time; time.sleep(0.2)\n    return json.loads(json.dumps(x)) + 1\n",
     [{"fn": "f", "args": [1], "expected": 2}, {"fn": "f", "args": [5], "expected": 6}]),
    ("import json, time\nopen('data.txt', 'w').write('abc')\ntime.sleep(0.4)\nprint(open('data.txt').read())",
     [{"input": "", "output": "abc"}]),
]
SIBLING_ATTACK = """
import ctypes, glob, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
evil = "raise SystemExit('hijacked')\\n"
end = time.time() + 1.5
while time.time() < end:
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
        libc.ptrace(16, int(pid), 0, 0)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            try:
                os.kill(int(pid), sig)
            except OSError:
                pass
        for name, text in (('json.py', evil), ('data.txt', 'pwned')):
            try:
                open(f'/proc/{pid}/cwd/{name}', 'w').write(text)
            except OSError:
                pass
    for d in ['.'] + glob.glob('/tmp/recipe-sandbox-*') + glob.glob('/tmp/recipe-sandbox-*/home'):
        try:
            open(os.path.join(d, 'json.py'), 'w').write(evil)
        except OSError:
            pass
    time.sleep(0.01)
print('done')
"""


@pytest.mark.parametrize("use", ALL)
def test_samples_of_a_group_side_by_side_with_a_hostile_sibling(use, monkeypatch, ctx):
    """As the RL verifier scores a group: several samples at once, one of them attacking the others."""
    use_backend(monkeypatch, use)
    jobs = [(code, tests) for code, tests in HONEST] + [(SIBLING_ATTACK, [{"input": "", "output": "done"}])]
    for _ in range(2):
        with ThreadPoolExecutor(len(jobs)) as pool:
            reports = list(pool.map(lambda job: run_tests(job[0], job[1], FAST), jobs))
        for (code, tests), report in zip(jobs[:-1], reports):
            assert report.results == ["pass"] * len(tests) and report.sandbox_error is None, (code, report)
        assert reports[-1].sandbox_error is None, reports[-1]
    assert_contained(run_python("print(1)", "", FAST), ctx)


# ------------------------------------------------------------------------------------- the harness's channel

DEADLINE_SPAM = """
import json, os, signal, stat, time
channels = []
for fd in range(3, 64):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            channels.append(fd)
    except OSError:
        pass
def f(x):
    # no timer can stop it, and it says every line the harness may say, over and over
    for s in (signal.SIGALRM, signal.SIGPROF):
        signal.signal(s, signal.SIG_IGN)
    lines = b''.join(json.dumps(m).encode() + b'\\n' for m in
                     [{'started': True}] + [{'begin': i} for i in range(3)] + [{'junk': 1}])
    while True:
        for fd in channels:
            try:
                os.write(fd, lines)
            except OSError:
                pass
        time.sleep(0.02)
"""


@pytest.mark.parametrize("use", ALL)
def test_control_channel_spam_cannot_push_a_deadline(use, monkeypatch):
    """3 cases at a 0.5 s limit: the group's time is fixed at its start (0.5 + 4 x 1.0 s), not 9 s or more."""
    use_backend(monkeypatch, use)
    limits = Limits(cpu_s=5, wall_s=0.5)
    t0 = time.monotonic()
    report = run_tests(DEADLINE_SPAM, [{"fn": "f", "args": [i], "expected": i} for i in range(3)], limits)
    took = time.monotonic() - t0
    assert report.passed == 0 and report.sandbox_error is None, report
    assert all(r == "timeout" for r in report.results), report
    assert took < 0.5 + 4 * 1.0 + 1.0, f"{took:.1f} s"


@pytest.mark.parametrize("use", NAMESPACED)
def test_functional_side_channel_abuse(use, monkeypatch):
    # the program finds the harness's pipe and floods it with junk, deep nesting and forged results
    use_backend(monkeypatch, use)
    code = ("import os, stat\n"
            "for fd in range(3, 256):\n"
            "    try:\n"
            "        if not stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
            "            continue\n"
            "        os.write(fd, b'[' * 100000 + b'\\n' + b'{\"i\": 0, \"value\": 41}\\n' + b'{\"started\": 0}\\n')\n"
            "        for _ in range(20000):\n"
            "            os.write(fd, b'x')\n"
            "    except OSError:\n"
            "        pass\n"
            "def f(x):\n    return x + 1\n")
    t0 = time.monotonic()
    report = run_tests(code, [{"fn": "f", "args": [1], "expected": 2}, {"fn": "f", "args": [5], "expected": 6}], FAST)
    assert report.results == ["pass", "pass"] and report.sandbox_error is None, report
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("use", NAMESPACED)
def test_program_cannot_fake_a_sandbox_failure(use, monkeypatch):
    use_backend(monkeypatch, use)
    fakes = ["import sys\nsys.stderr.write('bwrap: Creating new namespace failed\\n'); sys.exit(1)",
             "import os\nos.closerange(0, 1024)\nos._exit(1)",
             "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
             "import os\nos.write(3, b'{\"started\": false}\\n'); os._exit(1)"]
    for code in fakes:
        res = run_python(code, limits=FAST)
        assert res.status in ("error", "killed") and not res.sandbox_failed, res
    report = run_tests(fakes[0], [{"input": "", "output": "x"}, {"fn": "f", "args": [], "expected": 1}], FAST)
    assert report.sandbox_error is None and report.passed == 0


# ----------------------------------------------------------------------------- memory, the filter, backends

@pytest.mark.parametrize("use", ALL)
def test_the_runs_memory_cgroup_holds_all_its_processes_together(use, monkeypatch):
    """8 processes of 80 MB each fit their own 128 MB address space; together they pass the run's cgroup."""
    use_backend(monkeypatch, use)
    probe = cgroup.Cgroup.make(64 << 20)
    if probe is None:
        pytest.skip("no memory cgroup can be made here")
    probe.remove()
    limits = Limits(cpu_s=5, wall_s=8, memory_mb=128, file_mb=2)
    cap_mb = 2 * limits.memory_mb + 5 * limits.file_mb
    code = ("import os, time\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
            "        block = b'x' * (80 << 20)\n        time.sleep(30)\n        os._exit(0)\n    kids.append(pid)\n"
            "    time.sleep(0.3)\nalive = 0\nfor pid in kids:\n"
            "    alive += os.waitpid(pid, os.WNOHANG) == (0, 0)\nprint('alive', alive)")
    res = run_python(code, "", limits)
    if "alive" in res.stdout:
        assert number_after("alive", res) * 80 <= cap_mb, res
    else:
        assert res.status == "memory", res


def test_cgroups_of_a_killed_process_are_removed_by_the_next():
    version, base = cgroup._find_cgroup_base()
    if not version:
        pytest.skip("no memory cgroup can be made here")
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, ours = (Path(base, f"{cgroup.PREFIX}{pid}-x") for pid in (dead.pid, os.getpid()))
    orphan.mkdir()
    ours.mkdir()
    try:
        cgroup._remove_orphans(base)
        assert not orphan.exists() and ours.exists()
    finally:
        for d in (orphan, ours):
            if d.exists():
                d.rmdir()


def test_the_filter_is_well_formed():
    for arch in seccomp.ARCH:
        prog = seccomp.filter_bytes(arch)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 < 200
    assert seccomp.filter_bytes("riscv64") is None  # no table: no filter rather than a wrong one


@pytest.mark.parametrize("use", ALL)
def test_ordinary_programs_run_under_the_filter(use, monkeypatch):
    """Threads, fork, a child interpreter, pipes and AF_UNIX sockets, multiprocessing (its locks live in
    /dev/shm): what a test program may use still works."""
    use_backend(monkeypatch, use)
    code = ("import os, sys, socket, subprocess, threading, multiprocessing\n"
            "total = []\nts = [threading.Thread(target=lambda i=i: total.append(i)) for i in range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\nprint('threads', sum(total))\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
            "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "print('child', subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, "
            "text=True).stdout.strip())\n"
            "a, b = socket.socketpair(); a.sendall(b'hi'); print('unix', b.recv(2).decode())\n"
            "def square(x):\n    return x * x\n"
            "if __name__ == '__main__':\n    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
            "        print('pool', sum(pool.map(square, range(5))))\n"
            "    print(sum(map(int, sys.stdin.read().split())))\n")
    res = run_python(code, "1 2 3", Limits(cpu_s=4, wall_s=10))
    assert res.status == "ok", res
    assert out(res) == ["threads 6", "fork 7", "child 42", "unix hi", "pool 30", "6"], res


def _no_backend(monkeypatch, opt_in: bool):
    monkeypatch.setattr(runner, "_backend", None)
    monkeypatch.setattr(runner, "_probe", lambda use: f"{use} broken here")
    monkeypatch.delenv("RECIPE_SANDBOX", raising=False)
    if opt_in:
        monkeypatch.setenv(runner.UNISOLATED_OPT_IN, "1")
    else:
        monkeypatch.delenv(runner.UNISOLATED_OPT_IN, raising=False)


def test_without_isolation_code_is_refused_unless_the_user_opts_in(monkeypatch, capsys):
    from recipe.envs import get_env

    _no_backend(monkeypatch, opt_in=False)
    with pytest.raises(SandboxError, match="RECIPE_SANDBOX_UNISOLATED=1"):
        backend()
    row = {"id": "r", "info": '{"tests": [{"fn": "f", "args": [1], "expected": 2}]}'}
    monkeypatch.setattr("recipe.envs.code._VERDICTS", {})
    with pytest.raises(SandboxError):  # the run stops with one line, rather than scoring every sample 0
        get_env("code").score("<think></think>```python\ndef f(x):\n    return 2\n```", row)
    _no_backend(monkeypatch, opt_in=True)
    assert backend() == "rlimit" and backend() == "rlimit"
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "WITHOUT ISOLATION" in err


def test_backend_names_and_forcing(monkeypatch, capsys):
    monkeypatch.setattr(runner, "_probe", lambda use: None if use == "unshare" else "missing")
    for forced, chosen in (("", "unshare"), ("rlimit", "unshare"), ("unshare", "unshare")):
        monkeypatch.setenv("RECIPE_SANDBOX", forced)
        monkeypatch.setattr(runner, "_backend", None)
        assert backend() == chosen
    assert "bubblewrap unusable" in capsys.readouterr().err
    for forced in ("bwrap", "nonsense"):
        monkeypatch.setenv("RECIPE_SANDBOX", forced)
        monkeypatch.setattr(runner, "_backend", None)
        with pytest.raises(SandboxError):
            backend()


def test_backend_and_results_are_plain_data():
    assert backend() in ALL
    if not os.environ.get("RECIPE_SANDBOX") and why_not("bwrap") is None:
        assert backend() == "bwrap"
    res = run_python("import sys\nprint(sys.stdin.read().upper(), end='')\nexit(0)", "abc", FAST)
    assert (res.status, res.returncode, res.stdout, res.truncated) == ("ok", 0, "ABC", False)
    json.dumps(res.__dict__)


# ------------------------------------------------------------------------------------------- ordinary grading

def test_correct_stdin_program_passes():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7", "output": "12  \n\n"}]
    report = run_tests("a, b = map(int, input().split())\nprint(a + b)", tests, FAST)
    assert isinstance(report, TestReport)
    assert (report.passed, report.total, report.fraction, report.results) == (2, 2, 1.0, ["pass", "pass"])
    assert report.sandbox_error is None


def test_correct_functional_program_passes():
    code = ("class Solution:\n    def twoSum(self, nums, target):\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n"
            "            if target - x in seen:\n                return (seen[target - x], i)\n"
            "            seen[x] = i\n"
            "def double(x):\n    print('noise on stdout is ignored')\n    return x * 2\n"
            "if __name__ == '__main__':\n    input()  # a main part must not run under the harness\n")
    tests = [{"fn": "twoSum", "args": [[2, 7, 11, 15], 9], "expected": [0, 1]},
             {"fn": "twoSum", "args": [[3, 2, 4], 6], "expected": (1, 2)},
             {"fn": "double", "args": ["ab"], "expected": "abab"}]
    report = run_tests(code, tests, FAST)
    assert report.results == ["pass"] * 3 and report.fraction == 1.0


def test_wrong_program_fails_with_reason():
    report = run_tests("print(int(input()) + 1)", [{"input": "1", "output": "2"}, {"input": "2", "output": "4"}])
    assert report.results[0] == "pass" and report.results[1].startswith("fail: wrong answer"), report
    assert report.fraction == 0.5
    report = run_tests("def f(x):\n    return x + 1", [{"fn": "f", "args": [1], "expected": 3},
                                                       {"fn": "g", "args": [1], "expected": 2}], FAST)
    assert report.results[0].startswith("fail: wrong answer") and "not defined" in report.results[1], report


def test_syntax_error_fails_every_test_with_reason():
    tests = [{"input": "1", "output": "1"}, {"input": "2", "output": "2"}, {"fn": "f", "args": [], "expected": 1}]
    report = run_tests("def f(:\n    pass", tests, FAST)
    assert report.passed == 0 and report.sandbox_error is None
    assert all(r.startswith("fail:") and "SyntaxError" in r for r in report.results), report


def test_one_bad_case_does_not_hide_the_others():
    code = ("import os\n"
            "def f(kind):\n"
            "    if kind == 'exit':\n        os._exit(3)\n"
            "    if kind == 'loop':\n        while True:\n            pass\n"
            "    if kind == 'c-loop':\n        return sum(range(10 ** 12))  # C code: the host's watchdog ends it\n"
            "    if kind == 'memory':\n        return len(bytearray(1 << 34))\n"
            "    if kind == 'raise':\n        raise ValueError('bad input')\n"
            "    return kind\n")
    kinds = ["ok", "exit", "ok", "loop", "c-loop", "ok", "memory", "raise", "ok"]
    tests = [{"fn": "f", "args": [k], "expected": k} for k in kinds]
    t0 = time.monotonic()
    report = run_tests(code, tests, Limits(cpu_s=1, wall_s=1))
    r = dict(zip(range(len(kinds)), report.results))
    assert [r[i] for i in (0, 2, 5, 8)] == ["pass"] * 4, report
    assert r[1].startswith("fail: exit 3") and r[3] == "timeout" and r[4] == "timeout", report
    assert r[6] == "memory" and r[7] == "fail: ValueError: bad input", report
    assert time.monotonic() - t0 < 8


def test_sandbox_failure_is_masked_not_scored(monkeypatch):
    """A sandbox that cannot start (here: no interpreter) is a sandbox failure, not a score, and it is known at
    once: a warm sandbox whose server exits before it says "ready" does not hold the run for warm.READY_S."""
    from recipe.sandbox import warm

    monkeypatch.setattr(runner, "_backend", backend())  # chosen with the real interpreter, whatever ran before
    monkeypatch.setattr(warm, "_disabled", None)  # and warm sandboxes on again for the tests after this one
    monkeypatch.setattr(runner, "_interp", "/nonexistent/python3")
    t0 = time.monotonic()
    res = run_python("print(1)", limits=FAST)
    assert res.status == "sandbox_error" and res.sandbox_failed and res.returncode is None, res
    report = run_tests("print(1)", [{"input": "", "output": "1"}, {"fn": "f", "args": [], "expected": 1}], FAST)
    assert report.sandbox_error and report.results == ["sandbox_error"] * 2
    assert time.monotonic() - t0 < warm.READY_S / 3


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores")
def test_programs_of_a_pinned_caller_run_on_the_cores_it_names():
    """The RL trainer pins itself to core 0; the programs it scores must not be pinned there with it."""
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    before = os.sched_getaffinity(0)
    # a run on every core first: a warm sandbox started there must not take the pinned caller's runs after it
    assert run_python(code, "", Limits()).stdout.strip() == str(sorted(before))
    os.sched_setaffinity(0, {0})
    try:
        assert run_python(code, "", Limits()).stdout.strip() == "[0]"  # inherited by default
        runner.run_on_cores(before)
        assert run_python(code, "", Limits()).stdout.strip() == str(sorted(before))
        assert os.sched_getaffinity(0) == {0}  # the caller's own affinity is put back after the start
    finally:
        runner.run_on_cores(None)
        os.sched_setaffinity(0, before)


def _inside_module():
    """recipe/sandbox/_inside.py as a module (its _main runs only as `python -c`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sandbox_inside", Path(runner.__file__).with_name("_inside.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("without_c_encoder", [False, True])
def test_the_harness_writes_its_messages_as_json_dumps_would(without_c_encoder, monkeypatch):
    """The harness sends function results through json's C encoder without importing json (its import was a third
    of a short run): the same text as json.dumps, or the same error, for whatever a function may return."""
    dumps = _inside_module()._dumps
    if without_c_encoder:
        monkeypatch.setitem(sys.modules, "_json", None)  # no C encoder: json itself
    looped: list = [1]
    looped.append(looped)
    values = [None, True, 0, -7, 2 ** 80, 0.1, -0.0, 1e300, float("nan"), float("inf"), -float("inf"), "",
              'é \u2028 \x00 \" \\ \ud800 \U0001f600', [1, (2, [3.5, None])], {"a": {"b": []}, 1: 2, 2.5: "x", None: 0,
              False: True}, [[[[[[[[[[1]]]]]]]]]], 10 ** 5000, looped, {1, 2}, object(), {(1, 2): 3}, b"bytes"]
    for value in values:
        msg = {"i": 3, "value": value}
        try:
            want = json.dumps(msg)
        except (TypeError, ValueError) as e:
            with pytest.raises(type(e)) as got:
                dumps(msg)
            assert str(got.value) == str(e), value
        else:
            assert dumps(msg) == want, value


def test_a_run_imports_nothing_heavy_before_the_program():
    """Each sandboxed run starts an interpreter: the harness must not add json, re, enum or signal to what the
    interpreter imports by itself (site included), in either mode."""
    heavy = {"json", "re", "enum", "signal"}
    plain = subprocess.run([runner.interpreter(), *runner.PYTHON_FLAGS, "-c",
                            "import sys; print(' '.join(sys.modules))"],
                           capture_output=True, text=True, check=True, env={"PATH": runner.PATH}).stdout.split()
    probe = "sorted(m for m in sys.modules if m in {!r} and m not in {!r})".format(heavy, set(plain))
    res = run_python(f"import sys\nprint({probe})", "", FAST)
    assert res.status == "ok" and res.stdout.strip() == "[]", res
    report = run_tests(f"import sys\ndef f():\n    return {probe}", [{"fn": "f", "args": [], "expected": []}], FAST)
    assert report.results == ["pass"], report


def test_a_run_sees_the_standard_library_only_and_no_startup_code_of_the_host():
    """The sandbox's interpreter starts without site: no .pth file of the host's Python runs before the harness,
    and the program's import path holds the standard library alone, whatever the host has installed there.
    exit() and quit(), which site would have defined, still end the program as they do anywhere."""
    import sysconfig

    probe = ("import sys\n"
             "print('site' in sys.modules, sys.flags.no_site)\n"
             "print('\\n'.join(p for p in sys.path if p))\n")
    res = run_python(probe, "", FAST)
    assert res.status == "ok", res
    first, *paths = res.stdout.strip().splitlines()
    assert first == "False 1"
    stdlib = subprocess.run([runner.interpreter(), "-S", "-c", "import sysconfig; print(sysconfig.get_paths()"
                             "['stdlib'])"], capture_output=True, text=True, check=True).stdout.strip()
    assert paths and all("-packages" not in p for p in paths), paths
    assert stdlib in paths and sysconfig.get_paths()["purelib"] not in paths, paths
    for call, code in (("exit()", 0), ("quit()", 0), ("exit(3)", 3), ("quit(4)", 4)):
        res = run_python(f"print('before')\n{call}\nprint('after')", "", FAST)
        assert res.stdout == "before\n" and res.returncode == code, (call, res)
        assert res.status == ("ok" if code == 0 else "error"), (call, res)
    report = run_tests("exit(2)\ndef f():\n    return 1", [{"fn": "f", "args": [], "expected": 1}], FAST)
    assert report.results != ["pass"], report


def test_a_function_gets_the_json_values_of_its_arguments():
    """The payload travels as marshal, but the arguments a function is called with are still JSON's: a tuple
    arrives as a list and an integer key as a string, as they would from a tests file."""
    code = "def f(a, b):\n    return [type(a).__name__, sorted(b)]"
    report = run_tests(code, [{"fn": "f", "args": [(1, 2), {3: "x"}], "expected": ["list", ["3"]]}], FAST)
    assert report.results == ["pass"], report


def test_the_harness_runs_from_source_where_its_code_object_cannot_be_made(monkeypatch):
    """The harness normally starts from a code object its interpreter compiled once (runner.BOOT); where that
    failed, each run compiles the source, and runs the same."""
    monkeypatch.setitem(runner._harness_codes, runner.interpreter(), None)
    assert run_python("print(6 * 7)", "", FAST).stdout.strip() == "42"
    report = run_tests("def f(x):\n    return x + 1", [{"fn": "f", "args": [1], "expected": 2}], FAST)
    assert report.results == ["pass"], report


def test_a_limit_the_harness_cannot_set_stops_the_run_before_the_program(monkeypatch):
    """The rlimits are set by the harness on itself before anything of the program is compiled: one it cannot set
    is a sandbox failure (the sample is masked), never a program run without it."""
    real = runner._rlimits
    monkeypatch.setattr(runner, "_rlimits", lambda *a: {**real(*a), "no_such_limit": (1, 1)})
    res = run_python("open('/tmp/ran', 'w').write('x'); print('ran')", "", FAST)
    assert res.status == "sandbox_error" and "ran" not in res.stdout, res


def test_a_lower_limit_the_caller_inherited_holds(tmp_path):
    """Without root the harness cannot raise a limit above what its caller has: a caller whose hard limit is
    below the run's gets its own, the stricter one, and the run goes on."""
    script = ("import resource\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))\n"
              "from recipe.sandbox import run_python\n"
              "res = run_python('import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))')\n"
              "print(res.status, res.stdout.strip())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(runner.__file__).parents[2])
    assert out.stdout.strip() == "ok (40, 40)", out.stdout + out.stderr


# ----------------------------------------------------------------------------------------- warm sandboxes

def warm_box(limits: Limits):
    """The idle warm sandbox for runs of these limits (runner._execute_warm's key), or None."""
    from recipe.sandbox import warm

    idle = warm._idle.get(runner.warm_key(limits)) or []
    assert len(idle) <= 1, idle
    return idle[0] if idle else None


@pytest.fixture
def warm_bwrap(monkeypatch):
    from recipe.sandbox import warm

    use_backend(monkeypatch, "bwrap")
    monkeypatch.delenv(warm.SWITCH, raising=False)
    monkeypatch.setattr(warm, "_disabled", None)
    if not runner.warm_usable():
        pytest.skip("this bwrap cannot make / read-only and size its tmpfs: no warm sandboxes")
    warm.close_all()
    yield
    warm.close_all()


LEAVE_BEHIND = DAEMON.replace("import time; time.sleep(60)",  # it keeps writing into /tmp, if it lives
                              "import time\\nwhile True:\\n    time.sleep(0.01)\\n    try:\\n"
                              "        open(\\'/tmp/late\\', \\'w\\').write(\\'x\\')\\n    except OSError:\\n"
                              "        pass")
LEAVE_BEHIND += """
import sys
open('/tmp/left', 'w').write('x')
open('/dev/shm/left', 'w').write('x')
os.makedirs('/tmp/deep/er')
os.chmod('/tmp/deep', 0)
sys.leak = 'from the last run'
os.chmod('/tmp', 0)
"""
LOOK_AROUND = """
import os, sys
print('tmp', sorted(os.listdir('/tmp')), oct(os.stat('/tmp').st_mode & 0o7777))
print('shm', sorted(os.listdir('/dev/shm')))
others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
print('others', others)
print('leak', hasattr(sys, 'leak'))
"""


def test_a_warm_sandbox_is_reused_and_each_run_starts_clean(warm_bwrap, ctx):
    """A run that leaves a daemon writing into /tmp, files in /tmp and /dev/shm, a folder it cannot be read,
    /tmp without permissions and a changed interpreter: the next run in the same sandbox sees none of it."""
    first = run_python(marked(ctx.mark, ctx.fill(LEAVE_BEHIND)), "", FAST)
    assert first.status == "ok" and "detached" in first.stdout, first
    box = warm_box(FAST)
    assert box is not None and box.proc.poll() is None
    second = run_python(LOOK_AROUND, "", FAST)
    assert second.status == "ok", second
    assert out(second) == ["tmp [] 0o1777", "shm []", "others []", "leak False"], second
    assert warm_box(FAST) is box  # the same sandbox ran both
    assert_contained(second, ctx)


def test_a_warm_sandbox_its_program_killed_is_replaced(warm_bwrap):
    """A program that kills the sandbox's server: "killed", its own verdict (the run had started), never a
    sandbox failure; the next run gets a new sandbox."""
    assert run_python("print(1)", "", FAST).status == "ok"
    box = warm_box(FAST)
    res = run_python("import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(5)", "", FAST)
    assert res.status == "killed" and not res.sandbox_failed, res
    assert box.proc.poll() is not None and warm_box(FAST) is None
    again = run_python("print(2)", "", FAST)
    assert again.status == "ok" and again.stdout == "2\n", again
    assert warm_box(FAST) not in (None, box)


def test_a_warm_sandbox_is_ended_after_a_timeout(warm_bwrap):
    res = run_python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(30)", "",
                     ONE_S)
    assert res.status == "timeout" and warm_box(ONE_S) is None, res
    assert run_python("print(3)", "", ONE_S).stdout == "3\n"


EXITS = [
    ("import threading, time, atexit\natexit.register(lambda: print('atexit'))\n"
     "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\nprint('main')", 0,
     ["main", "thread", "atexit"]),
    ("import sys\nprint('a', end='')\nsys.exit(3)", 3, ["a"]),
    ("import sys\nsys.exit('a message')", 1, []),
    ("raise ValueError('boom')", 1, []),
    ("import os\nprint('lost', end='')\nos._exit(4)", 4, []),
    ("import sys\nsys.stdout.write('x' * 100000)", 0, ["x" * 65536]),
]


@pytest.mark.parametrize("warm_on", [True, False], ids=["warm", "cold"])
def test_a_run_ends_as_an_interpreter_would(warm_on, warm_bwrap, monkeypatch):
    """Threads joined, atexit functions, exit codes and messages, buffered output: the same in a warm sandbox as
    in a cold one (a fresh interpreter)."""
    from recipe.sandbox import warm

    if not warm_on:
        monkeypatch.setenv(warm.SWITCH, "0")
    for code, rc, lines in EXITS:
        res = run_python(code, "", FAST)
        assert res.returncode == rc and out(res) == lines, (code, res)
        if "message" in code or "boom" in code:
            assert res.status == "error" and ("a message" in res.stderr or "ValueError: boom" in res.stderr), res
    assert (warm_box(FAST) is None) != warm_on


@pytest.mark.parametrize("name", ["cpu_burn", "background_shells", "memory_bomb",
                                  "daemon_setsid_double_fork_empty_env", "read_runs_hidden_tests", "net_socket_module",
                                  "kill_minus_one", "see_host_processes"])
def test_cold_bwrap_runs_still_contain(name, warm_bwrap, ctx, monkeypatch):
    """RECIPE_SANDBOX_WARM=0 (or a bwrap that cannot host warm sandboxes): a sandbox per run, as before."""
    from recipe.sandbox import warm

    monkeypatch.setenv(warm.SWITCH, "0")
    monkeypatch.setenv("RECIPE_TEST_SECRET", SECRET)
    prog = next(h for h in HOSTILE if h.name == name)
    code = ctx.fill(prog.code)
    res = run_python(marked(ctx.mark, code) if prog.marked else code, "", prog.limits)
    assert prog.check(res, ctx) is True, res
    assert_contained(res, ctx)
    assert warm_box(prog.limits) is None


def test_an_idle_warm_sandbox_that_died_is_replaced_without_a_sandbox_failure(warm_bwrap):
    assert run_python("print(1)", "", FAST).status == "ok"
    box = warm_box(FAST)
    os.killpg(box.proc.pid, 9)  # from outside, while it waits for a run
    box.proc.wait()
    res = run_python("print(2)", "", FAST)
    assert res.status == "ok" and res.stdout == "2\n", res
    assert warm_box(FAST) not in (None, box)


def test_the_cpu_of_warm_sandboxes_is_counted_while_they_are_up(warm_bwrap):
    """os.times counts a warm sandbox's runs only once it has ended; warm.cpu_s counts them now (the eval's
    thread governor takes them for its own work, as it takes a cold run it has reaped)."""
    from recipe.sandbox import warm

    before = warm.cpu_s()
    res = run_python("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass", "",
                     Limits(cpu_s=2, wall_s=5))
    assert res.status == "ok", res
    assert warm.cpu_s() - before >= 0.35  # /proc counts in clock ticks
