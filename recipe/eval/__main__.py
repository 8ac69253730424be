"""`make eval`: every finished checkpoint (base, sft, rl) on the held-out suite and on the paper's benchmarks
that eval.benchmarks lists (each with its own k and sampling), then RESULTS.md.

Output: eval/<checkpoint>/{results.json, samples.jsonl} for the held-out suite and
eval/<checkpoint>/<benchmark>/{results.json, samples.jsonl} for each benchmark; one engine serves them all. The
held-out scores also go into the card of each evaluated model folder (README.md, recipe/model_card.py).

Sampling: what the eval config leaves null comes from the checkpoint's generation_config.json, as the release
evals' vLLM servers took it (recipe/eval/sampling.py); each results.json records every setting with its source
(`sampling` for the held-out suite, `protocol` for a benchmark). The vLLM servers run with
`--generation-config auto` for the same reason.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recipe.chat import encode_prompt
from recipe.config import CheckpointName, EngineKind, config_hash, drop_unset_top_k
from recipe.data.schema import read_split
from recipe.errors import StageError
from recipe.eval import sampling
from recipe.eval.benchmarks import load_benchmark, resolve, run_benchmark, validate_benchmarks
from recipe.eval.report import write_report
from recipe.eval.runner import evaluate, model_context
from recipe.inference.hf import HFEngine
from recipe.inference.vllm import VLLMEngine
from recipe.model_card import write_card
from recipe.runs import (STAGE_KEYS, Stage, done_hash, provenance, require_done, sha256_tree, stage_dir, stage_main,
                         write_atomic)
from recipe.tracking import Tracker, open_tracker

# eval keys that only concern the benchmarks: left out of the held-out suite's key, so that adding a benchmark
# does not redo the held-out eval (and the key stays what it was before these keys existed)
BENCHMARK_KEYS = ("held_out", "benchmarks", "benchmark_max_problems", "hub_timeout_s")


def checkpoint_path(cfg, name: str):
    """Model folder of a stage's output, None when the stage has not finished; for hub presets 'base' is the hub
    model itself. A stage finished under another config than this one is refused (recipe.runs.require_done)."""
    if name == "base" and cfg.model.hub_id:
        return cfg.model.hub_id
    d = stage_dir(cfg, name)
    if name not in ("base", "sft", "rl"):
        raise StageError(f"eval.checkpoints: unknown checkpoint '{name}' (known: base, sft, rl)")
    return require_done(cfg, name, by="eval") / "model" if (d / "DONE.json").exists() else None


def make_eval_engine(cfg, path, out_dir):
    if cfg.eval.engine == EngineKind.hf:
        return HFEngine.from_pretrained(str(path), batch_size=cfg.eval.batch_size)
    # `auto`: the model's generation_config.json is the server's default, as in the release evals
    return VLLMEngine(str(path), cfg, log_path=out_dir / "vllm_server.log", generation_config="auto")


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def held_out_hash(cfg) -> str:
    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    drop_unset_top_k(ev)
    return _sha({"eval": {k: v for k, v in ev.items() if k not in BENCHMARK_KEYS}})


def generation_config(cfg, path) -> dict:
    """The sampling keys of the checkpoint's generation_config.json: a model folder's, or the hub model's at the
    pinned revision (base of a hub preset)."""
    return sampling.read_generation_config(path, None if isinstance(path, Path) else cfg.model.revision)


def held_out_config(cfg, chosen: dict, engine, rows: list[dict]):
    """cfg.eval with the held-out suite's sampling settings resolved (`chosen`, sampling.resolve) and its
    max_new_tokens fitted to the engine's context; returns (that config, the settings with their sources)."""
    longest = max((len(encode_prompt(engine.tokenizer, r["prompt"])) for r in rows), default=0)
    chosen = sampling.fit_max_new_tokens(chosen, longest, model_context(engine))
    return dataclasses.replace(OmegaConf.to_object(cfg.eval), **{k: chosen[k] for k in sampling.KEYS}), chosen


def held_out_rows(cfg) -> list[dict]:
    rows = read_split(require_done(cfg, "data", by="eval"), "eval")
    if cfg.eval.max_problems_per_task:
        per_task: dict[str, int] = {}
        kept = []
        for r in rows:
            per_task[r["task"]] = per_task.get(r["task"], 0) + 1
            if per_task[r["task"]] <= cfg.eval.max_problems_per_task:
                kept.append(r)
        rows = kept
    return rows


def _up_to_date(folder: Path, key: str) -> bool:
    """True when folder/results.json was written with this key and has nothing masked. A different key (another
    model or eval config) clears the folder's files, so the run starts over; the same key with masked problems
    keeps the samples, so a rerun redoes only those. Files only: benchmark folders sit beside them."""
    path = folder / "results.json"
    if not path.exists():
        return False
    try:
        res = json.loads(path.read_text())
    except ValueError:  # damaged (not JSON, not UTF-8): redone from scratch, like a results file of another key
        print(f"eval: {path} is damaged; evaluating again")
        res = {}
    if not isinstance(res, dict) or res.get("key") != key:
        for f in folder.iterdir():
            if f.is_file():
                f.unlink()
        return False
    return not res.get("masked_problems")


@stage_main
def main(cfg):
    validate_benchmarks(cfg.eval)
    torch.set_num_threads(cfg.eval.threads)
    stage = Stage(cfg, "eval")
    with stage.locked(), open_tracker(cfg, "eval", stage.dir) as tracker:  # one eval at a time in a run folder
        run_eval(cfg, stage, tracker)
    path = write_report(cfg)
    print(f"eval: wrote {path}")


def scores(spec, res: dict) -> dict:
    """What the tracker gets of one results.json: the held-out suite's overall and per-environment scores, or a
    benchmark's own, under the suite's name."""
    if spec is None:
        return {"held_out": {"overall": res["overall"], "env": res["env"]}}
    return {spec.name: res["benchmark"]}


def update_card(cfg, name: str, folder: Path, results_path: Path, key: str) -> None:
    """Write the model folder's card again, with the held-out scores of this model under this eval config
    (results.json's key says so), or with none. A folder without the stage's manifest was not made by a stage
    (a test's stand-in): it gets no card."""
    if not (stage_dir(cfg, name) / "manifest.json").exists():
        return
    try:
        res = json.loads(results_path.read_text()) if results_path.exists() else {}
    except ValueError:
        res = {}
    write_card(cfg, name, folder, results=res if res.get("key") == key else None)


def run_eval(cfg, stage: Stage, tracker: Tracker) -> None:
    """tracker: the scores evaluated of each checkpoint, logged once, at the checkpoint's place in the pipeline
    (base 0, sft 1, rl 2: the x axis of a curve over the stages)."""
    data_dir = stage_dir(cfg, "data")
    rows = held_out_rows(cfg) if cfg.eval.held_out else []
    bench_rows: dict[str, list[dict]] = {}
    held_keys: dict[str, str] = {}  # checkpoint with a model folder of ours -> its held-out results' key
    # every checkpoint is checked against this config before any work
    paths = {name: checkpoint_path(cfg, name) for name in cfg.eval.checkpoints}
    for name in cfg.eval.checkpoints:
        path = paths[name]
        if path is None:
            print(f"eval: checkpoint '{name}' not finished ({stage_dir(cfg, name)}); skipped: run `make {name}`")
            continue
        # the config hash of each stage this checkpoint's results come from
        upstream = {n: done_hash(stage_dir(cfg, n)) for n in (["data"] if cfg.eval.held_out else []) +
                    ([] if isinstance(path, str) else [name])}
        out = stage.dir / name
        out.mkdir(parents=True, exist_ok=True)
        model_sha = _sha(sha256_tree(path)) if not isinstance(path, str) else f"{path}@{cfg.model.revision}"
        # sampling settings the config leaves null come from this checkpoint's generation_config.json
        generation = generation_config(cfg, path)
        specs = [resolve(b, cfg.eval, generation) for b in cfg.eval.benchmarks]
        held = sampling.resolve([(sampling.CONFIG, cfg.eval)], generation)
        jobs = []
        if cfg.eval.held_out:
            key = f"{held_out_hash(cfg)}-{model_sha}-{len(rows)}"
            if not isinstance(path, str):
                held_keys[name] = key
            if _up_to_date(out, key):
                print(f"eval: {name} already evaluated ({out / 'results.json'}); nothing to do")
            else:
                jobs.append((None, key))
        for spec in specs:
            bout = out / spec.name
            key = f"{_sha([spec.protocol(), cfg.eval.batch_size, cfg.eval.seed])}-{model_sha}"
            if _up_to_date(bout, key):
                print(f"eval: {name} {spec.title} already evaluated ({bout / 'results.json'}); nothing to do")
                continue
            jobs.append((spec, key))
        if not jobs:
            continue
        for spec, _ in jobs:  # every dataset is in hand before the engine starts: a hub failure costs seconds
            if spec is not None and spec.name not in bench_rows:
                bench_rows[spec.name] = load_benchmark(spec, timeout=cfg.eval.hub_timeout_s)
        engine = make_eval_engine(cfg, path, out)
        logged: dict = {}
        try:
            for spec, key in jobs:
                started = time.time()
                if spec is None:
                    ecfg, chosen = held_out_config(cfg, held, engine, rows)
                    res = evaluate(engine, engine.tokenizer, rows, ecfg, out, desc=f"eval {name}")
                    res["sampling"] = chosen
                    res_path, inputs = out / "results.json", {"model": path, "eval_data": data_dir / "eval.parquet"}
                    summary = ", ".join(f"{e} {v.get(f'avg@{cfg.eval.samples}', 0):.3f}" for e, v in res["env"].items())
                    label = name
                else:
                    bout = out / spec.name
                    res = run_benchmark(engine, engine.tokenizer, spec, bench_rows[spec.name], bout,
                                        cfg.eval.batch_size, cfg.eval.seed, desc=f"eval {name} {spec.title}")
                    res_path, inputs = bout / "results.json", {"model": path,
                                                               "benchmark": f"{spec.hub_id}@{spec.revision}"}
                    b = res["benchmark"]
                    summary = f"avg@{spec.samples} {b.get(f'avg@{spec.samples}', float('nan')):.3f} over " \
                              f"{b['problems']} problems" + (f", {res['masked_problems']} masked"
                                                             if res.get("masked_problems") else "")
                    label = f"{name} {spec.title}"
                res.update({"key": key, "checkpoint": name, "model_sha": model_sha})
                where = f"eval/{name}" + (f"/{spec.name}" if spec else "")
                res["provenance"] = provenance(cfg, where, config_hash(cfg, STAGE_KEYS["eval"]), started,
                                               inputs=inputs, outputs={"samples": res_path.parent / "samples.jsonl"},
                                               extra={"upstream": upstream})
                write_atomic(res_path, json.dumps(res, indent=2, sort_keys=True))
                print(f"eval: {label}: {summary}")
                logged.update(scores(spec, res))
        finally:
            if hasattr(engine, "close"):
                engine.close()
        tracker.log(logged, list(CheckpointName).index(name))
    for name, key in held_keys.items():  # (a hub model, base of a hub preset, has no folder of ours)
        update_card(cfg, name, paths[name], stage.dir / name / "results.json", key)


if __name__ == "__main__":
    main()
