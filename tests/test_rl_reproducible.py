"""rl.max_async_level=0 run twice with the real hf engine process (issue 11, item 5).

The engine batches whatever requests are pending, so which requests share a batch depends on timing. Each row
now samples from a generator of its own, seeded with its own request's seed, so a group sampled with the same
weights gets the same tokens, hence the same rewards, in both runs. That is what this test asserts.

Gap (not bit-reproducible yet): (1) the orchestrator's background loop tops up groups while it waits, so how
many groups are submitted (and later dropped as stale, or filtered) before a batch is full depends on timing:
which groups make up a step's batch, and the per-step reward stat (which counts filtered groups), can still
differ run to run, and with them the trained weights. (2) on CPU a row's logits, hence its logprobs, move by
~1e-7 with its batch's composition (padding width, batch size); they enter the loss through the importance
ratio, so even identical batches give weights equal only to ~1e-6 unless both runs batched alike.
"""
import json


from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.envs.base import RewardResult
from recipe.envs.math import MathEnv
from recipe.rl import loop
from recipe.runs import Stage, stage_dir, write_atomic
from tests.fakes import save_tiny_qa_model


def test_two_level_0_runs_sample_the_same_tokens_for_every_group_sampled_with_the_same_weights(tmp_path, monkeypatch):
    start = tmp_path / "start_model"
    save_tiny_qa_model(start)
    cfg = load_config([f"run_root={tmp_path / 'runs'}", "rl.max_steps=3", "rl.checkpoint_every=3",
                       "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8", "rl.max_async_level=0",
                       "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.seed=0", "rl.lr=1e-2",
                       "rl.engine=hf", "rl.gen_batch_size=64",
                       "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0"])
    data = stage_dir(cfg, "data")
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "split": "rl", "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(40)]
    sha = write_rows(rows, data / "rl.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"rl.parquet": {"rows": 40, "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    # a random model never answers right: reward a property of the sampled text instead, so groups carry signal
    monkeypatch.setattr(MathEnv, "score", lambda self, text, row: RewardResult(float(sum(map(ord, text)) % 2)))

    from recipe.rl import orchestrator
    seen = []  # per run: {(group id, policy version): every sample's tokens}
    score = orchestrator.Orchestrator._score

    def recording_score(self, group):
        seen[-1][(group.gid, group.version)] = [tuple(group.completions[s].token_ids) for s in sorted(group.completions)]
        return score(self, group)

    monkeypatch.setattr(orchestrator.Orchestrator, "_score", recording_score)
    for name in ("rl_a", "rl_b"):
        seen.append({})
        loop.run_rl(cfg, tmp_path / name, start)
        assert [json.loads(ln)["step"] for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    a, b = seen
    common = a.keys() & b.keys()
    assert {v for _, v in common} >= {0}  # every group of step 1 is sampled with the start weights in both runs
    assert len(common) >= 2
    for key in common:
        assert a[key] == b[key], key
