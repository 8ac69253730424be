"""`make eval`: every finished checkpoint (base, sft, rl) on the held-out suite, then RESULTS.md."""
from __future__ import annotations

import hashlib
import json
import time

import torch

from recipe.config import config_hash
from recipe.runs import (STAGE_KEYS, Stage, StageError, provenance, sha256_tree, stage_dir, stage_main,
                         write_atomic)


def checkpoint_path(cfg, name: str):
    """Model folder of a stage's output; for hub presets 'base' is the hub model itself."""
    if name == "base" and cfg.model.hub_id:
        return cfg.model.hub_id
    d = stage_dir(cfg, name)
    if name not in ("base", "sft", "rl"):
        raise StageError(f"eval.checkpoints: unknown checkpoint '{name}' (known: base, sft, rl)")
    return d / "model" if (d / "DONE.json").exists() else None


def make_eval_engine(cfg, path, out_dir):
    if cfg.eval.engine == "hf":
        from recipe.inference.hf import HFEngine

        return HFEngine.from_pretrained(str(path), batch_size=cfg.eval.batch_size)
    if cfg.eval.engine == "vllm":
        from recipe.inference.vllm import VLLMEngine

        return VLLMEngine(str(path), cfg, log_path=out_dir / "vllm_server.log")
    raise ValueError(f"eval.engine must be 'hf' or 'vllm', got '{cfg.eval.engine}'")


@stage_main
def main(cfg):
    from recipe.data.schema import read_split
    from recipe.eval.report import write_report
    from recipe.eval.runner import evaluate

    torch.set_num_threads(cfg.eval.threads)
    stage = Stage(cfg, "eval")
    data_dir = stage_dir(cfg, "data")
    rows = read_split(data_dir, "eval")
    if cfg.eval.max_problems_per_task:
        per_task: dict[str, int] = {}
        kept = []
        for r in rows:
            per_task[r["task"]] = per_task.get(r["task"], 0) + 1
            if per_task[r["task"]] <= cfg.eval.max_problems_per_task:
                kept.append(r)
        rows = kept
    stage.dir.mkdir(parents=True, exist_ok=True)
    for name in cfg.eval.checkpoints:
        path = checkpoint_path(cfg, name)
        if path is None:
            print(f"eval: checkpoint '{name}' not finished ({stage_dir(cfg, name)}); skipped: run `make {name}`")
            continue
        out = stage.dir / name
        model_sha = hashlib.sha256(json.dumps(sha256_tree(path), sort_keys=True).encode()).hexdigest()[:16] \
            if not isinstance(path, str) else f"{path}@{cfg.model.revision}"
        key = f"{config_hash(cfg, ['eval'])}-{model_sha}-{len(rows)}"
        results_path = out / "results.json"
        if results_path.exists() and json.loads(results_path.read_text()).get("key") == key:
            print(f"eval: {name} already evaluated ({results_path}); nothing to do")
            continue
        if results_path.exists():  # another model or eval config: start this checkpoint over
            for f in out.iterdir():
                f.unlink()
        started = time.time()
        engine = make_eval_engine(cfg, path, out)
        try:
            res = evaluate(engine, engine.tokenizer, rows, cfg.eval, out, desc=f"eval {name}")
        finally:
            if hasattr(engine, "close"):
                engine.close()
        res.update({"key": key, "checkpoint": name, "model_sha": model_sha})
        res["provenance"] = provenance(cfg, f"eval/{name}", config_hash(cfg, STAGE_KEYS["eval"]), started,
                                       inputs={"model": path, "eval_data": data_dir / "eval.parquet"},
                                       outputs={"samples": out / "samples.jsonl"})
        write_atomic(results_path, json.dumps(res, indent=2, sort_keys=True))
        print(f"eval: {name}: " + ", ".join(f"{e} {v.get(f'avg@{cfg.eval.samples}', 0):.3f}"
                                             for e, v in res["env"].items()))
    path = write_report(cfg)
    print(f"eval: wrote {path}")


if __name__ == "__main__":
    main()
