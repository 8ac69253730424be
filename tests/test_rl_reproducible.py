"""rl.max_async_level=0 is reproducible bit for bit: the real RL loop (recipe.rl.loop.run_rl, with the hf engine in
a process of its own) run twice gives the same metrics, the same samples and the same final weights.

What makes it so (recipe/rl/orchestrator.py, "Level 0"): every request samples from its own seed, and each engine
batch holds the same requests in every run (one submit call a round, sent once the round before is back), so
even the logits, which move by ~1e-7 on CPU with a batch's composition, repeat exactly.

The run has what makes batches differ when timing leaks in: groups with signal and filtered groups (the math
reward is faked as a property of the sampled text: a random model never answers right), multi-turn tool groups
(the tools environment answers every turn that stops, so samples go on for a second turn while others are
replaced or done), and gen_batch_size smaller than a round, so a round takes several engine batches.

Not covered: levels 1 and 2 (asynchronous by design: which groups make a batch depends on timing), the vllm
engine (its server batches as it likes), and runs on different hardware or thread counts.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.envs.base import RewardResult
from recipe.envs.math import MathEnv
from recipe.envs.tools import ToolsEnv
from recipe.rl import loop
from recipe.rl import orchestrator
from recipe.runs import Stage, stage_dir, write_atomic
from tests.fakes import save_tiny_qa_model

# every metrics field that measures time: it alone may differ between the runs
TIMING = {"wait_s", "gen_busy_s", "orchestrator_busy_s", "gen_wait_s", "train_s", "step_s", "samples_per_s",
          "elapsed_s", "publish_s", "checkpoint_s"}
STEPS = 4


def rl_rows() -> list[dict]:
    def one(i: int, env: str) -> dict:
        return {"id": f"{env}{i}", "env": env, "task": "add", "split": "rl", "prompt": [message("user", f"Q{i}")],
                "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"}
    return [one(i, "math") for i in range(30)] + [one(i, "tools") for i in range(30)]


def text_reward(self, text, row):  # a random model never answers right: reward a property of the text instead
    return RewardResult(float(sum(map(ord, text)) % 2))


@pytest.mark.parametrize("staleness", ["drop_stale", "prime_rl"])  # level 0 is synchronous under either rule
def test_two_level_0_runs_repeat_metrics_samples_and_weights_bit_for_bit(tmp_path, monkeypatch, staleness):
    start = tmp_path / "start_model"
    save_tiny_qa_model(start)
    cfg = load_config([f"run_root={tmp_path / 'runs'}", f"rl.max_steps={STEPS}", f"rl.checkpoint_every={STEPS}",
                       f"rl.staleness={staleness}",
                       "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=16", "rl.max_async_level=0",
                       "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.seed=0", "rl.lr=1e-2",
                       "rl.engine=hf", "rl.gen_batch_size=3",  # a round of 4 requests takes two engine batches
                       "~rl.env_mix.logic", "~rl.env_mix.code", "rl.env_mix.math=0.5", "rl.env_mix.tools=0.5"])
    data = stage_dir(cfg, "data")
    rows = rl_rows()
    sha = write_rows(rows, data / "rl.parquet")
    write_atomic(data / "data_manifest.json",
                 json.dumps({"files": {"rl.parquet": {"rows": len(rows), "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    monkeypatch.setattr(MathEnv, "score", text_reward)
    monkeypatch.setattr(ToolsEnv, "score", text_reward)
    # every turn that stops gets a reply (a random model writes no tool call), up to the environment's max_turns
    monkeypatch.setattr(ToolsEnv, "tool_reply", lambda self, turn, row: "<tool_response>7</tool_response>")

    seen = []  # per run: {group id: (policy version, every sample's tokens, logprobs and loss mask)}
    score = orchestrator.Orchestrator._score

    def recording_score(self, group):
        seen[-1][group.gid] = (group.version, [(c.token_ids, c.logprobs, c.loss_mask, c.turns)
                                               for c in (group.completions[s] for s in sorted(group.completions))])
        return score(self, group)

    monkeypatch.setattr(orchestrator.Orchestrator, "_score", recording_score)
    records, weights = [], []
    for name in ("rl_a", "rl_b"):
        seen.append({})
        final = loop.run_rl(cfg, tmp_path / name, start)
        records.append([json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
        weights.append(load_file(str(final / "model.safetensors")))
    a, b = records
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert {k for r in a for k in r if k.endswith("_s")} == TIMING  # a new timing field is named above
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in b]
    # the run had what it is meant to have: groups filtered, tool turns, a second policy version sampled
    assert sum(r["filtered_groups"] for r in a) >= 1 and sum(r["tool_calls"] for r in a) >= 1
    assert any(turns > 1 for _, samples in seen[0].values() for *_, turns in samples)
    assert seen[0] == seen[1]  # every group scored: same tokens, same logprobs (bitwise), same versions
    assert {v for v, _ in seen[0].values()} == set(range(STEPS))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    start_weights = load_file(str(start / "model.safetensors"))
    assert not all(torch.equal(weights[0][k], start_weights[k]) for k in weights[0])  # training moved them
