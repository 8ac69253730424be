"""A CPU stand-in for `vllm serve`: the recipe's hf engine behind the part of vLLM's HTTP API the recipe uses.

    python -m recipe.inference.serve MODEL_FOLDER --host H --port P [--max-model-len N] [--threads T]
                                     [--batch-size B] [--dtype D] [--seed S]

Where vLLM is not installed (this CPU machine, CI), the vllm engine's client (recipe.inference.vllm.client,
VLLMEngine with launch=False, or RECIPE_INFERENCE_URLS in recipe.rl.loop.make_engine) can drive this server unchanged,
so the multi-node path (one server per inference node, the trainer's orchestrator speaking HTTP to them) runs end
to end. recipe.inference.vllm.server.hf_server_command is its command line, beside server_command (vLLM's).

What it is: the endpoints VLLMEngine calls, answered as vLLM 0.32 answers them (read in vllm-project/vllm).
- GET /health: 200 while the generation thread runs, else 503.
- GET /v1/models: the served model (SERVED_MODEL_NAME) with its `max_model_len` (--max-model-len, else the
  folder's max_position_embeddings).
- POST /v1/completions: one prompt (token ids, or a string the tokenizer encodes), max_tokens (16 when absent,
  as vLLM's completions API), temperature (0: greedy), top_p, top_k (-1 or 0: none; any other is refused),
  seed (absent: drawn from --seed's stream), stop_token_ids, ignore_eos, logprobs (None or 0: the sampled
  token's own logprob), return_tokens_as_token_ids, skip_special_tokens. The answer has vLLM's shape:
  choices[0] with text, logprobs {tokens, token_logprobs, top_logprobs, text_offset}, finish_reason
  "stop"/"length" and stop_reason; the stop token that ended a sequence is among its tokens. A sequence stops at
  the request's stop_token_ids and, unless ignore_eos, at the tokenizer's eos token (vLLM does both). HTTP 400,
  with vLLM's message, when the prompt plus max_tokens exceed max_model_len, and for any option this server
  would otherwise ignore (n > 1, streaming, echo, stop strings, penalties, top_k > 0, logprobs > 0, ...), rather
  than sample something else than was asked; 404 for another model name.
- POST /v1/chat/completions (what the LLM judge's client, recipe/envs/judge.py, calls): the messages (text
  content only) rendered by the model folder's chat template with the assistant's turn opened, as vLLM does by
  default, then generated as a /v1/completions request with the same sampling fields; max_completion_tokens or
  max_tokens, absent: up to max_model_len (vLLM's chat default). The answer has vLLM's chat shape:
  choices[0].message {role "assistant", content}, finish_reason, stop_reason, usage. Tools, chat-template
  overrides and logprobs are refused (HTTP 400), as is a model folder without a chat template.
- POST /collective_rpc with method RELOAD_METHOD (recipe.inference.vllm.worker_ext) and args [path]: loads the
  state dict the trainer published there (one safetensors file, or a folder of shards with its index:
  recipe.weights.read_weights), in transformers' layout, as HFEngine.update_weights does, and answers
  {"results": [{"path", "tensors"}]} as vLLM's one worker would. The file is read and checked (every name and
  shape the model has, no other) in the request's own thread, while generation goes on; the model is then
  swapped between two batches, before any batch still waiting: a batch never mixes weights. A file that cannot
  be read answers 500 (the client retries: a shared filesystem may be late), weights that do not fit the model
  400, another method 400.
- POST /reset_prefix_cache: 200 and nothing to do. Nothing is cached across batches: every batch computes its
  prompts' keys and values afresh, on the weights it runs with.

Sampling is HFEngine's (recipe.inference.hf): each request samples from a generator of its own seeded with its
seed, so a request's tokens do not depend on which requests share its batch (up to the numerics of batched
forward passes), and its logprobs are those of log_softmax(logits / temperature) over the whole vocabulary.

What it is not: fast. Requests that arrive together (within GATHER_S of the first, or while a batch runs) are
generated together, up to --batch-size, in one HFEngine.generate_each call; a request arriving during a batch
waits for the next one (no continuous batching, no paged KV cache, no prefix caching, no tensor parallelism).
It is a test double with the real model behind it, for running the pipeline where vLLM is not, not a way to
serve a large model.

SIGTERM or SIGINT: stop accepting, answer requests still waiting with 503, release the port, exit 0. One line is
printed when it is ready: "serving <model folder> on http://H:P" (with --port 0, the port the system chose).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError

from recipe import hub
from recipe.errors import RecipeError
from recipe.inference.hf import HFEngine
from recipe.inference.vllm.server import SERVED_MODEL_NAME, read_context
from recipe.inference.vllm.worker_ext import RELOAD_METHOD
from recipe.model import load_pretrained
from recipe.rollout import Completion, SamplingParams
from recipe.runs import PeriodicTrim
from recipe.weights import read_weights

DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (the OpenAI API's)
GATHER_S = 0.01  # after the first request into an idle server, how long to wait for the ones posted with it
STOP_JOIN_S = 10.0  # at SIGTERM, how long a batch under way may take to finish before the process exits anyway
TOKEN_PREFIX = "token_id:"  # return_tokens_as_token_ids (as recipe.inference.vllm.client.TOKEN_PREFIX)

# request fields this server does not implement, with the values that mean "not used"; any other value is refused
NOT_USED = {
    "n": (None, 1), "best_of": (None, 1), "stream": (None, False), "echo": (None, False), "stop": (None, [], ""),
    "min_tokens": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "logit_bias": (None, {}), "prompt_logprobs": (None,),
    "suffix": (None, ""), "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "response_format": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "truncate_prompt_tokens": (None,),
}


class HTTPError(Exception):
    """An error answer: HTTP status and message (sent as vLLM's ErrorResponse)."""

    KINDS = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailable"}

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.KINDS.get(self.status, "Error"), "param": None,
                          "code": self.status}}


# -- requests ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Asked:
    """What a completion request asks for, checked: prompt ids, sampling, stop set, and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[int, ...]  # the tokens that end the sequence: stop_token_ids, and eos unless ignore_eos
    eos: int | None  # None with ignore_eos
    logprobs: bool  # answer with logprobs (the request's `logprobs` was 0, not absent)
    as_ids: bool  # return_tokens_as_token_ids
    skip_special: bool  # skip_special_tokens, for the text


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise HTTPError(400, f"{key} must be a number, got {v!r}")
    return float(v)


def parse_request(body, *, tokenizer, vocab_size: int, max_model_len: int, next_seed) -> Asked:
    """Check a /v1/completions body as vLLM would (HTTPError 400/404 with its message) and say what it asks."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != SERVED_MODEL_NAME:
        raise HTTPError(404, f"The model `{model}` does not exist.")
    for key, unused in NOT_USED.items():
        v = body.get(key)
        if not any(v is u or (v == u and isinstance(v, bool) == isinstance(u, bool)) for u in unused):
            raise HTTPError(400, f"{key}={v!r} is not supported by this server (recipe.inference.serve, "
                                 f"a CPU stand-in for vLLM)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    else:
        raise HTTPError(400, "prompt must be one prompt: a list of token ids or a string (this server takes no "
                             "batch of prompts)")
    if not ids:
        raise HTTPError(400, "The prompt cannot be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise HTTPError(400, f"Token id {bad[0]} is out of vocabulary (vocab size {vocab_size})")

    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise HTTPError(400, f"max_tokens must be at least 1, got {max_tokens!r}")
    n = len(ids)
    if max_tokens is None:
        if n >= max_model_len:
            raise HTTPError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                                 f"request has {n} input tokens. Please reduce the length of the input messages.")
        max_tokens = max_model_len - n
    elif n + max_tokens > max_model_len:
        raise HTTPError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} in the "
                             f"completion). Please reduce the length of the messages or completion.")

    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise HTTPError(400, f"temperature must be non-negative, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise HTTPError(400, f"top_p must be in (0, 1], got {top_p}")
    top_k = body.get("top_k")
    if top_k not in (None, -1, 0) or isinstance(top_k, bool):
        raise HTTPError(400, f"top_k={top_k!r} is not supported by this server (-1 or 0: no top-k)")
    seed = body.get("seed")
    if seed is None:
        seed = next_seed()
    elif not _is_int(seed):
        raise HTTPError(400, f"seed must be an integer, got {seed!r}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise HTTPError(400, "stop_token_ids must be a list of token ids")
    eos = None if body.get("ignore_eos") else tokenizer.eos_token_id
    stops = tuple(sorted(set(stop_ids) | ({eos} if eos is not None else set())))
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
        raise HTTPError(400, f"logprobs={logprobs!r} is not supported by this server: 0 (the sampled token's own "
                             "logprob) or none")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    return Asked(ids, params, stops, eos, logprobs is not None, bool(body.get("return_tokens_as_token_ids")),
                 bool(body.get("skip_special_tokens", True)))


# chat fields this server does not implement, with the values that mean "not used" (the rest go on to
# parse_request, which refuses the sampling options it does not implement)
CHAT_NOT_USED = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, False, True),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "continue_final_message": (None, False),
    "add_generation_prompt": (None, True), "documents": (None,), "logprobs": (None, False), "top_logprobs": (None, 0),
}
CHAT_ONLY = set(CHAT_NOT_USED) | {"messages", "max_completion_tokens", "max_tokens"}


def chat_request(body, tokenizer) -> dict:
    """A /v1/chat/completions body as the /v1/completions body it amounts to: the prompt is the messages rendered
    by the chat template with the assistant's turn opened, as token ids (vLLM adds no special tokens to a
    rendered chat); the length is max_completion_tokens, else max_tokens, else up to the context."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    msgs = body.get("messages")
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs)):
        raise HTTPError(400, "messages must be a non-empty list of {role, content} with text content (this server "
                             "takes no content parts)")
    for key, unused in CHAT_NOT_USED.items():
        v = body.get(key)
        if not any(v is u or (v == u and isinstance(v, bool) == isinstance(u, bool)) for u in unused):
            raise HTTPError(400, f"{key}={v!r} is not supported by this server (recipe.inference.serve, "
                                 f"a CPU stand-in for vLLM)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise HTTPError(400, "the model folder's tokenizer has no chat template: use /v1/completions")
    text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in msgs],
                                         tokenize=False, add_generation_prompt=True)
    out = {k: v for k, v in body.items() if k not in CHAT_ONLY}
    length = body.get("max_completion_tokens")
    out["max_tokens"] = length if length is not None else body.get("max_tokens")
    out["prompt"] = tokenizer.encode(text, add_special_tokens=False)
    return out


def chat_response(completion: dict) -> dict:
    """vLLM's /v1/chat/completions answer, from the /v1/completions answer of the same generation."""
    choice = completion["choices"][0]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": completion["created"],
        "model": completion["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": choice["text"], "tool_calls": []},
                     "logprobs": None, "finish_reason": choice["finish_reason"],
                     "stop_reason": choice["stop_reason"]}],
        "usage": completion["usage"],
    }


def completion_response(asked: Asked, c: Completion, tokenizer) -> dict:
    """vLLM's /v1/completions answer for one prompt and one choice."""
    logprobs = None
    if asked.logprobs:
        pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
        tokens = [f"{TOKEN_PREFIX}{t}" for t in c.token_ids] if asked.as_ids else pieces
        offsets, at = [], 0
        for piece in pieces:  # where each token's text starts in the completion's
            offsets.append(at)
            at += len(piece)
        logprobs = {"text_offset": offsets, "token_logprobs": list(c.logprobs), "tokens": tokens,
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, c.logprobs)]}
    last = c.token_ids[-1] if c.token_ids else None
    # vLLM: stop_reason is the stop token when one of stop_token_ids ended the sequence, None at eos or length
    stop_reason = last if c.finish_reason == "stop" and last != asked.eos else None
    n, m = len(asked.prompt_ids), len(c.token_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": SERVED_MODEL_NAME,
        "choices": [{"index": 0, "text": tokenizer.decode(c.token_ids, skip_special_tokens=asked.skip_special),
                     "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": stop_reason,
                     "prompt_logprobs": None}],
        "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
    }


def check_weights(state: dict, shapes: dict[str, tuple]) -> None:
    """HTTPError 400 unless `state` has exactly the model's tensor names, each of the model's shape."""
    missing = sorted(set(shapes) - set(state))
    extra = sorted(set(state) - set(shapes))
    wrong = sorted(k for k in set(state) & set(shapes) if tuple(state[k].shape) != shapes[k])
    if missing or extra or wrong:
        parts = [f"{len(v)} {what} (first {v[0]})" for v, what in
                 ((missing, "missing"), (extra, "unexpected"), (wrong, "of another shape")) if v]
        raise HTTPError(400, f"the weights do not fit the served model: {', '.join(parts)}")


# -- the generation thread --------------------------------------------------------------------------------
class _Task:
    def __init__(self, payload):
        self.payload = payload
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Scheduler:
    """Owns the engine: one thread generates batches of waiting requests and swaps weights between them.

    `engine` is an HFEngine (or anything with its generate_each, stop_ids and model). A weight swap waiting goes
    before the requests waiting, so the trainer's reload waits for one batch at most.
    """

    def __init__(self, engine, batch_size: int, gather_s: float = GATHER_S):
        self.engine = engine
        self.batch_size = max(1, int(batch_size))
        self.gather_s = gather_s
        self.cond = threading.Condition()
        self.requests: deque[_Task] = deque()
        self.swaps: deque[_Task] = deque()
        self.stopping = False
        self.batches: deque[int] = deque(maxlen=1000)  # the sizes of the latest batches (tests, the curious)
        self.reloads = 0
        self.trim = PeriodicTrim()
        self.thread = threading.Thread(target=self._loop, name="generate", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def _put(self, queue: deque, payload):
        task = _Task(payload)
        with self.cond:
            if self.stopping:
                raise HTTPError(503, "the server is shutting down")
            queue.append(task)
            self.cond.notify_all()
        return task.wait()

    def generate(self, asked: Asked) -> Completion:
        return self._put(self.requests, asked)

    def swap(self, state: dict) -> int:
        """Load `state` into the model between two batches; returns the number of tensors."""
        return self._put(self.swaps, state)

    def stop(self, timeout: float = STOP_JOIN_S) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout)

    def _loop(self):
        try:
            idle = True
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.requests or self.swaps or self.stopping)
                    if idle and not self.stopping and not self.swaps and len(self.requests) < self.batch_size:
                        # requests posted together reach the server a few milliseconds apart
                        self.cond.wait_for(lambda: len(self.requests) >= self.batch_size or self.swaps
                                           or self.stopping, timeout=self.gather_s)
                    if self.stopping:
                        break
                    if self.swaps:
                        swap, batch = self.swaps.popleft(), []
                    else:
                        swap = None
                        batch = [self.requests.popleft() for _ in range(min(self.batch_size, len(self.requests)))]
                if swap is not None:
                    self._swap(swap)
                else:
                    self._generate(batch)
                with self.cond:
                    idle = not self.requests
        finally:
            with self.cond:
                self.stopping = True
                left = list(self.requests) + list(self.swaps)
                self.requests.clear()
                self.swaps.clear()
            for task in left:
                task.error = HTTPError(503, "the server is shutting down")
                task.done.set()

    def _swap(self, task: _Task) -> None:
        try:
            with torch.no_grad():
                self.engine.model.load_state_dict(task.payload)
            task.result = len(task.payload)
            self.reloads += 1
        except Exception as e:  # checked beforehand: not expected
            task.error = HTTPError(500, f"loading the weights failed: {type(e).__name__}: {e}")
        task.payload = None  # the state dict: freed before the next batch
        self.trim()  # the freed state dicts, now and then: RSS stays flat over a long run
        task.done.set()

    def _generate(self, batch: list[_Task]) -> None:
        self.batches.append(len(batch))
        by_stops: dict[tuple, list[_Task]] = {}
        for task in batch:
            by_stops.setdefault(task.payload.stops, []).append(task)
        for stops, tasks in by_stops.items():
            try:
                self.engine.stop_ids = list(stops)
                outs = self.engine.generate_each([t.payload.prompt_ids for t in tasks],
                                                 [t.payload.params for t in tasks])
                for t, c in zip(tasks, outs):
                    t.result = c
            except Exception as e:
                traceback.print_exc()
                for t in tasks:
                    t.error = HTTPError(500, f"generation failed: {type(e).__name__}: {e}")
            for t in tasks:
                t.done.set()


# -- HTTP -------------------------------------------------------------------------------------------------
class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the client posts up to rl.gen_batch_size requests at once
    allow_reuse_address = True


class Service:
    """What the handlers answer with: the engine's scheduler, the tokenizer, the served model's limits."""

    def __init__(self, engine, tokenizer, model_path: str, max_model_len: int, batch_size: int, seed: int = 0,
                 gather_s: float = GATHER_S):
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(engine.model.get_input_embeddings().weight.shape[0])
        self.shapes = {k: tuple(v.shape) for k, v in engine.model.state_dict().items()}
        self.scheduler = Scheduler(engine, batch_size, gather_s)
        self._seeds = random.Random(seed)
        self._seed_lock = threading.Lock()

    def next_seed(self) -> int:
        with self._seed_lock:
            return self._seeds.getrandbits(63)

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": SERVED_MODEL_NAME, "object": "model", "created": int(time.time()), "owned_by": "recipe",
            "root": self.model_path, "parent": None, "max_model_len": self.max_model_len, "permission": []}]}

    def complete(self, body) -> dict:
        asked = parse_request(body, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                              max_model_len=self.max_model_len, next_seed=self.next_seed)
        return completion_response(asked, self.scheduler.generate(asked), self.tokenizer)

    def chat(self, body) -> dict:
        asked = parse_request(chat_request(body, self.tokenizer), tokenizer=self.tokenizer,
                              vocab_size=self.vocab_size, max_model_len=self.max_model_len, next_seed=self.next_seed)
        return chat_response(completion_response(asked, self.scheduler.generate(asked), self.tokenizer))

    def collective_rpc(self, body) -> dict:
        if not isinstance(body, dict) or body.get("method") != RELOAD_METHOD:
            method = body.get("method") if isinstance(body, dict) else None
            raise HTTPError(400, f"method {method!r} is not supported by this server (only {RELOAD_METHOD!r})")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        path = args[0] if isinstance(args, list) and len(args) == 1 else kwargs.get("path")
        if not isinstance(path, str) or not path:
            raise HTTPError(400, f"{RELOAD_METHOD} takes one argument, the path of the weights")
        try:  # read in this thread, while batches go on; swapped in between two of them
            state = read_weights(Path(path))
        except (OSError, SafetensorError, ValueError, KeyError) as e:
            raise HTTPError(500, f"reading the weights at {path} failed: {type(e).__name__}: {e}") from None
        check_weights(state, self.shapes)
        n = self.scheduler.swap(state)
        del state
        print(f"serve: loaded {n} tensors from {path}", flush=True)
        return {"results": [{"path": path, "tensors": n}]}


def make_handler(service: Service):
    class Handler(BaseHTTPRequestHandler):
        server_version = "recipe-serve"

        def log_request(self, code="-", size="-"):  # only what went wrong: a run posts many requests
            if isinstance(code, int) and code >= 400:
                super().log_request(code, size)

        def reply(self, status: int, payload=None):
            data = b"" if payload is None else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                pass

        def answer(self, call):
            try:
                self.reply(200, call())
            except HTTPError as e:
                self.reply(e.status, e.body())
            except Exception as e:
                traceback.print_exc()
                self.reply(500, HTTPError(500, f"{type(e).__name__}: {e}").body())

        def read_body(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
            try:
                return json.loads(raw) if raw.strip() else {}
            except ValueError:
                raise HTTPError(400, "the request body is not JSON") from None

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/health":
                if service.scheduler.alive:
                    self.reply(200)
                else:
                    self.reply(503, HTTPError(503, "the generation thread has stopped").body())
            elif path == "/v1/models":
                self.answer(service.models)
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            path = urlparse(self.path).path
            if path == "/v1/completions":
                self.answer(lambda: service.complete(self.read_body()))
            elif path == "/v1/chat/completions":
                self.answer(lambda: service.chat(self.read_body()))
            elif path == "/collective_rpc":
                self.answer(lambda: service.collective_rpc(self.read_body()))
            elif path == "/reset_prefix_cache":  # nothing is cached across batches
                self.answer(lambda: (self.read_body(), None)[1])
            else:
                self.reply(404, {"detail": "Not Found"})

    return Handler


# -- the process ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipe.inference.serve",
                                description="The hf engine behind the part of vLLM's HTTP API the recipe uses "
                                            "(a CPU stand-in for `vllm serve`).")
    p.add_argument("model", help="model folder (save_pretrained: config, tokenizer, weights), or a hub id with "
                                 "--revision")
    p.add_argument("--revision", default=None, help="the hub model's commit: read from the HF cache's snapshot "
                                                    "of it (fetched first unless HF_HUB_OFFLINE=1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line says which)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus max_tokens taken (default: max_position_embeddings)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--batch-size", type=int, default=64, help="requests generated together, at most")
    p.add_argument("--dtype", default="float32", help="torch dtype to load the model in")
    p.add_argument("--seed", type=int, default=0, help="seeds the seeds of requests that bring none")
    return p.parse_args(argv)


def snapshot(model: str, revision: str) -> str:
    """The HF cache's folder of a hub model at its commit (vLLM's --model ID --revision REV, on the hf engine)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, revision=revision, local_files_only=hub.offline())
    except Exception as e:  # not in the cache offline, no network, no such commit: one line that names it
        raise RecipeError(f"serve: cannot load {model}@{revision} ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def build_service(args) -> Service:
    model_path = str(Path(snapshot(args.model, args.revision) if args.revision else args.model).resolve())
    context = read_context(model_path)
    max_len = args.max_model_len if args.max_model_len is not None else context
    if max_len is None or max_len < 1:
        raise RecipeError("serve: give --max-model-len (the model's config.json has no max_position_embeddings)")
    if context is not None and max_len > context:
        raise RecipeError(f"serve: --max-model-len {max_len} exceeds the model's max_position_embeddings "
                          f"({context})")
    model, tokenizer = load_pretrained(model_path, dtype=args.dtype)
    engine = HFEngine(model, tokenizer, stop_ids=[], batch_size=args.batch_size)
    if engine.pad_id is None:  # padding is masked out: any id will do
        engine.pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return Service(engine, tokenizer, model_path, max_len, args.batch_size, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        service = build_service(args)
        httpd = Server((args.host, args.port), make_handler(service))
    except (RecipeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serving = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True)
    serving.start()
    host, port = httpd.server_address[:2]
    print(f"serving {service.model_path} on http://{host}:{port}", flush=True)
    while not stop.wait(1.0):
        if not serving.is_alive() or not service.scheduler.thread.is_alive():
            print("serve: a server thread died", file=sys.stderr, flush=True)
            break
    httpd.shutdown()  # no new connections; requests waiting are answered 503 by the scheduler's stop
    service.scheduler.stop()
    httpd.server_close()  # the port is free from here
    print("serve: stopped", flush=True)
    return 0 if stop.is_set() else 1


if __name__ == "__main__":
    sys.exit(main())
