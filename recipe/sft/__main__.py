"""`make sft`: SFT of the base model on the SFT split, loss on the model's own tokens only (TRL's SFTTrainer).

launcher.num_processes > 1: this command re-runs itself under torchrun (recipe.launch.roles.relaunch), one
process a rank, each running the Trainer on its share of every global batch (recipe.sft.train_supervised: DDP on
CPU, FSDP2 on GPUs). Rank 0 does the stage's bookkeeping (lock, config.yaml, metrics.jsonl, the final model,
manifest, DONE.json) and tells the other ranks where to train; they take no lock and write only their own RNG
state into each checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import torch

from recipe.data.schema import read_split
from recipe.model import load_pretrained
from recipe.rl.dist import World, run_stage_on_ranks
from recipe.runs import Stage, stage_argv, stage_main
from recipe.sft import chat_dataset, per_device_batch, train_supervised
from recipe.tracking import TrainerTracking


def requires(cfg) -> tuple[str, ...]:
    # tiny: the model `make base` pretrained here; hub presets: the hub model at its pinned revision
    return ("data",) if cfg.model.hub_id else ("data", "base")


def train(cfg, stage_dir: Path, data_dir: Path, base: str, world: World) -> Path:
    tracking = TrainerTracking(cfg, "sft", stage_dir)  # a missing tracking package stops it before the model
    rows = read_split(data_dir, "sft")
    model, tokenizer = load_pretrained(base, cfg.model.revision, cfg.model.dtype, cfg.model.attn_implementation)
    return train_supervised(model, tokenizer, chat_dataset(rows, tokenizer), cfg.sft, stage_dir,
                            use_cpu=not torch.cuda.is_available(), world=world, key="sft", tracking=tracking)


def run(cfg, argv: list[str]) -> None:
    per_device_batch(cfg.sft, "sft", cfg.launcher.num_processes)  # refused before any rank starts

    def lead(stage: Stage, upstream: dict, tell, world: World) -> dict:
        """Rank 0 (or the one process): the stage's body; the other ranks learn where to train."""
        base = cfg.model.hub_id or str(upstream["base"] / "model")
        tell((str(stage.dir), str(upstream["data"]), base))
        out = train(stage.cfg, stage.dir, upstream["data"], base, world)
        return {"inputs": {"sft_data": upstream["data"] / "sft.parquet"}, "outputs": {"model": out}}

    def follow(job, world: World) -> None:
        stage_dir, data_dir, base = job
        train(cfg, Path(stage_dir), Path(data_dir), base, world)

    run_stage_on_ranks(cfg, argv, "sft", requires(cfg), cfg.sft.threads, lead, follow,
                       cpu=not torch.cuda.is_available())


@stage_main
def main(cfg):
    run(cfg, stage_argv())  # the raw overrides, for the ranks' command line


if __name__ == "__main__":
    main()
