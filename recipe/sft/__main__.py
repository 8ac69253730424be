"""`make sft`: SFT of the base model on the SFT split, loss on the model's own tokens only (TRL's SFTTrainer)."""
from __future__ import annotations

import torch

from recipe.runs import Stage, require_done, stage_main


def base_model_path(cfg) -> str:
    return cfg.model.hub_id or str(require_done(cfg, "base") / "model")


@stage_main
def main(cfg):
    from recipe.data.schema import read_split
    from recipe.model import load_pretrained
    from recipe.sft import chat_dataset, train_supervised

    stage = Stage(cfg, "sft")
    if stage.is_done():
        print(f"sft: already done ({stage.dir}); nothing to do")
        return
    data_dir = require_done(cfg, "data")
    rows = read_split(data_dir, "sft")
    stage.begin()
    model, tokenizer = load_pretrained(base_model_path(cfg), cfg.model.revision, cfg.model.dtype,
                                       cfg.model.attn_implementation)
    out = train_supervised(model, tokenizer, chat_dataset(rows, tokenizer), cfg.sft, stage.dir,
                           use_cpu=not torch.cuda.is_available())
    stage.finish(inputs={"sft_data": data_dir / "sft.parquet"}, outputs={"model": out})


if __name__ == "__main__":
    main()
