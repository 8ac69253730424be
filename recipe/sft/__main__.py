"""`make sft`: SFT of the base model on the SFT split, loss on the model's own tokens only (TRL's SFTTrainer)."""
from __future__ import annotations

import torch

from recipe.data.schema import read_split
from recipe.model import load_pretrained
from recipe.runs import Stage, stage_main
from recipe.sft import chat_dataset, train_supervised


def sft_stage(stage: Stage, upstream: dict) -> dict:
    cfg = stage.cfg
    rows = read_split(upstream["data"], "sft")
    # tiny: the model `make base` pretrained here; hub presets: the hub model at its pinned revision
    base = cfg.model.hub_id or str(upstream["base"] / "model")
    model, tokenizer = load_pretrained(base, cfg.model.revision, cfg.model.dtype, cfg.model.attn_implementation)
    out = train_supervised(model, tokenizer, chat_dataset(rows, tokenizer), cfg.sft, stage.dir,
                           use_cpu=not torch.cuda.is_available())
    return {"inputs": {"sft_data": upstream["data"] / "sft.parquet"}, "outputs": {"model": out}}


@stage_main
def main(cfg):
    Stage(cfg, "sft").run(sft_stage, requires=("data",) if cfg.model.hub_id else ("data", "base"))


if __name__ == "__main__":
    main()
