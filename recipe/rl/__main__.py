"""`make rl`: asynchronous GRPO from the SFT checkpoint (the loop: recipe.rl.loop), resumable.

launcher.num_processes > 1: this command re-runs itself under torchrun, one process a trainer rank. Only the
resolved config knows the count (a preset may set it), so the decision is taken here rather than in the Makefile.
Rank 0 does the stage's bookkeeping (lock, config.yaml, manifest, DONE.json) and tells the other ranks where to
train; they take no lock and write only their checkpoint shards.
"""
from __future__ import annotations

import sys
from pathlib import Path

from recipe.launch.roles import launched, relaunch
from recipe.rl.dist import World, close_world, init_world
from recipe.rl.loop import run_rl
from recipe.runs import Stage, require_done, stage_main

REQUIRES = ("sft", "data")


def lead(cfg, world: World) -> None:
    """Rank 0 (or the one process): the stage's life; the other ranks learn from it whether, and where, to train."""
    told = False

    def body(stage: Stage, upstream: dict) -> dict:
        nonlocal told
        start = upstream["sft"] / "model"
        world.broadcast((str(stage.dir), str(start)))
        told = True
        out = run_rl(stage.cfg, stage.dir, start, world)
        return {"inputs": {"sft_model": start, "rl_data": upstream["data"] / "rl.parquet"},
                "outputs": {"model": out}}

    try:
        Stage(cfg, "rl").run(body, requires=REQUIRES)
    finally:
        if not told:  # skipped (already done) or refused: nothing for the other ranks to do
            world.broadcast(None)


def follow(cfg, world: World) -> None:
    job = world.broadcast(None)
    if job is not None:
        stage_dir, start = job
        run_rl(cfg, Path(stage_dir), Path(start), world)


def run(cfg, argv: list[str]) -> None:
    if cfg.launcher.num_processes > 1 and not launched():
        return relaunch(cfg, "rl", REQUIRES, "recipe.rl", argv, cfg.rl.train_threads)
    world = init_world(cfg.launcher.collective_timeout_s)
    try:
        (lead if world.main else follow)(cfg, world)
    finally:
        close_world(world)


def main(argv=None):
    # the raw overrides are kept for the ranks' command line
    argv = sys.argv[1:] if argv is None else list(argv)
    return stage_main(lambda cfg: run(cfg, argv))(argv)


if __name__ == "__main__":
    main()
