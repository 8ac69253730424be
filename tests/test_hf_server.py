"""recipe.inference.serve, the CPU stand-in for `vllm serve`: the vllm engine's client (VLLMEngine, launch=False)
drives it unchanged. One server on a tiny model for the module (started with hf_server_command), spoken to over
HTTP: completions and their logprobs against the model's own, the context, a too-long prompt, weight reloads
from a sharded folder and a file, a short RL run through RECIPE_INFERENCE_URLS, and SIGTERM. The request checks and
the scheduler (batching, swaps between batches) are tested in-process."""
import json
import math
import os
import re
import socket
import subprocess
import threading
import time
import urllib.parse

import pytest
import torch

from recipe.inference.engine import Done, Request
from recipe.inference.serve import Asked, HTTPError, Scheduler, parse_request
from recipe.inference.vllm import REPO_ROOT, RELOAD_METHOD, VLLMEngine, hf_server_command, server_command
from recipe.inference.vllm.server import request
from recipe.rollout import Completion, SamplingParams
from recipe.weights import write_weights
from tests.fakes import save_tiny_qa_model, write_math_rl_data

MAX_MODEL_LEN = 48  # the tiny model's max_position_embeddings is 128: the flag is what /v1/models says


def make_cfg(**rl):
    from recipe.config import Config

    cfg = Config()
    for k, v in rl.items():
        setattr(cfg.rl, k, v)
    return cfg


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def port_open(url: str) -> bool:
    u = urllib.parse.urlparse(url)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((u.hostname, u.port)) == 0


# -- the command line -------------------------------------------------------------------------------------
def test_hf_server_command_mirrors_server_command():
    cfg = make_cfg(vllm_port=8123, seed=7, gen_threads=3, gen_batch_size=16,
                   vllm_extra_args=["--enforce-eager", "--max-model-len", "4096"])
    cfg.model.dtype = "bfloat16"
    cmd = hf_server_command("/models/m", cfg, host="0.0.0.0", python="/py")
    assert cmd[:4] == ["/py", "-m", "recipe.inference.serve", "/models/m"]
    assert flag(cmd, "--host") == "0.0.0.0" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "--dtype") == "bfloat16" and flag(cmd, "--seed") == "7"
    assert flag(cmd, "--threads") == "3" and flag(cmd, "--batch-size") == "16"
    assert flag(cmd, "--max-model-len") == "4096" and "--enforce-eager" not in cmd  # vLLM's own flags left out
    vllm = server_command("/models/m", cfg, host="0.0.0.0", port=9, python="/py")
    assert flag(vllm, "--port") == flag(hf_server_command("/models/m", cfg, port=9), "--port") == "9"
    cfg.rl.vllm_extra_args = ["--max-model-len=512"]
    assert flag(hf_server_command("/m", cfg), "--max-model-len") == "512"
    cfg.rl.vllm_extra_args = []
    assert "--max-model-len" not in hf_server_command("/m", cfg)


# -- the request checks -----------------------------------------------------------------------------------
class StubTokenizer:
    eos_token_id = 0

    def encode(self, text):
        return [1 + ord(c) % 40 for c in text]


def parse(body, seeds=iter(range(1000, 2000))):
    return parse_request(body, tokenizer=StubTokenizer(), vocab_size=50, max_model_len=MAX_MODEL_LEN,
                         next_seed=lambda: next(seeds))


def refused(body, status=400):
    with pytest.raises(HTTPError) as e:
        parse(body)
    assert e.value.status == status
    return str(e.value)


def test_parse_request_takes_what_the_client_sends():
    body = {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
            "seed": 12, "n": 1, "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
            "stop_token_ids": [3, 5], "presence_penalty": 0.0, "stream": False}
    a = parse(body)
    assert a.prompt_ids == [5, 6, 7] and a.params == SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9,
                                                                   seed=12)
    assert a.stops == (0, 3, 5) and a.eos == 0  # the tokenizer's eos stops too, as in vLLM
    assert a.logprobs and a.as_ids and not a.skip_special
    assert parse({**body, "ignore_eos": True}).stops == (3, 5)
    assert parse({"prompt": [1] * 40, "max_tokens": None}).params.max_new_tokens == MAX_MODEL_LEN - 40
    assert parse({"prompt": [1]}).params.max_new_tokens == 16  # vLLM's completions default
    unseeded = parse({"prompt": "ab"})
    assert unseeded.prompt_ids == StubTokenizer().encode("ab") and unseeded.params.seed >= 1000
    assert not unseeded.logprobs and parse({"prompt": [[4, 5]]}).prompt_ids == [4, 5]  # a batch of one
    assert parse({"prompt": [1], "top_k": 0}).params.top_p == 1.0


def test_parse_request_refuses_as_vllm_or_rather_than_ignore():
    msg = refused({"prompt": [1] * 41, "max_tokens": 8})
    assert msg.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                          f"49 tokens (41 in the messages, 8 in the completion).")
    assert "maximum context length" in refused({"prompt": [1] * MAX_MODEL_LEN, "max_tokens": None})
    assert parse({"prompt": [1] * 40, "max_tokens": 8}).params.max_new_tokens == 8  # exactly max_model_len
    assert "does not exist" in refused({"model": "other", "prompt": [1]}, status=404)
    for extra in ({"n": 2}, {"stream": True}, {"echo": True}, {"stop": ["\n"]}, {"top_k": 5}, {"logprobs": 1},
                  {"repetition_penalty": 1.1}, {"min_p": 0.1}, {"best_of": 3}):
        assert "not supported" in refused({"prompt": [1], **extra}), extra
    assert "out of vocabulary" in refused({"prompt": [1, 50]})
    assert "empty" in refused({"prompt": []})
    assert "one prompt" in refused({"prompt": [[1], [2]]})
    refused({"prompt": [1], "max_tokens": 0})
    refused({"prompt": [1], "temperature": -1})
    refused({"prompt": [1], "top_p": 0})
    refused({"prompt": [1], "seed": "x"})
    refused({"prompt": [1], "stop_token_ids": ["x"]})
    refused([1, 2])


# -- the scheduler ----------------------------------------------------------------------------------------
class FakeModel:
    def __init__(self):
        self.version = 0

    def load_state_dict(self, state):
        self.version = state["v"]


class FakeEngine:
    """generate_each answers [last prompt token + 1]; each call notes (prompts, stop ids, weights version) and
    waits for `gate`."""

    def __init__(self):
        self.model, self.stop_ids, self.calls = FakeModel(), [], []
        self.gate, self.started = threading.Event(), threading.Event()

    def generate_each(self, prompts, params):
        self.calls.append((list(prompts), tuple(self.stop_ids), self.model.version))
        self.started.set()
        assert self.gate.wait(10)
        return [Completion([p[-1] + 1], [-0.5], "length") for p in prompts]


def asked(i, stops=(0,)):
    return Asked([i], SamplingParams(max_new_tokens=4, seed=i), stops, 0, True, True, False)


def test_scheduler_batches_requests_together_and_swaps_weights_only_between_batches():
    engine = FakeEngine()
    sched = Scheduler(engine, batch_size=4, gather_s=0.01)
    out, swapped = {}, []

    def post(i, stops=(0,)):
        out[i] = sched.generate(asked(i, stops))

    threads = [threading.Thread(target=post, args=(1,))]
    threads[0].start()
    assert engine.started.wait(10)  # a batch of one is running, held at the gate
    for i, stops in [(10, (0,)), (11, (0, 7)), (12, (0,)), (13, (0, 7)), (14, (0,))]:
        threads.append(threading.Thread(target=post, args=(i, stops)))
        threads[-1].start()
    deadline = time.monotonic() + 10
    while len(sched.requests) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads.append(threading.Thread(target=lambda: swapped.append(sched.swap({"v": 1}))))  # posted last...
    threads[-1].start()
    while len(sched.swaps) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.model.version == 0  # ...and not swapped under the running batch
    engine.gate.set()
    for t in threads:
        t.join(10)
    assert swapped == [1] and sched.reloads == 1
    assert {i: c.token_ids for i, c in out.items()} == {i: [i + 1] for i in (1, 10, 11, 12, 13, 14)}
    assert list(sched.batches) == [1, 4, 1]  # the waiting requests together, at most batch_size a batch
    assert engine.calls[0] == ([[1]], (0,), 0)
    assert all(version == 1 for _, _, version in engine.calls[1:])  # ...before any batch still waiting
    for prompts, stops, _ in engine.calls[1:]:  # one generate_each call per stop set
        assert all(((0, 7) if p[0] in (11, 13) else (0,)) == stops for p in prompts)
    assert sorted(p[0] for prompts, _, _ in engine.calls for p in prompts) == [1, 10, 11, 12, 13, 14]
    sched.stop()
    assert not sched.thread.is_alive()
    with pytest.raises(HTTPError, match="shutting down"):
        sched.generate(asked(2))


# -- a real server on a tiny model ------------------------------------------------------------------------
def start_server(cmd, log_path, timeout=120.0):
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT))
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(r"serving (\S+) on (http://\S+)", log_path.read_text(errors="replace"))
        if m:
            return proc, m.group(2)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_server")
    folder = root / "model"
    tok = save_tiny_qa_model(folder)
    cfg = make_cfg(gen_threads=1, gen_batch_size=8, seed=0, max_off_policy_steps=8,
                   vllm_extra_args=["--max-model-len", str(MAX_MODEL_LEN)])
    cfg.run_root = str(root / "runs")
    proc, url = start_server(hf_server_command(folder, cfg, port=0), root / "server.log")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        eng = VLLMEngine(str(folder), cfg, launch=False, base_url=url)
        yield {"root": root, "folder": folder, "tok": tok, "cfg": cfg, "proc": proc, "url": url, "eng": eng,
               "model": model, "state": {k: v.clone() for k, v in model.state_dict().items()},
               "log": root / "server.log"}
        eng.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def prompt(tok, i):
    from recipe.chat import encode_prompt

    return encode_prompt(tok, [{"role": "user", "content": f"Q{i}"}])


def model_logprobs(model, prompt_ids, completion, temperature=1.0):
    ids = torch.tensor([prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)


def test_completions_through_the_vllm_client(served):
    eng, tok = served["eng"], served["tok"]
    assert eng.context == MAX_MODEL_LEN  # GET /v1/models
    prompts = [prompt(tok, i) for i in (1, 2, 3, 3)]
    out = eng.generate(prompts, PARAMS)  # four requests in flight together, seeds 3..6
    stops = set(eng.stop_ids)
    for p, c in zip(prompts, out):
        assert 1 <= len(c.token_ids) <= 8 and len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(v) and v <= 0 for v in c.logprobs)
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stops else "length") and c.policy_version == 0
        assert not stops & set(c.token_ids[:-1])  # a stop token ends the sequence, and is in it
        # the sampled tokens' logprobs under the model's own log_softmax at temperature 1
        assert torch.allclose(torch.tensor(c.logprobs), model_logprobs(served["model"], p, c), atol=1e-4)
    assert out[2].token_ids != out[3].token_ids  # the same prompt, seeds 5 and 6
    # a request's seed decides its tokens, whatever shares its batch: one at a time gives the same
    alone = [eng.generate([p], SamplingParams(max_new_tokens=8, seed=3 + i))[0] for i, p in enumerate(prompts)]
    assert [c.token_ids for c in alone] == [c.token_ids for c in out]
    assert torch.allclose(torch.tensor([v for c in alone for v in c.logprobs]),
                          torch.tensor([v for c in out for v in c.logprobs]), atol=1e-5)

    eng.submit([Request(i, prompts[i], SamplingParams(max_new_tokens=4, seed=40 + i), 0) for i in range(3)])
    done = {}
    deadline = time.monotonic() + 60
    while len(done) < 3:
        assert time.monotonic() < deadline
        ev = eng.poll(timeout=1.0)
        if isinstance(ev, Done):
            done.update(ev.results)
    assert sorted(done) == [0, 1, 2] and all(c.policy_version == 0 for c in done.values())


def test_a_stop_token_ends_the_completion_and_comes_with_it(served):
    eng, p = served["eng"], prompt(served["tok"], 5)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0)
    first = eng.generate([p], greedy)[0]
    assert first.finish_reason == "length" or first.token_ids[-1] in eng.stop_ids
    stop_at = first.token_ids[1]  # greedy: the same tokens again, up to this one
    raw = request(served["url"], "/v1/completions",
                  {"prompt": p, "max_tokens": 6, "temperature": 0.0, "stop_token_ids": [stop_at], "logprobs": 0,
                   "return_tokens_as_token_ids": True, "skip_special_tokens": False, "top_k": -1}, timeout=60)
    choice = raw["choices"][0]
    cut = first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_at  # as vLLM says it
    assert raw["usage"] == {"prompt_tokens": len(p), "completion_tokens": len(cut),
                            "total_tokens": len(p) + len(cut)}
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(first.logprobs[:len(cut)], abs=1e-5)


def test_a_prompt_too_long_for_max_model_len_is_refused(served, tmp_path):
    from recipe.chat import encode_prompt
    from recipe.config import EvalConfig
    from recipe.eval import runner

    eng, tok = served["eng"], served["tok"]
    long_prompt = [5] * (MAX_MODEL_LEN - 4)
    with pytest.raises(RuntimeError, match="HTTP 400.*maximum context length is 48 tokens"):
        eng.generate([long_prompt], PARAMS)  # 44 + 8 > 48
    assert len(eng.generate([long_prompt], SamplingParams(max_new_tokens=4, seed=1))[0].token_ids) <= 4
    eng.submit([Request(0, long_prompt, PARAMS, 0)])
    with pytest.raises(RuntimeError, match="request 0.*HTTP 400"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            eng.poll(timeout=1.0)
    # the eval runner reads the server's context and leaves out what does not fit, as with vLLM
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "prompt": [{"role": "user", "content": text}],
             "answer": "1", "info": "{}"} for i, text in enumerate(["Q1", " ".join(f"Q{j}" for j in range(40))])]
    assert len(prompt(tok, 1)) + 8 <= MAX_MODEL_LEN < len(encode_prompt(tok, rows[1]["prompt"])) + 8
    res = runner.evaluate(eng, tok, rows, EvalConfig(samples=2, pass_k=[1], max_new_tokens=8), tmp_path / "eval")
    assert res["skipped_too_long"] == 1 and res["env"]["math"]["problems"] == 1


def test_update_weights_from_a_sharded_folder_then_a_file(served, tmp_path):
    eng, model, tok = served["eng"], served["model"], served["tok"]
    prompts = [prompt(tok, i) for i in (7, 8)]
    before = eng.generate(prompts, PARAMS)

    torch.manual_seed(1)
    perturbed = {k: v + 0.5 * v.std().clamp(min=0.05) * torch.randn_like(v) if v.is_floating_point() else v
                 for k, v in served["state"].items()}
    path = write_weights(perturbed, tmp_path / "policy_000001.safetensors", max_shard_bytes=20_000)
    assert path.is_dir() and len(list(path.glob("*.safetensors"))) > 1  # shards and an index
    eng.update_weights(path, 1)
    assert eng.policy_version == 1
    after = eng.generate(prompts, PARAMS)
    assert all(c.policy_version == 1 for c in after)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    model.load_state_dict(perturbed)  # the test's copy of the model, with the weights the server reloaded
    try:
        for p, c in zip(prompts, after):
            assert torch.allclose(torch.tensor(c.logprobs), model_logprobs(model, p, c), atol=1e-4)
    finally:
        model.load_state_dict(served["state"])

    # back to the start weights, from one file: the server answers as it did before the reload
    back = write_weights(served["state"], tmp_path / "policy_000002.safetensors")
    out = request(served["url"], "/collective_rpc", {"method": RELOAD_METHOD, "args": [str(back)]}, timeout=60)
    assert out == {"results": [{"path": str(back), "tensors": len(served["state"])}]}
    again = eng.generate(prompts, PARAMS)
    assert [c.token_ids for c in again] == [c.token_ids for c in before]
    assert re.search(rf"serve: loaded {len(served['state'])} tensors from {re.escape(str(path))}",
                     served["log"].read_text())


def test_weights_that_do_not_fit_are_refused_and_change_nothing(served, tmp_path):
    eng = served["eng"]
    p = prompt(served["tok"], 9)
    before, version = eng.generate([p], PARAMS)[0], eng.policy_version
    partial = dict(list(served["state"].items())[1:])
    path = write_weights(partial, tmp_path / "partial.safetensors")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="HTTP 400.*do not fit the served model: 1 missing"):
        eng.update_weights(path, 5)
    assert time.monotonic() - t0 < 5  # a 4xx is not retried
    with pytest.raises(RuntimeError, match="HTTP 400.*not supported"):
        request(served["url"], "/collective_rpc", {"method": "other", "args": []}, timeout=60)
    assert eng.policy_version == version
    again = eng.generate([p], PARAMS)[0]
    assert again.token_ids == before.token_ids and again.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_rl_run_on_the_server_through_recipe_vllm_urls(served, monkeypatch):
    """Two RL steps with rl.engine=vllm: the orchestrator's requests and each step's weight reload go to the
    server (rl.loop.make_engine, as on a cluster)."""
    import contextlib
    import io

    from recipe.config import load_config
    from recipe.envs.base import RewardResult
    from recipe.envs.math import MathEnv
    from recipe.rl import loop
    from recipe.runs import stage_dir

    # a random model never answers right, and groups without signal are dropped: reward a property of the text
    monkeypatch.setattr(MathEnv, "score", lambda self, text, row: RewardResult(float(sum(map(ord, text)) % 2)))

    root = served["root"] / "rl_runs"
    cfg = load_config([f"run_root={root}", "rl.engine=vllm", "rl.max_steps=2", "rl.checkpoint_every=2",
                       "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8",
                       "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.seed=0", "rl.gen_batch_size=8",
                       "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0"])
    write_math_rl_data(cfg)
    monkeypatch.setenv("RECIPE_INFERENCE_URLS", served["url"])
    log_before = served["log"].read_text()
    with contextlib.redirect_stdout(io.StringIO()):
        loop.run_rl(cfg, stage_dir(cfg, "rl"), served["folder"])
    records = [json.loads(x) for x in (stage_dir(cfg, "rl") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    new_lines = served["log"].read_text()[len(log_before):]
    assert len(re.findall(r"serve: loaded \d+ tensors from .*policy_00000[12]", new_lines)) == 2
    # leave the server on the start weights for whatever runs next
    back = write_weights(served["state"], served["root"] / "start.safetensors")
    served["eng"].update_weights(back, 0)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0) - {0}) < 1
                    or 0 not in os.sched_getaffinity(0), reason="needs core 0 and another to pin")
def test_rl_starts_its_server_on_the_cores_the_pinned_trainer_leaves(served, monkeypatch):
    """rl.pin_cores pins the trainer to core 0; the server rl.engine=vllm starts (here the hf engine's server in
    vLLM's place, through the same ServerProcess) runs on the other cores, not on the trainer's pin."""
    from recipe.config import load_config
    from recipe.inference.vllm import client
    from recipe.launch.roles import INFERENCE_URLS_ENV
    from recipe.rl import loop
    from recipe.runs import stage_dir

    monkeypatch.delenv(INFERENCE_URLS_ENV, raising=False)
    monkeypatch.setattr(client, "server_command", lambda path, cfg, host, port, generation_config:
                        hf_server_command(path, cfg, host=host, port=port))
    seen = {}

    def engine_only(cfg, stage, start_model, world, tracker):  # run_rl's pinning around the engine, no training
        engine = loop.make_engine(cfg, start_model, version=0, log_dir=stage)
        try:
            seen["trainer"] = os.sched_getaffinity(0)
            seen["server"] = os.sched_getaffinity(engine.server.proc.pid)
        finally:
            engine.close()

    monkeypatch.setattr(loop, "_rl_loop", engine_only)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = os.sched_getaffinity(0)
    cfg = load_config([f"run_root={served['root'] / 'pinned'}", "rl.engine=vllm", "rl.pin_cores=true",
                       f"rl.vllm_port={port}"])
    loop.run_rl(cfg, stage_dir(cfg, "rl"), served["folder"])
    assert seen == {"trainer": {0}, "server": cores - {0}}
    assert os.sched_getaffinity(0) == cores  # given back after the run


def test_sigterm_stops_the_server_and_frees_the_port(served):  # last: it stops the module's server
    proc, url = served["proc"], served["url"]
    assert port_open(url)
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert not port_open(url)
    assert "serve: stopped" in served["log"].read_text()
