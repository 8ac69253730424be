"""VLLMEngine: the Engine contract (recipe.inference.engine) over HTTP to one vLLM server or several.

    submit([Request]) ; poll(timeout) -> Done | Cancelled | None ; cancel([request id]) ;
    update_weights(path, version) ; policy_version ; close() ; and generate(prompts, params) -> [Completion]
    for the eval runner.

It starts its own server (server.ServerProcess) or, with launch=False, speaks to servers already running (the
SLURM launcher's, one per inference node): requests go round-robin, weight updates go to every one. Requests
are sent from a pool of daemon threads, at most rl.gen_batch_size at a time. Only the standard library speaks
HTTP (server.request).

What the requests rely on in vLLM 0.32 (read in vllm-project/vllm):
- POST /v1/completions accepts `prompt` as a list of token ids. With `logprobs` set (0 will do: the sampled
  token's own logprob always comes; serving_completion only checks `request.logprobs is not None`) and
  `return_tokens_as_token_ids`, choices[0].logprobs.tokens are "token_id:N" strings and token_logprobs their
  logprobs; the stop token that ended a sequence is among them, as in HFEngine. `top_k: -1` means no top-k.
  Every request carries its max_tokens, temperature, top_p and top_k, so a server's defaults (--generation-config)
  reach only what a request leaves out (min_p, repetition_penalty).
- POST /collective_rpc ({"method", "args", "kwargs", "timeout"} -> {"results": [one per worker]};
  vllm/entrypoints/serve/rpc/api_router.py) runs worker_ext.WeightLoaderExtension's RELOAD_METHOD on every
  worker.
- POST /reset_prefix_cache?reset_running_requests=true (vllm/entrypoints/serve/cache/api_router.py). Without the
  flag the scheduler's reset does nothing while any request holds KV blocks (SchedulerInterface docstring), which
  in asynchronous RL is always; with it, running requests are preempted and recomputed on the new weights.
- GET /v1/models lists the served model with its `max_model_len` (OpenAIServingModels.show_available_models): the
  longest prompt plus max_tokens the server takes (it answers HTTP 400 to a longer request). `context` reads it,
  so that callers leave out what cannot fit instead of failing on it.

cancel() drops a request not sent yet, and closes the connection of one on a server: vLLM's route handlers are
wrapped in with_cancellation (vllm/entrypoints/utils.py), which aborts the request when its client goes. With
rl.staleness=prime_rl the client cancels nothing by itself: the orchestrator decides (recipe/rl/orchestrator.py).

The admin calls (the weight reload, the prefix-cache reset) are retried with backoff when the server is
unreachable or answers 5xx (server.retry: RETRY_TRIES calls, RETRY_BASE_DELAY_S doubling); reloading the same
file twice is harmless. An HTTP 4xx is raised at once. Completion requests are sent once: a repeat could sample
the same request twice.
"""
from __future__ import annotations

import atexit
import itertools
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from recipe.chat import stop_token_ids
from recipe.inference.engine import Cancelled, Done, Event, Request
from recipe.inference.vllm.server import (SERVED_MODEL_NAME, ServerProcess, TimedOut, Unavailable, read_context,
                                          read_stop_ids, request, request_abortable, retry, server_command,
                                          wait_healthy)
from recipe.inference.vllm.worker_ext import RELOAD_METHOD
from recipe.rollout import Completion, SamplingParams

LOGPROBS = 0  # top alternatives per token; the sampled token's own logprob comes regardless
TOKEN_PREFIX = "token_id:"
CONNECT_TIMEOUT_S = 60.0  # launch=False: how long servers already started get to answer /health


# -- requests and responses -------------------------------------------------------------------------------
def completion_body(prompt_ids, params: SamplingParams, stop_ids=(), seed: int | None = None) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "seed": int(params.seed if seed is None else seed),
        "n": 1,
        "logprobs": LOGPROBS,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "stop_token_ids": [int(t) for t in stop_ids],
    }


def parse_completion(response: dict, policy_version: int = 0) -> Completion:
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"expected one choice in the completion response, got {len(choices)}")
    choice = choices[0]
    lp = choice.get("logprobs")
    if not lp or lp.get("tokens") is None or lp.get("token_logprobs") is None:
        raise ValueError("the completion response has no logprobs (was `logprobs` sent?)")
    tokens, logprobs = lp["tokens"], lp["token_logprobs"]
    if len(tokens) != len(logprobs):
        raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs in the completion response")
    ids = []
    for tok in tokens:
        if not isinstance(tok, str) or not tok.startswith(TOKEN_PREFIX):
            raise ValueError(f"completion token {tok!r} is not '{TOKEN_PREFIX}N' "
                             "(was `return_tokens_as_token_ids` sent?)")
        ids.append(int(tok[len(TOKEN_PREFIX):]))
    if any(v is None for v in logprobs):
        raise ValueError("the completion response lacks the logprob of a sampled token")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise ValueError(f"unexpected finish_reason {reason!r} in the completion response")
    return Completion(token_ids=ids, logprobs=[float(v) for v in logprobs], finish_reason=reason,
                      policy_version=policy_version)


# -- the engine -------------------------------------------------------------------------------------------
class VLLMEngine:
    """A vLLM server child process (or, with launch=False, the servers already running at base_url)."""

    def __init__(self, model_path, cfg, version: int = 0, *, log_path=None, launch: bool = True,
                 base_url: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 stop_ids: list[int] | None = None, startup_timeout: float = 1200.0,
                 request_timeout: float = 3600.0, rpc_timeout: float = 1800.0, command: list[str] | None = None,
                 generation_config: str = "vllm"):
        self.model_path = str(model_path)
        rl = cfg.rl
        # rl.staleness=prime_rl: the orchestrator cancels what is too old (Engine.cancel); the client never does
        self.max_off_policy_steps = None if getattr(rl, "staleness", "drop_stale") == "prime_rl" else \
            int(rl.max_off_policy_steps)
        self.policy_version = int(version)
        self._tokenizer = None
        self._context: int | None = None
        self.stop_ids = list(self._default_stop_ids() if stop_ids is None else stop_ids)
        self.request_timeout = request_timeout
        self.rpc_timeout = rpc_timeout
        port = int(rl.vllm_port if port is None else port)
        # launch=False may name several servers, comma-separated (as the SLURM launcher passes them)
        self.base_urls = [u.strip().rstrip("/") for u in (base_url or f"http://{host}:{port}").split(",") if u.strip()]
        self.base_url = self.base_urls[0]
        self._next_server = itertools.count()
        self._events: queue.Queue = queue.Queue()  # Done, Cancelled, or an exception for poll() to raise
        self._stash: deque = deque()
        self._pool = _DaemonPool(rl.gen_batch_size)
        self._lock = threading.Lock()
        self._inflight, self._busy_mark, self._busy_total, self._busy_reported = 0, 0.0, 0.0, 0.0
        self._live: set[int] = set()  # request ids submitted and not yet answered
        self._cancelled: set[int] = set()  # of those, the ones cancel() named
        self._conns: dict = {}  # request id -> its open http.client connection (to abort it)
        self._closed = False
        self.server: ServerProcess | None = None
        self.log_path = Path(log_path) if log_path else Path(cfg.run_root) / cfg.preset / "vllm_server.log"
        atexit.register(self.close)
        try:
            if launch:
                cmd = command or server_command(self.model_path, cfg, host=host, port=port,
                                                generation_config=generation_config)
                self.server = ServerProcess(cmd, host, port, self.log_path)
                wait_healthy(self.base_urls, startup_timeout, self.server)
            else:
                wait_healthy(self.base_urls, min(startup_timeout, CONNECT_TIMEOUT_S))
        except BaseException:
            self.close()
            raise

    @property
    def proc(self):
        """The server's subprocess.Popen, or None when the engine did not start it."""
        return None if self.server is None else self.server.proc

    def close(self, timeout: float = 30.0) -> None:
        """Stop the server: SIGTERM to its process group, wait, then SIGKILL. Also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._pool.shutdown()
        if self.server is not None:
            self.server.stop(timeout)

    def _check_alive(self) -> None:
        if self.server is not None and not self._closed:
            self.server.check_alive()

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _complete(self, prompt_ids, params: SamplingParams, seed: int, rid: int | None = None) -> Completion:
        """One completion request, sent once (never retried). With a request id (RL), cancel() can abort it."""
        url = self.base_urls[next(self._next_server) % len(self.base_urls)]
        body = completion_body(prompt_ids, params, self.stop_ids, seed)
        try:
            if rid is None:
                response = request(url, "/v1/completions", body, timeout=self.request_timeout)
            else:
                response = request_abortable(url, "/v1/completions", body, timeout=self.request_timeout,
                                             on_connect=lambda conn: self._opened(rid, conn))
        except (Unavailable, TimedOut):
            self._check_alive()  # a server that died says so, with its log
            raise
        return parse_completion(response, policy_version=self.policy_version)  # the version when it arrived

    def _admin(self, url: str, path: str, body: dict | None = None):
        """An admin call, retried with backoff while the server is unreachable or answers 5xx."""
        def call():
            self._check_alive()  # no retries on a server that has exited
            return request(url, path, body, timeout=self.rpc_timeout)

        return retry(call)

    # -- synchronous generation (eval) --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, all requests in flight together; seeds params.seed + i, so repeated
        prompts (k samples of a problem) get different samples."""
        futures = [self._pool.submit(self._complete, p, params, params.seed + i) for i, p in enumerate(prompts)]
        return [f.result() for f in futures]

    @property
    def context(self) -> int | None:
        """The longest prompt plus completion the servers take: the least `max_model_len` of their GET /v1/models
        (it follows a --max-model-len in rl.vllm_extra_args), else max_position_embeddings of the model folder's
        config.json; None when neither says. Read once."""
        if self._context is None:
            lens = []
            for url in self.base_urls:
                try:
                    listed = request(url, "/v1/models", method="GET", timeout=self.rpc_timeout)
                except RuntimeError:  # not answered as vLLM does: the folder's config says
                    continue
                models = listed.get("data") if isinstance(listed, dict) else None
                lens += [int(m["max_model_len"]) for m in models or []
                         if isinstance(m, dict) and m.get("id") == SERVED_MODEL_NAME
                         and isinstance(m.get("max_model_len"), int)]
            self._context = min(lens) if lens else read_context(self.model_path)
        return self._context

    def _default_stop_ids(self) -> list[int]:
        """HFEngine's stop tokens (recipe.chat.stop_token_ids of the folder's tokenizer); without a tokenizer
        in the folder, the eos ids of its generation config."""
        try:
            return stop_token_ids(self.tokenizer)
        except (OSError, ValueError, ImportError):
            return read_stop_ids(self.model_path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # here: importing the engine (the launch plan does) stays light

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    # -- asynchronous client (RL) -------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        with self._lock:
            self._live.update(r.id for r in requests)
        for r in requests:
            self._pool.submit(self._run_request, r)

    def cancel(self, request_ids: list[int]) -> None:
        """Requests not sent yet are never sent; those on a server have their connection closed, and vLLM
        aborts a request whose client went. Nothing comes back for either."""
        with self._lock:
            for rid in request_ids:
                if rid in self._live:
                    self._cancelled.add(rid)
                    conn = self._conns.get(rid)
                    if conn is not None:
                        _abort(conn)

    def _opened(self, rid: int, conn) -> None:
        with self._lock:
            self._conns[rid] = conn
            if rid in self._cancelled:  # cancelled while it connected
                _abort(conn)

    def _finished(self, rid: int) -> bool:
        """Forget a request that is over; whether it had been cancelled."""
        with self._lock:
            self._live.discard(rid)
            self._conns.pop(rid, None)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                return True
            return False

    def _busy_step(self, delta_inflight: int) -> float:
        """Track wall time with at least one request in flight; returns the part not yet reported."""
        with self._lock:
            now = time.perf_counter()
            if self._inflight > 0:
                self._busy_total += now - self._busy_mark
            self._busy_mark = now
            self._inflight += delta_inflight
            out = self._busy_total - self._busy_reported
            self._busy_reported = self._busy_total
            return out

    def _run_request(self, r: Request) -> None:
        if self._closed:
            return
        with self._lock:
            if r.id in self._cancelled:  # cancelled before it was sent
                self._cancelled.discard(r.id)
                self._live.discard(r.id)
                return
        # sent only now (at most gen_batch_size requests are in flight): a request that waited past
        # max_off_policy_steps policy versions goes back to the orchestrator to be rescheduled
        if self.max_off_policy_steps is not None and \
                self.policy_version - r.submitted_version > self.max_off_policy_steps:
            self._finished(r.id)
            self._events.put(Cancelled([r.id]))
            return
        busy = self._busy_step(+1)
        try:
            completion = self._complete(r.prompt_ids, r.params, r.params.seed, rid=r.id)
        except Exception as e:
            self._busy_step(-1)
            if not self._finished(r.id) and not self._closed:  # (a cancelled request fails as its socket closes)
                self._events.put(RuntimeError(f"vllm engine failed: request {r.id}: {e}"))
            return
        busy += self._busy_step(-1)
        self._events.put(Done([] if self._finished(r.id) else [(r.id, completion)], busy))

    def poll(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after timeout. Events waiting together are merged into at most one Done and
        one Cancelled (the second is handed out by the next call). A failed request or a dead server raises."""
        if self._stash:
            return self._stash.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                events = [self._events.get(timeout=wait)]
                break
            except queue.Empty:
                self._check_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        results, cancelled, busy = [], [], 0.0
        for ev in events:
            if isinstance(ev, BaseException):
                raise ev
            if isinstance(ev, Done):
                results.extend(ev.results)
                busy += ev.busy_s
            else:
                cancelled.extend(ev.request_ids)
        out = ([Done(results, busy)] if results else []) + ([Cancelled(cancelled)] if cancelled else [])
        out = out or [Done([], busy)]  # only requests cancelled by the caller came back: their busy time
        self._stash.extend(out[1:])
        return out[0]

    def update_weights(self, path, version: int) -> None:
        """Load the state dict the trainer published at `path` (a safetensors file or a folder of shards,
        recipe.weights) into every server, then drop their prefix caches.

        Requests in flight keep running and finish on the new weights (INTELLECT-3 / prime-rl do the same; the
        token-level importance ratio corrects for it); completions arriving from now on carry `version`.
        """
        path = str(Path(path).resolve())
        for url in self.base_urls:  # the weights file is on a shared filesystem for multi-node runs
            out = self._admin(url, "/collective_rpc", {"method": RELOAD_METHOD, "args": [path]})
            results = (out or {}).get("results")
            if not results or not all(isinstance(x, dict) and x.get("tensors", 0) > 0 for x in results):
                raise RuntimeError(f"vllm: weight reload from {path} on {url} returned {out!r}")
            # KV blocks computed with the old weights must not be reused, including those of running requests
            self._admin(url, "/reset_prefix_cache?reset_running_requests=true")
        self.policy_version = int(version)


def _abort(conn) -> None:
    """End a connection another thread is blocked on: shut its socket down (close() alone would not wake it)."""
    try:
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _DaemonPool:
    """A fixed-size pool of daemon threads returning concurrent.futures.Future objects.

    Not ThreadPoolExecutor: its threads are joined at interpreter exit *before* atexit handlers run, so
    requests blocked on a live server would hold the exit up until they finished, and the server would only
    be stopped after. Daemon threads let the atexit handler stop the server at once.
    """

    def __init__(self, size: int):
        self.size = max(1, int(size))
        self.q: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.lock = threading.Lock()
        self.closed = False

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        with self.lock:
            if self.closed:
                raise RuntimeError("vllm engine is closed")
            self.q.put((fut, fn, args))
            # a thread for every queued item no idle thread is waiting to take, up to `size`
            if len(self.threads) < self.size and self.q.qsize() > self.idle:
                t = threading.Thread(target=self._loop, daemon=True, name=f"vllm-client-{len(self.threads)}")
                self.threads.append(t)
                t.start()
        return fut

    def _loop(self):
        while True:
            with self.lock:
                self.idle += 1
            item = self.q.get()
            with self.lock:
                self.idle -= 1
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the future
                    fut.set_exception(e)

    def shutdown(self):
        with self.lock:
            self.closed = True
            while True:
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            for _ in self.threads:
                self.q.put(None)
