"""`make rl`: asynchronous GRPO from the SFT checkpoint (the loop: recipe.rl.loop), resumable."""
from __future__ import annotations

from recipe.rl.loop import run_rl
from recipe.runs import Stage, stage_main


def rl_stage(stage: Stage, upstream: dict) -> dict:
    out = run_rl(stage.cfg, stage.dir, upstream["sft"] / "model")
    return {"inputs": {"sft_model": upstream["sft"] / "model", "rl_data": upstream["data"] / "rl.parquet"},
            "outputs": {"model": out}}


@stage_main
def main(cfg):
    Stage(cfg, "rl").run(rl_stage, requires=("sft", "data"))


if __name__ == "__main__":
    main()
