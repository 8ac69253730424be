# Runs inside the sandbox, before the model's program, as `python -c <this> MODE CTL_FD PAYLOAD_FD` (or from its
# code object: runner.BOOT). It reads the payload (code, and for MODE "fn" the test cases) and sets the run's
# rlimits on itself (payload "rlimits"; a failure stops the run before the program); under the unshare backend it
# then builds the sandbox's root (payload "setup"), stays behind as the pid namespace's init and runs the rest in a
# child; it installs the seccomp filter (payload "seccomp"; bwrap installs it itself), says "started" on the
# control pipe (so the host can tell a sandbox that never came up from a program that failed), then runs the
# program as __main__, and in MODE "fn" calls its function on each case. Expected answers never come in here: the
# host compares.
# As `python -c <this> serve SOCK_FD` it is a warm sandbox's server (warm.py): for each run the host sends on the
# socket the mode and the payload with the run's stdin, stdout, stderr and control pipe; the server forks a child
# that does what is said above (the sandbox and its filter are already up), waits for it, kills every other
# process of the sandbox, empties /tmp and /dev/shm, and only then answers with the child's status.
# Every sandboxed run starts an interpreter, so what this file imports is paid on every run: the payload comes as
# marshal (the host writes it), messages go out through the C encoder json.dumps itself uses, and the timers come
# from signal's C core. `import json` (re and its patterns) and `import signal` (enum) were about a third of a
# short run's CPU.
import marshal
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
KEPT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # and the atime ones: a remount must keep them
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
NOBODY = 65534


def _dumps(obj):
    """json.dumps(obj), byte for byte, without importing json: its C encoder with json.dumps's defaults (ASCII,
    ", " and ": ", NaN allowed, cycles checked); json itself where that encoder is missing or takes other
    arguments."""
    try:
        import _json

        def default(o):
            raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")
        encode = _json.make_encoder({}, default, _json.encode_basestring_ascii, None, ": ", ", ", False, False, True)
    except (ImportError, AttributeError, TypeError):
        import json

        return json.dumps(obj)
    return "".join(encode(obj, 0))


def _send(fd, obj):
    data = ((obj if isinstance(obj, str) else _dumps(obj)) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(what, ret):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    return ctypes, libc, call


def prctl(libc, option, *args):
    import ctypes

    args = (args + (0, 0, 0, 0))[:4]  # unused arguments must be 0, as whole words
    return libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(a) for a in args))


def _build_root(setup):
    # unshare backend, as root of the run's new user namespace (no power outside it): a root of its own like
    # bwrap's, then the old one detached, so nothing of the host's file system stays reachable
    ctypes, libc, call = _libc()
    enc = lambda s: None if s is None else s.encode()  # noqa: E731

    def mount(src, dst, fstype=None, flags=0, data=None):
        call(f"mount {dst}", libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)))

    def read_only(path, extra=MS_NOSUID | MS_NODEV):
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (os.statvfs(path).f_flag & KEPT_FLAGS) | extra)

    def bind(src, dst):
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        mount(src, dst, None, MS_BIND)

    mount("tmpfs", setup["at"], "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.chdir(setup["at"])
    os.mkdir("oldroot")
    call("pivot_root", libc.syscall(setup["pivot_root"], b".", b"oldroot"))
    os.chdir("/")
    for kind, path, *arg in setup["layout"]:
        if kind == "bind":
            bind("/oldroot" + path, path)
            read_only(path)
        elif kind == "link":
            os.symlink(path, arg[0])
        elif kind == "proc":
            os.mkdir(path)
            mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "dev":
            os.mkdir(path)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
            for name in DEVICES:
                if os.path.exists("/oldroot/dev/" + name):
                    bind("/oldroot/dev/" + name, f"{path}/{name}")
            for i, name in enumerate(("stdin", "stdout", "stderr")):
                os.symlink(f"/proc/self/fd/{i}", f"{path}/{name}")
            os.symlink("/proc/self/fd", f"{path}/fd")
        elif kind == "tmpfs":
            os.makedirs(path, exist_ok=True)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={arg[0]},mode=1777")
        elif kind == "ro":
            read_only(path, MS_NOSUID | MS_NOEXEC)
    call("umount oldroot", libc.umount2(b"/oldroot", 2))  # MNT_DETACH
    os.rmdir("/oldroot")
    read_only("/")
    libc.sethostname(b"sandbox", 7)
    prctl(libc, 4, 0)  # PR_SET_DUMPABLE 0: the program cannot read or trace this init
    child = os.fork()
    if child:  # the namespace's init: when it exits the kernel ends every process left in the namespace
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)  # an init ignores what the namespace sends it, unless handled
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    # the program: uid nobody of a nested user namespace that owns nothing, without any capability
    call("unshare", libc.unshare(0x10000000))  # CLONE_NEWUSER
    for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} 0 1"), ("gid_map", f"{NOBODY} 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # capset v3: no capability at all
    call("capset", libc.capset(header, (ctypes.c_uint32 * 6)()))
    os.chdir("/tmp")


def _install_filter(program):
    # what bwrap --seccomp does: no new privileges, then the filter (struct sock_fprog: length, pointer)
    ctypes, libc, call = _libc()

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    call("no_new_privs", prctl(libc, 38, 1))
    prog = Prog(len(program) // 8, program)
    call("seccomp", prctl(libc, 22, 2, ctypes.addressof(prog)))  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _print_exc(e, frames=True):
    try:
        import traceback

        if frames:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        else:
            sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        sys.stderr.flush()
    except BaseException:  # printing can itself fail out of memory; the type name is what the host needs
        os.write(2, f"\n{type(e).__name__}\n".encode())


def _describe(e):
    return f"{type(e).__name__}: {e}"[:300]


def _harness(ctl, ns, payload):
    try:
        import _signal as signal  # the C core of the signal module: the same functions and numbers
    except ImportError:
        import signal

    name = payload["fn"]
    target = ns.get(name)
    if not callable(target):
        cls = ns.get("Solution")  # LeetCode style, as LiveCodeBench's functional problems are
        if isinstance(cls, type) and callable(getattr(cls, name, None)):
            target = lambda *a: getattr(cls(), name)(*a)  # noqa: E731
        else:
            _send(ctl, {"fatal": f"function {name!r} is not defined"})
            return

    class Limit(BaseException):  # BaseException: a program's `except Exception` does not swallow it
        pass

    def expire(signum, frame):
        raise Limit("wall" if signum == signal.SIGALRM else "cpu")

    signal.signal(signal.SIGALRM, expire)
    signal.signal(signal.SIGPROF, expire)
    for i, args in payload["cases"]:
        _send(ctl, {"begin": i})
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, payload["case_wall_s"])
                signal.setitimer(signal.ITIMER_PROF, payload["case_cpu_s"])
                value = target(*args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.setitimer(signal.ITIMER_PROF, 0)
            try:
                line = _dumps({"i": i, "value": value})
                if len(line) > payload["max_result_bytes"]:
                    line = _dumps({"i": i, "error": f"result larger than {payload['max_result_bytes']} bytes"})
            except (TypeError, ValueError, RecursionError) as e:
                line = _dumps({"i": i, "error": "result is not JSON-serializable: " + _describe(e)})
            _send(ctl, line)
        except Limit as e:
            _send(ctl, {"i": i, "timeout": str(e)})
        except MemoryError:
            _send(ctl, {"i": i, "memory": True})
        except BaseException as e:
            _send(ctl, {"i": i, "error": _describe(e)})


def _quitter(name):
    """exit() and quit() as site defines them: close stdin, then raise SystemExit(code)."""
    def leave(code=None):
        try:
            sys.stdin.close()
        except BaseException:
            pass
        raise SystemExit(code)

    leave.__name__ = leave.__qualname__ = name
    return leave


def _main():
    if sys.argv[1] == "serve":
        _serve(int(sys.argv[2]))
        return
    mode, ctl, src = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunks = []
    while True:
        chunk = os.read(src, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(src)
    _run(mode, ctl, marshal.loads(b"".join(chunks)))


def _run(mode, ctl, payload):
    import resource  # the run's limits, on this process and all it starts, before anything of the program

    for name, soft, hard in payload["rlimits"]:
        which = getattr(resource, name)
        ceiling = resource.getrlimit(which)[1]  # above what it inherits it cannot go: the lower one holds
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))
    if payload.get("setup"):
        _build_root(payload["setup"])
    if payload.get("seccomp"):
        _install_filter(bytes.fromhex(payload["seccomp"]))
    os.set_inheritable(ctl, False)  # a shell the program starts must not hold the host's pipe open
    _send(ctl, {"started": True})
    try:
        code = compile(payload["code"], "solution.py", "exec")
    except BaseException as e:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        _send(ctl, {"compile_error": _describe(e)})
        _print_exc(e, frames=False)
        sys.exit(1)
    if mode == "script":
        os.close(ctl)
    import builtins
    import types

    # MODE "fn" imports the program as a module, so its `if __name__ == "__main__":` part stays out of the tests
    module = types.ModuleType("__main__" if mode == "script" else "solution")
    module.__file__ = "solution.py"
    module.__builtins__ = builtins
    for name in ("exit", "quit"):  # site's, which this interpreter (-S) did not import
        if not hasattr(builtins, name):
            setattr(builtins, name, _quitter(name))
    sys.modules[module.__name__] = module
    sys.argv = ["solution.py"]
    try:
        exec(code, module.__dict__)
    except SystemExit as e:
        if mode == "fn":
            _send(ctl, {"fatal": f"the program exited (code {e.code!r}) before any test"})
        raise
    except BaseException as e:
        if mode == "fn":
            _send(ctl, {"fatal": "the program failed before any test: " + _describe(e)})
        _print_exc(e)
        sys.exit(1)
    if mode == "fn":
        sys.stdout.flush()
        _harness(ctl, module.__dict__, payload)


# ------------------------------------------------------------------------------------ a warm sandbox's server

CTL_FD = 3  # where a warm run's control pipe sits in its process
RUN_FDS = 4  # stdin, stdout, stderr and the control pipe, in that order


def _serve(sock_fd):
    import _socket
    import array

    ctypes, libc, call = _libc()
    prctl(libc, 4, 0)  # PR_SET_DUMPABLE 0: a run cannot read or write this server's memory through /proc
    sock = _socket.socket(fileno=sock_fd)
    sock.sendall(b'{"ready": true}\n')
    fd_room = _socket.CMSG_SPACE(RUN_FDS * array.array("i").itemsize)
    while True:
        data, anc, _, _ = sock.recvmsg(8, fd_room)
        fds = array.array("i")
        for level, kind, blob in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.frombytes(blob[:len(blob) - len(blob) % fds.itemsize])
        while data and len(data) < 8:
            more = sock.recv(8 - len(data))
            if not more:
                break
            data += more
        if len(data) < 8 or len(fds) != RUN_FDS:
            os._exit(0)  # the host closed the socket (or broke the protocol): the sandbox ends
        size, parts = int.from_bytes(data, "little"), []
        while size:
            part = sock.recv(min(size, 1 << 20))
            if not part:
                os._exit(0)
            parts.append(part)
            size -= len(part)
        mode, payload = marshal.loads(b"".join(parts))
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(libc, list(fds), mode, payload)
        for fd in fds:
            os.close(fd)
        _, status, usage = os.wait4(pid, 0)
        try:
            os.kill(-1, 9)  # SIGKILL to every process of this pid namespace but its init and this server
        except OSError:
            pass
        clean = _settled() and _empty("/tmp") and _empty("/dev/shm")
        reply = {"status": status, "cpu": usage.ru_utime + usage.ru_stime, "clean": clean}
        sock.sendall((_dumps(reply) + "\n").encode())


def _settled(timeout_s=2.0):
    """Every process but the namespace's init and this server is gone, reaped by the init: a killed process may
    still finish the system call it was in (a write to /tmp, say), and one not yet reaped still counts against the
    next run's RLIMIT_NPROC. Only then is /tmp emptied. False if one is still there."""
    import time

    me, until = os.getpid(), time.monotonic() + timeout_s
    while any(name.isdigit() and int(name) not in (1, me) for name in os.listdir("/proc")):
        if time.monotonic() > until:
            return False
        time.sleep(0.0005)
    return True


def _empty(top):
    """Everything a run left under top removed, and top's mode as the sandbox made it; False where that failed
    (the host then ends this sandbox rather than start another run in it)."""
    def remove_all(path):
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                remove_all(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
    try:
        os.chmod(top, 0o1777)
        remove_all(top)
        return True
    except BaseException:  # OSError, RecursionError (folders nested past the stack), MemoryError
        return False


def _child(libc, fds, mode, payload):
    """A forked run: its pipes on 0, 1, 2 and CTL_FD, nothing else of the server's open, then _run; it leaves as
    an interpreter would (threads joined, atexit functions, streams flushed) and never returns to the server."""
    code = 1
    try:
        for target, fd in enumerate(fds):  # the fds came in above 2, in order: only the first can be 3
            os.dup2(fd, target)
        os.closerange(RUN_FDS, 1 << 16)
        prctl(libc, 4, 1)  # dumpable again, as a fresh process is: its own /proc entries are its own
        os.setsid()  # a process group of its own: a program that signals its group does not reach the server
        os.chdir("/tmp")
        try:
            _run(mode, CTL_FD, payload)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code & 0xFF
            else:
                sys.stderr.write(f"{e.code}\n")
        try:
            if "threading" in sys.modules:
                sys.modules["threading"]._shutdown()
            import atexit

            atexit._run_exitfuncs()
        except BaseException as e:
            _print_exc(e)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                code = code or 120  # what an interpreter exits with when it cannot flush at its end
    except BaseException as e:
        _print_exc(e)
    finally:
        os._exit(code)


if __name__ == "__main__":  # as `python -c`; tests import the file for _dumps
    _main()
