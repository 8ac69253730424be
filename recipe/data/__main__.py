"""`make data`: write the SFT, RL and eval datasets in the fixed schema, with a sha256 manifest.

tiny: procedural tasks generated here. intellect3 (and other hub presets): PrimeIntellect/INTELLECT-3-SFT and -RL
at pinned revisions, converted to the same schema.
"""
from __future__ import annotations

import json

from recipe.config import DataSource
from recipe.data.hub import build_intellect3
from recipe.data.schema import TEXT_SCHEMA, write_parquet, write_rows
from recipe.data.tiny import build_tiny
from recipe.runs import Stage, stage_main, write_atomic

BUILDERS = {DataSource.tiny: build_tiny, DataSource.intellect3: build_intellect3}


def data_stage(stage: Stage, upstream: dict) -> dict:
    splits = BUILDERS[stage.cfg.data.source](stage.cfg.data)
    files = {}
    for split, rows in splits.items():
        path = stage.dir / f"{split}.parquet"
        # pretrain holds plain text for the tiny base model; every other split is schema rows
        sha = write_parquet(rows, TEXT_SCHEMA, path) if split == "pretrain" else write_rows(rows, path)
        files[path.name] = {"rows": len(rows), "sha256": sha}
        print(f"data: {split:9s} {len(rows):7d} rows -> {path}")
    write_atomic(stage.dir / "data_manifest.json", json.dumps({"files": files}, indent=2, sort_keys=True))
    return {"inputs": {}, "outputs": {"data": stage.dir / "data_manifest.json"}, "extra": {"files": files}}


@stage_main
def main(cfg):
    Stage(cfg, "data").run(data_stage, fresh=True)  # cheap to redo: a killed run simply starts over


if __name__ == "__main__":
    main()
