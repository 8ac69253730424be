"""`make data`: write the SFT, RL and eval datasets in the fixed schema, with a sha256 manifest.

tiny: procedural tasks generated here. intellect3 (and other hub presets): PrimeIntellect/INTELLECT-3-SFT and -RL
at pinned revisions, converted to the same schema.
"""
from __future__ import annotations

import json

from recipe.data.schema import TEXT_SCHEMA, write_parquet, write_rows
from recipe.runs import Stage, stage_main, write_atomic


def build(cfg) -> dict[str, list[dict]]:
    if cfg.data.source == "tiny":
        from recipe.data.tiny import build_tiny

        return build_tiny(cfg.data)
    if cfg.data.source == "intellect3":
        from recipe.data.hub import build_intellect3

        return build_intellect3(cfg.data)
    raise ValueError(f"data.source must be 'tiny' or 'intellect3', got '{cfg.data.source}'")


@stage_main
def main(cfg):
    stage = Stage(cfg, "data")
    if stage.is_done():
        print(f"data: already done ({stage.dir}); nothing to do")
        return
    stage.begin(fresh=True)  # cheap to redo: a killed run simply starts over
    splits = build(cfg)
    files = {}
    for split, rows in splits.items():
        path = stage.dir / f"{split}.parquet"
        # pretrain holds plain text for the tiny base model; every other split is schema rows
        sha = write_parquet(rows, TEXT_SCHEMA, path) if split == "pretrain" else write_rows(rows, path)
        files[path.name] = {"rows": len(rows), "sha256": sha}
        print(f"data: {split:9s} {len(rows):7d} rows -> {path}")
    write_atomic(stage.dir / "data_manifest.json", json.dumps({"files": files}, indent=2, sort_keys=True))
    stage.finish(inputs={}, outputs={"data": stage.dir / "data_manifest.json"}, extra={"files": files})


if __name__ == "__main__":
    main()
