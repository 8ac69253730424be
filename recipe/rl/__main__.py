"""`make rl`: asynchronous GRPO from the SFT checkpoint (the loop: recipe.rl.loop), resumable.

launcher.num_processes > 1: this command re-runs itself under torchrun, one process a trainer rank. Only the
resolved config knows the count (a preset may set it), so the decision is taken here rather than in the Makefile.
Rank 0 does the stage's bookkeeping (lock, config.yaml, manifest, DONE.json) and tells the other ranks where to
train; they take no lock and write only their checkpoint shards.
"""
from __future__ import annotations

from pathlib import Path

from recipe.rl.dist import World, run_stage_on_ranks
from recipe.rl.loop import run_rl
from recipe.runs import Stage, stage_argv, stage_main
from recipe.tracking import open_tracker

REQUIRES = ("sft", "data")


def lead(stage: Stage, upstream: dict, tell, world: World) -> dict:
    """Rank 0 (or the one process): the stage's body; the other ranks learn where to train."""
    start = upstream["sft"] / "model"
    with open_tracker(stage.cfg, "rl", stage.dir) as tracker:  # before the other ranks are told: it may refuse
        tell((str(stage.dir), str(start)))
        out = run_rl(stage.cfg, stage.dir, start, world, tracker)
    return {"inputs": {"sft_model": start, "rl_data": upstream["data"] / "rl.parquet"}, "outputs": {"model": out}}


def run(cfg, argv: list[str]) -> None:
    def follow(job, world: World) -> None:
        stage_dir, start = job
        run_rl(cfg, Path(stage_dir), Path(start), world)

    run_stage_on_ranks(cfg, argv, "rl", REQUIRES, cfg.rl.train_threads, lead, follow)


@stage_main
def main(cfg):
    run(cfg, stage_argv())  # the raw overrides, for the ranks' command line


if __name__ == "__main__":
    main()
