# Runs inside the sandbox, before the model's program, as `python -c <this> MODE CTL_FD PAYLOAD_FD`.
# It reads the payload (code, and for MODE "fn" the test cases), says "started" on the control pipe (so the host
# can tell a sandbox that never came up from a program that failed), then runs the program as __main__, and in
# MODE "fn" calls its function on each case. Expected answers never come in here: the host compares.
import os
import sys


def _send(fd, obj):
    import json

    data = ((obj if isinstance(obj, str) else json.dumps(obj)) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _block_network():
    # rlimit fallback only (bwrap has no network at all): a weak guard that a determined program can get around.
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for name in ("socket", "SocketType", "create_connection", "create_server", "socketpair", "fromfd",
                 "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        setattr(socket, name, refuse)
    import _socket

    for name in ("socket", "SocketType", "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        setattr(_socket, name, refuse)


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
    import json
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
                line = json.dumps({"i": i, "value": value})
                if len(line) > payload["max_result_bytes"]:
                    line = json.dumps({"i": i, "error": f"result larger than {payload['max_result_bytes']} bytes"})
            except (TypeError, ValueError, RecursionError) as e:
                line = json.dumps({"i": i, "error": "result is not JSON-serializable: " + _describe(e)})
            _send(ctl, line)
        except Limit as e:
            _send(ctl, {"i": i, "timeout": str(e)})
        except MemoryError:
            _send(ctl, {"i": i, "memory": True})
        except BaseException as e:
            _send(ctl, {"i": i, "error": _describe(e)})


def _main():
    mode, ctl, src = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunks = []
    while True:
        chunk = os.read(src, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(src)
    import json

    payload = json.loads(b"".join(chunks))
    if payload.get("block_network"):
        _block_network()
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


_main()
