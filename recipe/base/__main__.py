"""`make base` (tiny preset only): build the tokenizer and a tiny Glm4MoeForCausalLM, then pretrain it on plain
task-domain text so that it plays the base model: it knows the domain, not the chat format.

Presets with a hub model have nothing to do here: their base model is the hub id at its pinned revision.
"""
from __future__ import annotations

from datasets import Dataset

from recipe.data.schema import read_split, read_text_split
from recipe.errors import DataError
from recipe.model import build_tiny_model, build_tokenizer
from recipe.runs import Stage, stage_main
from recipe.sft import train_supervised


def base_stage(stage: Stage, upstream: dict) -> dict:
    cfg, data_dir = stage.cfg, upstream["data"]
    pretrain = read_text_split(data_dir, "pretrain")
    if not pretrain:
        raise DataError(f"{data_dir / 'pretrain.parquet'} has no rows: `make base` pretrains the tiny model on "
                        f"them (data.pretrain_rows_per_task >= 1)")
    sft_rows = read_split(data_dir, "sft")
    # the tokenizer sees the chat-formatted SFT text too, so the format's strings get their own merges
    chat_texts = [r["prompt"][0]["content"] + r["completion"][0]["content"] for r in sft_rows]
    tokenizer = build_tokenizer(pretrain + chat_texts, cfg.model.tiny.vocab_size)
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=cfg.seed)
    print(f"base: Glm4MoeForCausalLM with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    out = train_supervised(model, tokenizer, Dataset.from_dict({"text": pretrain}), cfg.base, stage.dir,
                           use_cpu=True)
    return {"inputs": {"pretrain": data_dir / "pretrain.parquet"}, "outputs": {"model": out}}


@stage_main
def main(cfg):
    if cfg.model.hub_id:
        print(f"base: the base model is {cfg.model.hub_id}@{cfg.model.revision}; nothing to pretrain")
        return
    Stage(cfg, "base").run(base_stage, requires=("data",))


if __name__ == "__main__":
    main()
