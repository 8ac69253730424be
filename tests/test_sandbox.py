"""The sandbox against hostile programs: each must be contained, end with a verdict that scores it 0 (never a
sandbox failure, which would mask it), leave no process or file behind on the host, and the next run must work.
The core attacks run under both backends (bwrap when it works here, and the rlimit fallback)."""
import json
import os
import resource
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from recipe.sandbox import Limits, TestReport, backend, run_python, run_tests
from recipe.sandbox import runner

ROOT = Path(__file__).resolve().parent.parent
FAST = Limits(cpu_s=1, wall_s=2)
SECRET = "recipe-secret-" + uuid.uuid4().hex


@pytest.fixture(params=["bwrap", "rlimit"])
def each_backend(request, monkeypatch):
    if request.param == "bwrap" and backend() != "bwrap":
        pytest.skip("bubblewrap does not work here")
    monkeypatch.setattr(runner, "_backend", request.param)
    return request.param


def needs_other_uid(backend_name: str) -> None:
    if backend_name == "rlimit" and os.geteuid() != 0:
        pytest.skip("the rlimit fallback without root runs code as the caller's own uid, so it cannot guard that "
                    "uid's files, processes or environment (install bubblewrap)")


@pytest.fixture
def outside(tmp_path):
    """A folder of the host's, outside the sandbox, with a file the program must not change."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "sentinel").write_text("untouched")
    return d


def marker() -> str:
    return "sbx-" + uuid.uuid4().hex[:12]


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


def assert_contained(res, mark: str | None = None, outside: Path | None = None):
    """Not masked, nothing of the program left running, the host's file unchanged, and the sandbox still works."""
    assert not res.sandbox_failed, res
    assert res.reason
    if mark:
        deadline = time.monotonic() + 2  # a killed pid namespace is torn down by the kernel a moment later
        while processes_with(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(mark) == []
    if outside:
        assert sorted(p.name for p in outside.iterdir()) == ["sentinel"]
        assert (outside / "sentinel").read_text() == "untouched"
    again = run_python("print(int(input()) * 2)", "21", FAST)
    assert again.status == "ok" and again.stdout == "42\n", again


# ------------------------------------------------------------------------------------------- hostile programs

def test_infinite_loop():
    mark = marker()
    res = run_python(marked(mark, "while True: pass"), limits=FAST)
    assert res.status == "timeout" and "cpu" in res.reason, res
    assert_contained(res, mark)


def test_sleep_past_wall_limit():
    mark = marker()
    res = run_python(marked(mark, "import time; time.sleep(60)"), limits=Limits(wall_s=1))
    assert res.status == "timeout" and "wall" in res.reason, res
    assert res.wall_s < 2.5
    assert_contained(res, mark)


def test_fork_bomb(each_backend):
    mark = marker()
    uid = runner._sandbox_uid() if runner._sandbox_uid() is not None else os.getuid()
    base, peak, done = runner._tasks_of(uid), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], runner._tasks_of(uid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    try:
        res = run_python(marked(mark, body), limits=Limits(cpu_s=1, wall_s=2, max_procs=16))
    finally:
        done.set()
        watcher.join()
    assert res.status in ("timeout", "killed"), res
    assert peak[0] - base <= 16 + 2, f"{peak[0] - base} tasks at once"
    assert_contained(res, mark)


def test_memory_bomb():
    res = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))", limits=FAST)
    assert res.status == "memory", res
    assert_contained(res)


class Listener:
    """A server on the host's loopback: the program must never reach it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self.loop)
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
        time.sleep(0.3)
        self.stop = True
        self.thread.join()
        self.sock.close()


def test_network_to_host_loopback(each_backend):
    server = Listener()
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {server.port}), timeout=1)\n"
                "s.sendall(b'leak')\nprint('connected')")
        res = run_python(code, limits=FAST)
    finally:
        server.close()
    assert res.status == "error" and "connected" not in res.stdout, res
    assert server.accepted == 0
    assert_contained(res)


def test_network_to_external_address(each_backend):
    code = ("import socket\n"
            "for host in ('1.1.1.1', '8.8.8.8'):\n"
            "    try:\n"
            "        socket.create_connection((host, 53), timeout=1); print('connected', host)\n"
            "    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n"
            "socket.getaddrinfo('example.com', 443)\nprint('resolved')")
    res = run_python(code, limits=Limits(wall_s=4))
    assert res.stdout.count("blocked") == 2 and "connected" not in res.stdout, res
    assert res.status == "error" and "resolved" not in res.stdout, res
    assert_contained(res)


def test_write_outside_its_folder(each_backend, outside):
    needs_other_uid(each_backend)
    escape = ROOT / f"escape-{uuid.uuid4().hex[:8]}.txt"
    code = ("import os\n"
            f"for path in [{str(outside / 'sentinel')!r}, {str(outside / 'new')!r}, {str(escape)!r}, '/usr/x']:\n"
            "    try:\n"
            "        open(path, 'w').write('pwned'); print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('denied', path, type(e).__name__)\n"
            "open('mine.txt', 'w').write('fine'); print('own folder ok')")
    res = run_python(code, limits=FAST)
    assert res.status == "ok" and "own folder ok" in res.stdout, res
    assert not escape.exists() and not Path("/usr/x").exists()
    assert_contained(res, outside=outside)


def test_parent_environment_secrets(each_backend, monkeypatch):
    needs_other_uid(each_backend)
    monkeypatch.setenv("RECIPE_TEST_SECRET", SECRET)
    code = ("import os, subprocess\n"
            "print(dict(os.environ))\n"
            "for pid in ['self', str(os.getppid()), '1'] + os.listdir('/proc'):\n"
            "    try:\n"
            "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except (OSError, ValueError):\n"
            "        pass\n"
            "subprocess.run(['sh', '-c', 'env; echo secret=$RECIPE_TEST_SECRET'])")
    res = run_python(code, limits=Limits(wall_s=4, output_bytes=1 << 20))
    assert res.status == "ok" and "PATH=" in res.stdout, res
    assert SECRET not in res.stdout + res.stderr and not res.truncated
    assert_contained(res)


def test_huge_output_is_cut():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n    sys.stderr.write('y' * 65536)"
    res = run_python(code, limits=Limits(cpu_s=1, wall_s=2, output_bytes=4096))
    assert res.truncated and len(res.stdout) <= 4096 and len(res.stderr) <= 4096, res.reason
    assert res.status == "timeout", res.reason
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: nothing was buffered
    assert_contained(res)


def test_spawned_shell_is_contained(each_backend, outside, monkeypatch):
    needs_other_uid(each_backend)
    monkeypatch.setenv("RECIPE_TEST_SECRET", SECRET)
    mark = marker()
    code = ("import os, subprocess\n"
            f"os.system(\"sh -c 'echo pwned > {outside}/pwned; echo pwned > {outside}/sentinel; env'\")\n"
            # background children, one in a session of its own: all must die with the run
            f"subprocess.Popen(['sh', '-c', 'sleep 30; : {mark}'])\n"
            f"subprocess.Popen(['sh', '-c', 'sleep 30; : {mark}'], start_new_session=True)\n"
            "print('spawned')")
    res = run_python(code, limits=FAST)
    assert "spawned" in res.stdout and SECRET not in res.stdout + res.stderr, res
    assert_contained(res, mark, outside)


def test_killing_its_parent(each_backend):
    needs_other_uid(each_backend)
    mark = marker()
    # kill(-1): every process the uid may signal. Inside bwrap that is its own namespace; under the fallback it
    # would be every uid-nobody process on the host, so that one is left out there.
    targets = "[os.getppid(), -1]" if each_backend == "bwrap" else "[os.getppid()]"
    body = ("import os, signal\n"
            f"for target in {targets}:\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)\n"
            "print('still here')")
    res = run_python(marked(mark, body), limits=FAST)
    os.kill(os.getpid(), 0)
    os.kill(os.getppid(), 0)  # the test run and its parent survived
    assert res.status in ("ok", "error", "killed"), res
    assert_contained(res, mark)


def test_filling_the_disk():
    before = set(Path(tempfile.gettempdir()).glob("recipe-sandbox-*"))
    code = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))"
    res = run_python(code, limits=Limits(cpu_s=1, wall_s=2, file_mb=2))
    assert res.status == "error" and "File too large" in res.reason, res
    assert set(Path(tempfile.gettempdir()).glob("recipe-sandbox-*")) == before  # its folder is gone
    assert_contained(res)


def test_filling_the_disk_with_many_files():
    if backend() != "bwrap":
        pytest.skip("only bwrap bounds the total: the rlimit fallback bounds each file")
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20)); i += 1"
    res = run_python(code, limits=Limits(cpu_s=1, wall_s=2, file_mb=2))
    assert res.status == "error" and "No space left" in res.reason, res
    assert_contained(res)


def test_deep_recursion():
    res = run_python("def f(n):\n    return f(n + 1)\nf(0)", limits=FAST)
    assert res.status == "error" and "RecursionError" in res.reason, res
    # without the interpreter's guard: frames pile up until a limit (stack, memory or CPU) ends the process
    res = run_python("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)", limits=FAST)
    assert res.status in ("killed", "memory", "error", "timeout"), res
    assert_contained(res)


def test_program_cannot_fake_a_sandbox_failure():
    fakes = ["import sys\nsys.stderr.write('bwrap: Creating new namespace failed\\n'); sys.exit(1)",
             "import os\nos.closerange(0, 1024)\nos._exit(1)",
             "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
             "import os\nos.write(3, b'{\"started\": false}\\n'); os._exit(1)"]
    for code in fakes:
        res = run_python(code, limits=FAST)
        assert res.status in ("error", "killed") and not res.sandbox_failed, res
    report = run_tests(fakes[0], [{"input": "", "output": "x"}, {"fn": "f", "args": [], "expected": 1}], FAST)
    assert report.sandbox_error is None and report.passed == 0


def test_functional_side_channel_abuse():
    # the program finds the harness's pipe and floods it with junk, deep nesting and forged results
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
    monkeypatch.setattr(runner, "_interp", "/nonexistent/python3")
    res = run_python("print(1)", limits=FAST)
    assert res.status == "sandbox_error" and res.sandbox_failed and res.returncode is None, res
    report = run_tests("print(1)", [{"input": "", "output": "1"}, {"fn": "f", "args": [], "expected": 1}], FAST)
    assert report.sandbox_error and report.results == ["sandbox_error"] * 2


def test_backend_and_results_are_plain_data():
    assert backend() in ("bwrap", "rlimit")
    if not os.environ.get("RECIPE_SANDBOX") and runner.shutil.which("bwrap") and runner._probe_bwrap() is None:
        assert backend() == "bwrap"
    res = run_python("import sys\nprint(sys.stdin.read().upper(), end='')\nexit(0)", "abc", FAST)
    assert (res.status, res.returncode, res.stdout, res.truncated) == ("ok", 0, "ABC", False)
    json.dumps(res.__dict__)


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores")
def test_programs_of_a_pinned_caller_run_on_the_cores_it_names():
    """The RL trainer pins itself to core 0; the programs it scores must not be pinned there with it."""
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        assert run_python(code, "", Limits()).stdout.strip() == "[0]"  # inherited by default
        runner.run_on_cores(before)
        assert run_python(code, "", Limits()).stdout.strip() == str(sorted(before))
    finally:
        runner.run_on_cores(None)
        os.sched_setaffinity(0, before)
