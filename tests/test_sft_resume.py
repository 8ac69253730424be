"""SFT/base resume (recipe.sft.train_supervised) on a tiny Glm4MoeForCausalLM: a run killed at step k and resumed
ends where an uninterrupted run ends, routed experts included; a broken newest checkpoint is skipped; the token
counter continues; a checkpoint that does not match the model is an error."""
import json
import shutil

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import Trainer

from recipe.config import TinyArch, TrainConfig
from recipe.errors import StageError
from recipe.model import build_tiny_model, build_tokenizer
from recipe.sft import last_complete_checkpoint, train_supervised

K = 3  # the interrupted run stops (with a checkpoint) after K steps, and resumes to 2K
TEXTS = [f"the sum of {i} and {i * 7 % 13} is {i + i * 7 % 13}." for i in range(32)]  # 2K batches in one epoch
ARCH = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64)


def train_cfg(max_steps, save_steps=K, group_by_length=False, rows_per_sequence=1):
    # a constant LR without warmup: a run to K then resumed to 2K follows the schedule of one run to 2K, as a run
    # to 2K killed after its checkpoint at K does (the cosine schedule and warmup depend on max_steps)
    return TrainConfig(max_steps=max_steps, batch_size=4, lr=1e-2, warmup_ratio=0.0, scheduler="constant",
                       max_length=32, save_steps=save_steps, save_total_limit=3, logging_steps=1, threads=1,
                       group_by_length=group_by_length, rows_per_sequence=rows_per_sequence)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, 300)


def train(tok, stage_dir, max_steps, seed=0, save_steps=K, model=None, group_by_length=False, rows_per_sequence=1):
    model = model or build_tiny_model(ARCH, tok, seed=seed)
    train_supervised(model, tok, Dataset.from_dict({"text": TEXTS}),
                     train_cfg(max_steps, save_steps, group_by_length, rows_per_sequence), stage_dir, use_cpu=True)
    return model


def metrics(stage_dir):
    rows = [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}  # the end-of-train summary line has no loss


BATCHES = {"random": {}, "group_by_length": {"group_by_length": True}, "packed": {"rows_per_sequence": 2}}


@pytest.fixture(scope="module", params=list(BATCHES))
def runs(tok, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("resume")
    how = BATCHES[request.param]
    whole = train(tok, root / "whole", 2 * K, **how)
    train(tok, root / "cut", K, **how)
    # `make` after a kill: a fresh process builds the model again and finds checkpoint-K in the same folder
    resumed = train(tok, root / "cut", 2 * K, **how)
    return {"root": root, "whole": whole, "resumed": resumed,
            "whole_metrics": metrics(root / "whole"), "cut_metrics": metrics(root / "cut")}


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(runs):
    whole, cut = runs["whole_metrics"], runs["cut_metrics"]
    assert sorted(whole) == sorted(cut) == list(range(1, 2 * K + 1))
    # the first step after the resume sees the same weights, optimizer state and batch as the uninterrupted run
    assert cut[K + 1]["loss"] == pytest.approx(whole[K + 1]["loss"], rel=1e-6, abs=1e-7)
    a, b = runs["whole"].state_dict(), runs["resumed"].state_dict()
    assert any("mlp.experts.gate_up_proj" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


def test_the_token_counter_continues_across_a_resume(runs):
    whole, cut = runs["whole_metrics"], runs["cut_metrics"]
    assert [cut[s]["num_tokens"] for s in cut] == [whole[s]["num_tokens"] for s in whole]
    assert cut[K + 1]["num_tokens"] > cut[K]["num_tokens"]


def test_packed_batches_follow_padded_ones(tok, tmp_path, monkeypatch):
    """rows_per_sequence=2: the same rows a step, two to a sequence. The loss of every step and the token count are
    the padded run's (the same label tokens, each row seeing only itself), and the padding no more. The packed run
    attends row by row (sdpa_rows, at every layer of every step) and hands the model back with sdpa_gqa."""
    from transformers import AttentionInterface

    from recipe.model.attention import SDPA_GQA, SDPA_ROWS, sdpa_rows_attention

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("position_ids") is not None and args[4] is None)  # rows from positions, no mask
        return sdpa_rows_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, SDPA_ROWS, counted)
    padded = train(tok, tmp_path / "padded", 2 * K)
    assert calls == []
    packed = train(tok, tmp_path / "packed", 2 * K, rows_per_sequence=2)
    assert calls == [True] * (2 * K * ARCH.num_hidden_layers)
    assert packed.config._attn_implementation == padded.config._attn_implementation == SDPA_GQA
    a, b = metrics(tmp_path / "padded"), metrics(tmp_path / "packed")
    assert [a[s]["num_tokens"] for s in a] == [b[s]["num_tokens"] for s in b]
    for s in a:
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-4), s
        assert b[s]["padding"] <= a[s]["padding"]
    # the same weights up to float rounding, which Adam magnifies where a gradient is near zero (it moves such an
    # element by up to lr, 1e-2, a step, whatever the gradient's size): each element within a tenth of one step
    # (one of 38308 differed by 1.01e-4 on an AMD EPYC), and the whole, on average, far closer
    diffs = []
    for k, t in padded.state_dict().items():
        torch.testing.assert_close(packed.state_dict()[k], t, atol=1e-3, rtol=0, msg=lambda m: f"{k}: {m}")
        diffs.append((packed.state_dict()[k] - t).abs().flatten())
    assert torch.cat(diffs).mean() < 1e-6


class Loaded(Exception):
    pass


def test_resume_loads_every_checkpoint_tensor_into_the_model(runs, tok, tmp_path, monkeypatch):
    """The checkpoint holds one key per expert; the model fused ones. Right after the resume's load (the Trainer
    loads a checkpoint before its training loop, stopped here) every tensor of the model is the checkpoint's,
    checked key by key, with the experts fused here by hand."""
    ckpt = runs["root"] / "cut" / "checkpoints" / f"checkpoint-{K}"
    shutil.copytree(ckpt, tmp_path / "checkpoints" / ckpt.name)
    model = build_tiny_model(ARCH, tok, seed=7)  # another init: nothing can match by chance

    def stop(self, *args, **kwargs):
        raise Loaded

    monkeypatch.setattr(Trainer, "_inner_training_loop", stop)
    with pytest.raises(Loaded):
        train(tok, tmp_path, 2 * K, model=model)
    saved, live = load_file(str(ckpt / "model.safetensors")), model.state_dict()
    n = ARCH.n_routed_experts
    used = set()
    for name, t in live.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name.removesuffix("gate_up_proj")
            keys = [[f"{pre}{e}.gate_proj.weight", f"{pre}{e}.up_proj.weight"] for e in range(n)]
            want = torch.stack([torch.cat([saved[g], saved[u]]) for g, u in keys])
            used.update(k for pair in keys for k in pair)
        elif name.endswith("mlp.experts.down_proj"):
            keys = [f"{name.removesuffix('down_proj')}{e}.down_proj.weight" for e in range(n)]
            want = torch.stack([saved[k] for k in keys])
            used.update(keys)
        else:
            want = saved[name]
            used.add(name)
        assert torch.equal(t, want), name
    assert used == set(saved)


@pytest.mark.parametrize("drop", [".experts.1.up_proj", "model.norm.weight"])
def test_a_checkpoint_that_does_not_match_the_model_is_an_error(runs, tok, tmp_path, drop):
    """An expert that cannot be fused, or a weight from_pretrained would fill with a fresh init: no resume."""
    ckpt = tmp_path / "checkpoints" / f"checkpoint-{K}"
    shutil.copytree(runs["root"] / "cut" / "checkpoints" / ckpt.name, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors[next(k for k in tensors if drop in k)]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StageError, match="does not match the model"):
        train(tok, tmp_path, 2 * K)


@pytest.fixture(scope="module")
def two_checkpoints(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    train(tok, root, 2, save_steps=1)
    return root / "checkpoints"


def truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [
    lambda c: truncate(c / "model.safetensors"),
    lambda c: truncate(c / "optimizer.pt"),
    lambda c: (c / "trainer_state.json").unlink(),
    lambda c: (c / "optimizer.pt").unlink(),
], ids=["truncated-weights", "truncated-optimizer", "no-trainer-state", "no-optimizer"])
def test_a_broken_newest_checkpoint_falls_back_to_the_one_before(two_checkpoints, tmp_path, damage, capsys):
    ckpts = shutil.copytree(two_checkpoints, tmp_path / "checkpoints")
    assert last_complete_checkpoint(ckpts) == str(ckpts / "checkpoint-2")
    capsys.readouterr()
    damage(ckpts / "checkpoint-2")
    assert last_complete_checkpoint(ckpts) == str(ckpts / "checkpoint-1")
    skipped = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("skipping")]
    assert len(skipped) == 1 and "checkpoint-2" in skipped[0]
    assert not (ckpts / "checkpoint-2").exists()


def test_a_run_resumes_from_the_checkpoint_before_a_truncated_one(two_checkpoints, tok, tmp_path, capsys):
    ckpts = shutil.copytree(two_checkpoints, tmp_path / "checkpoints")
    truncate(ckpts / "checkpoint-2" / "model.safetensors")
    train(tok, tmp_path, 3, save_steps=1)
    out = capsys.readouterr().out
    assert "skipping checkpoint-2: model.safetensors is" in out and "checkpoint-1 (step 1)" in out
    assert sorted(metrics(tmp_path)) == [2, 3]  # metrics.jsonl is written afresh by this run
