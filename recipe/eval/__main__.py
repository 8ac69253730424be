"""`make eval`: every model of eval.checkpoints (the finished stages base, sft, rl; a released model of
eval.released; a hub model at a pinned revision; a local model folder: recipe/eval/models.py) on the held-out
suite and on the paper's benchmarks that eval.benchmarks lists (each with its own k and sampling), then RESULTS.md.

Output: eval/<folder>/{results.json, samples.jsonl} for the held-out suite and
eval/<folder>/<benchmark>/{results.json, samples.jsonl} for each benchmark, <folder> the model's own
(models.folder_name); one engine serves them all, and every eval resumes per problem. The held-out scores also go
into the card of each evaluated model folder of this run's stages (README.md, recipe/model_card.py). Under a SLURM
eval job (`make plan`: eval.sbatch) RECIPE_INFERENCE_URLS names the vLLM servers the job started for the model.

Sampling: what the eval config leaves null comes from the checkpoint's generation_config.json, as the release
evals' vLLM servers took it (recipe/eval/sampling.py); each results.json records every setting with its source
(`sampling` for the held-out suite, `protocol` for a benchmark). The vLLM servers run with
`--generation-config auto` for the same reason.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recipe.chat import encode_prompt
from recipe.config import SPEED_KEYS, EngineKind, config_hash, drop_unset_top_k
from recipe.cores import ThreadGovernor, own_cpu_s
from recipe.data.schema import read_split
from recipe.eval import models as eval_models
from recipe.eval import sampling
from recipe.eval.benchmarks import load_benchmark, resolve, run_benchmark, validate_benchmarks
from recipe.eval.report import write_report
from recipe.eval.runner import evaluate, model_context
from recipe.inference.hf import HFEngine
from recipe.inference.vllm import VLLMEngine
from recipe.launch.roles import INFERENCE_URLS_ENV
from recipe.model_card import write_card
from recipe.runs import (STAGE_KEYS, Began, Stage, done_hash, provenance, require_done, stage_dir, stage_main,
                         write_atomic)
from recipe.sandbox import warm
from recipe.tracking import Tracker, open_tracker

# eval keys that only concern the benchmarks: left out of the held-out suite's key, so that adding a benchmark
# does not redo the held-out eval (and the key stays what it was before these keys existed)
BENCHMARK_KEYS = ("held_out", "benchmarks", "benchmark_max_problems", "hub_timeout_s")
# eval keys that say which models to evaluate, not how: out of the held-out key too (eval.checkpoints is hashed as
# its old default, which the keys made before it took other models were made with)
MODEL_KEYS = ("checkpoints", "released")
CHECKPOINTS_AS_HASHED = ["base", "sft", "rl"]


def make_eval_engine(cfg, path, out_dir):
    """The engine of one model folder: the vLLM servers a SLURM eval job started for it (RECIPE_INFERENCE_URLS),
    else the hf engine or a vLLM server of its own."""
    urls = os.environ.get(INFERENCE_URLS_ENV)
    if urls:
        return VLLMEngine(str(path), cfg, launch=False, base_url=urls)
    if cfg.eval.engine == EngineKind.hf:
        return HFEngine.from_pretrained(str(path), batch_size=cfg.eval.batch_size)
    # `auto`: the model's generation_config.json is the server's default, as in the release evals
    return VLLMEngine(str(path), cfg, log_path=out_dir / "vllm_server.log", generation_config="auto")


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def held_out_hash(cfg) -> str:
    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    drop_unset_top_k(ev)
    ev = {k: v for k, v in ev.items() if k not in BENCHMARK_KEYS + MODEL_KEYS + SPEED_KEYS}
    return _sha({"eval": {**ev, "checkpoints": CHECKPOINTS_AS_HASHED}})


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


def tracker_step(cfg, model) -> int:
    """The x axis of the tracker: base 0, sft 1, rl 2, then the other models in eval.checkpoints' order."""
    if model.stage is not None:
        return eval_models.STAGES.index(model.stage)
    others = [e for e in cfg.eval.checkpoints if e not in eval_models.STAGES]
    return len(eval_models.STAGES) + others.index(model.entry)


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
    """tracker: the scores evaluated of each model, logged once, at the model's place (tracker_step)."""
    data_dir = stage_dir(cfg, "data")
    rows = held_out_rows(cfg) if cfg.eval.held_out else []
    bench_rows: dict[str, list[dict]] = {}
    held_keys: dict[str, tuple[Path, str]] = {}  # stage with a model folder of this run -> (folder, held-out key)
    # one for every model: the load it measured carries over from one model to the next
    # the sandboxed programs that score code are this stage's own work, not another process's load
    governor = (ThreadGovernor(cfg.eval.threads, own_cpu=lambda: own_cpu_s() + warm.cpu_s())
                if cfg.eval.adapt_threads else None)
    # every model is checked before any work: this config's stages, folders, hub models located (seconds offline)
    models = {entry: eval_models.model_for(cfg, entry) for entry in cfg.eval.checkpoints}
    for entry, model in models.items():
        if model is None:
            print(f"eval: checkpoint '{entry}' not finished ({stage_dir(cfg, entry)}); skipped: run `make {entry}`")
            continue
        name = model.folder
        # the config hash of each stage this model's results come from
        upstream = {n: done_hash(stage_dir(cfg, n)) for n in (["data"] if cfg.eval.held_out else []) +
                    ([model.stage] if model.kind == "stage" else [])}
        out = stage.dir / name
        out.mkdir(parents=True, exist_ok=True)
        model_sha = model.key()
        # sampling settings the config leaves null come from the model's generation_config.json
        generation = sampling.read_generation_config(model.path)
        specs = [resolve(b, cfg.eval, generation) for b in cfg.eval.benchmarks]
        held = sampling.resolve([(sampling.CONFIG, cfg.eval)], generation)
        jobs = []
        if cfg.eval.held_out:
            key = f"{held_out_hash(cfg)}-{model_sha}-{len(rows)}"
            if model.kind == "stage":
                held_keys[name] = (model.path, key)
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
        eval_models.fetch_weights(model)
        # a hub model's own weights (a folder's are in the key): the index's sha256, where it has one
        described = model.describe()
        engine = make_eval_engine(cfg, model.path, out)
        logged: dict = {}
        # a hub model is its id@commit (its 200 GB are not hashed again); a folder is hashed file by file
        model_input = model.ref if model.kind == "hub" else model.path
        try:
            for spec, key in jobs:
                began = Began.now()
                if spec is None:
                    ecfg, chosen = held_out_config(cfg, held, engine, rows)
                    res = evaluate(engine, engine.tokenizer, rows, ecfg, out, desc=f"eval {name}",
                                   governor=governor if isinstance(engine, HFEngine) else None)
                    res["sampling"] = chosen
                    res_path, inputs = out / "results.json", {"model": model_input,
                                                              "eval_data": data_dir / "eval.parquet"}
                    summary = ", ".join(f"{e} {v.get(f'avg@{cfg.eval.samples}', 0):.3f}" for e, v in res["env"].items())
                    label = name
                else:
                    bout = out / spec.name
                    res = run_benchmark(engine, engine.tokenizer, spec, bench_rows[spec.name], bout,
                                        cfg.eval.batch_size, cfg.eval.seed, desc=f"eval {name} {spec.title}")
                    res_path, inputs = bout / "results.json", {"model": model_input,
                                                               "benchmark": f"{spec.hub_id}@{spec.revision}"}
                    b = res["benchmark"]
                    summary = f"avg@{spec.samples} {b.get(f'avg@{spec.samples}', float('nan')):.3f} over " \
                              f"{b['problems']} problems" + (f", {res['masked_problems']} masked"
                                                             if res.get("masked_problems") else "")
                    label = f"{name} {spec.title}"
                res.update({"key": key, "checkpoint": entry, "model_sha": model_sha})
                where = f"eval/{name}" + (f"/{spec.name}" if spec else "")
                res["provenance"] = provenance(cfg, where, config_hash(cfg, STAGE_KEYS["eval"]), began,
                                               inputs=inputs, outputs={"samples": res_path.parent / "samples.jsonl"},
                                               extra={"upstream": upstream, "model": described})
                write_atomic(res_path, json.dumps(res, indent=2, sort_keys=True))
                print(f"eval: {label}: {summary}")
                logged.update(scores(spec, res))
        finally:
            if hasattr(engine, "close"):
                engine.close()
        tracker.log(logged, tracker_step(cfg, model))
    for name, (folder, key) in held_keys.items():  # (a hub model, base of a hub preset, has no folder of ours)
        update_card(cfg, name, folder, stage.dir / name / "results.json", key)


if __name__ == "__main__":
    main()
