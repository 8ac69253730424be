"""`make base` (tiny preset only): build the tokenizer and a tiny Glm4MoeForCausalLM, then pretrain it on plain
task-domain text so that it plays the base model: it knows the domain, not the chat format.

Presets with a hub model have nothing to do here: their base model is the hub id at its pinned revision.

launcher.num_processes > 1: as `make sft` (recipe.sft.__main__), this command re-runs itself under torchrun and
every rank runs the same Trainer (DDP over gloo: the tiny model trains on the CPU); rank 0 does the stage's
bookkeeping, trains the tokenizer and hands it to the other ranks.
"""
from __future__ import annotations

from pathlib import Path

from datasets import Dataset

from recipe.data.schema import read_split, read_text_split
from recipe.errors import DataError
from recipe.model import build_tiny_model, build_tokenizer, tokenizer_from_str
from recipe.rl.dist import World, run_stage_on_ranks
from recipe.runs import Stage, stage_argv, stage_main
from recipe.sft import per_device_batch, train_supervised
from recipe.tracking import TrainerTracking

REQUIRES = ("data",)


def train(cfg, stage_dir: Path, pretrain: list[str], tokenizer, world: World) -> Path:
    tracking = TrainerTracking(cfg, "base", stage_dir)  # a missing tracking package stops it before the model
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=cfg.seed)
    if world.main:
        print(f"base: Glm4MoeForCausalLM with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    return train_supervised(model, tokenizer, Dataset.from_dict({"text": pretrain}), cfg.base, stage_dir,
                            use_cpu=True, world=world, key="base", tracking=tracking)


def lead(stage: Stage, upstream: dict, tell, world: World) -> dict:
    """Rank 0 (or the one process): the stage's body; the other ranks get the stage folder and the tokenizer."""
    data_dir = upstream["data"]
    pretrain = read_text_split(data_dir, "pretrain")
    if not pretrain:
        raise DataError(f"{data_dir / 'pretrain.parquet'} has no rows: `make base` pretrains the tiny model on "
                        f"them (data.pretrain_rows_per_task >= 1)")
    sft_rows = read_split(data_dir, "sft")
    # the tokenizer sees the chat-formatted SFT text too, so the format's strings get their own merges
    chat_texts = [r["prompt"][0]["content"] + r["completion"][0]["content"] for r in sft_rows]
    tokenizer = build_tokenizer(pretrain + chat_texts, stage.cfg.model.tiny.vocab_size)
    tell((str(stage.dir), str(data_dir), tokenizer.backend_tokenizer.to_str()))
    out = train(stage.cfg, stage.dir, pretrain, tokenizer, world)
    return {"inputs": {"pretrain": data_dir / "pretrain.parquet"}, "outputs": {"model": out}}


def run(cfg, argv: list[str]) -> None:
    if cfg.model.hub_id:
        print(f"base: the base model is {cfg.model.hub_id}@{cfg.model.revision}; nothing to pretrain")
        return
    per_device_batch(cfg.base, "base", cfg.launcher.num_processes)  # refused before any rank starts

    def follow(job, world: World) -> None:
        stage_dir, data_dir, tokenizer = job
        train(cfg, Path(stage_dir), read_text_split(Path(data_dir), "pretrain"), tokenizer_from_str(tokenizer),
              world)

    run_stage_on_ranks(cfg, argv, "base", REQUIRES, cfg.base.threads, lead, follow, cpu=True)


@stage_main
def main(cfg):
    run(cfg, stage_argv())  # the raw overrides, for the ranks' command line


if __name__ == "__main__":
    main()
