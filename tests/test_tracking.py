"""Experiment tracking (recipe.tracking, logging.report_to), offline: `none` writes nothing; tensorboard's event
files, wandb's offline run and trackio's local store are read back with the metrics at their steps and the config
attached, from the recipe's Tracker (RL, eval) and from a 2-step SFT through the Trainer's own integration; a bad
value or a missing package is one line that names the key or the extra."""
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.config import TinyArch, TrainConfig
from recipe.errors import ConfigError
from recipe.runs import Stage, Stopped, stage_dir
from recipe.tracking import Tracker, TrainerTracking, open_tracker, scalars

ROOT = Path(__file__).resolve().parent.parent
# a step record as RL writes it: numbers, a nested dict of numbers, text and a flag (the last two not logged)
RECORDS = [{"step": s, "reward": 0.25 * s, "reward_by_env": {"math": 0.5 * s}, "set": "held_out", "flag": True}
           for s in (1, 2, 3)]
LOGGED = {"reward": [0.25, 0.5, 0.75], "reward_by_env/math": [0.5, 1.0, 1.5]}
TEXTS = [f"the sum of {i} and {i * 7 % 13} is {i + i * 7 % 13}." for i in range(16)]
ARCH = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64)


def log_records(cfg, folder):
    with open_tracker(cfg, "rl", folder) as tracker:
        for r in RECORDS:
            tracker.log(r, r["step"])


def sft(cfg, folder):
    """2 steps of SFT on a tiny model, logging every step, through recipe.sft as the stages run it."""
    from datasets import Dataset

    from recipe.model import build_tiny_model, build_tokenizer
    from recipe.sft import train_supervised

    tok = build_tokenizer(TEXTS, 300)
    train_cfg = TrainConfig(max_steps=2, batch_size=4, max_length=32, save_steps=100, logging_steps=1, threads=1)
    train_supervised(build_tiny_model(ARCH, tok, seed=0), tok, Dataset.from_dict({"text": TEXTS}), train_cfg,
                     folder, use_cpu=True, tracking=TrainerTracking(cfg, "sft", folder))


def test_none_logs_nothing_and_writes_nothing(cfg_factory, tmp_path):
    cfg = cfg_factory()
    assert cfg.logging.report_to == "none"
    log_records(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []
    tracking = TrainerTracking(cfg, "sft", tmp_path)
    assert tracking.args == {"report_to": "none"} and tracking.callbacks == []


def test_logging_is_in_no_stage_hash(cfg_factory):
    """Where metrics also go changes no stage's output: switching it neither redoes nor refuses a finished one."""
    none, wandb = cfg_factory(), cfg_factory("logging.report_to=wandb", "logging.project=elsewhere")
    for name in ("data", "base", "sft", "rl", "eval"):
        assert Stage(none, name).hash == Stage(wandb, name).hash


def test_eval_scores_are_flattened_under_their_suite():
    from recipe.eval.__main__ import scores

    res = {"overall": {"avg": 0.5}, "env": {"math": {"avg@4": 0.5, "problems": 3}}, "task": {"math/add": {}}}
    assert scalars(scores(None, res)) == {"held_out/overall/avg": 0.5, "held_out/env/math/avg@4": 0.5,
                                          "held_out/env/math/problems": 3}


class Recorded(Tracker):
    """A tracker that keeps what it is given."""

    def __init__(self):
        self.logged = []

    def _write(self, numbers, step):
        self.logged.append((step, numbers))


def test_rl_logs_every_step_and_every_eval_at_its_step(cfg_factory, monkeypatch, one_thread):
    """The RL loop hands the tracker each step's metrics.jsonl record and each eval-during-RL record (eval/...)."""
    from recipe.data.schema import message, write_rows
    from recipe.rl import loop
    from recipe.runs import write_atomic
    from tests.fakes import TokenEngine, save_tiny_qa_model

    cfg = cfg_factory("rl.max_steps=2", "rl.checkpoint_every=2", "rl.batch_size=2", "rl.rollouts_per_example=2",
                      "rl.max_new_tokens=8", "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.seed=0",
                      "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0",
                      "rl.eval_every=1", "rl.eval_samples=1", "rl.eval_max_problems=2")
    data, files = stage_dir(cfg, "data"), {}
    for split, n in (("rl", 8), ("eval", 2)):
        rows = [{"id": f"{split}{i}", "env": "math", "task": "add", "split": split, "answer": str(i),
                 "prompt": [message("user", f"Q{i}")], "completion": [], "info": "{}", "difficulty": 0.0,
                 "tools": "[]"} for i in range(n)]
        files[f"{split}.parquet"] = {"rows": n, "sha256": write_rows(rows, data / f"{split}.parquet")}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    tok = save_tiny_qa_model(data.parent / "start")
    monkeypatch.setattr(loop, "make_engine", lambda cfg, path, version, log_dir: TokenEngine(tok, version))
    tracker = Recorded()
    loop.run_rl(cfg, stage_dir(cfg, "rl"), data.parent / "start", tracker=tracker)
    records = [json.loads(x) for x in (stage_dir(cfg, "rl") / "metrics.jsonl").read_text().splitlines()]
    steps = [(s, m) for s, m in tracker.logged if "reward" in m]
    assert [s for s, _ in steps] == [r["step"] for r in records] == [1, 2]
    for (_, logged), record in zip(steps, records):
        assert logged == scalars({k: v for k, v in record.items() if k != "step"})
    evals = [(s, m) for s, m in tracker.logged if "eval/avg@1" in m]
    assert [s for s, _ in evals] == [0, 1, 2] and all("eval/by_env/math" in m for _, m in evals)


def tensorboard_events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_tensorboard_event_files(cfg_factory):
    cfg = cfg_factory("logging.report_to=tensorboard")
    rl = stage_dir(cfg, "rl")
    log_records(cfg, rl)
    acc = tensorboard_events(rl / "tracking" / "tensorboard")
    assert set(acc.Tags()["scalars"]) == set(LOGGED)
    for tag, values in LOGGED.items():
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(s, pytest.approx(v)) for s, v in
                                                                 zip((1, 2, 3), values)]
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "report_to: tensorboard" in config and "preset: tiny" in config

    sft_dir = stage_dir(cfg, "sft")
    sft(cfg, sft_dir)
    acc = tensorboard_events(sft_dir / "tracking" / "tensorboard")
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
    assert {"args/text_summary", "config/text_summary"} <= set(acc.Tags()["tensors"])


def wandb_records(path):
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf records in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, piece, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])  # after the checksum
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a record the service is still writing
            break
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            out.append(pb.Record.FromString(piece))
            piece = b""
    return out


def finished_run_records(folder, wait_s: float = 30.0) -> list:
    """The records of the one offline run under a stage's tracking/, once its run and exit records are in the
    file: wandb's service process writes the file and can still be at it when the run's finish() has returned."""
    (path,) = (folder / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(path)
        kinds = {r.WhichOneof("record_type") for r in records}
        if {"run", "exit"} <= kinds or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_exit_code(folder):
    """The exit code the one offline run under a stage's tracking/ finished with."""
    (code,) = [r.exit.exit_code for r in finished_run_records(folder) if r.WhichOneof("record_type") == "exit"]
    return code


def wandb_run(folder):
    """(run name, config keys, history rows) of the one offline run under a stage's tracking/."""
    records = finished_run_records(folder)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key for i in run.config.update}
    config |= {i.key for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update}
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return run.display_name, config, rows


def test_wandb_offline_run(cfg_factory, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = cfg_factory("logging.report_to=wandb")
    rl = stage_dir(cfg, "rl")
    log_records(cfg, rl)
    name, config, rows = wandb_run(rl)
    assert wandb_exit_code(rl) == 0
    assert name == "tiny-rl" and {"preset", "rl", "logging"} <= config
    assert [(r["_step"], r["reward"], r["reward_by_env/math"]) for r in rows] == \
        [(s, pytest.approx(a), pytest.approx(b)) for s, a, b in zip((1, 2, 3), *LOGGED.values())]

    sft_dir = stage_dir(cfg, "sft")
    sft(cfg, sft_dir)
    name, config, rows = wandb_run(sft_dir)
    assert name == "tiny-sft" and "recipe" in config  # the recipe's config beside the Trainer's arguments
    assert [r["train/global_step"] for r in rows if "train/loss" in r] == [1, 2]  # the integration's x axis


# trackio fixes its store's folder when first imported (and TRL's model card imports it at any SFT's end): each
# stage's store is written and read in a process of its own, as the stages run
TRACKIO = """
import json, sys
from recipe.config import load_config
from recipe.runs import stage_dir
from tests.test_tracking import log_records, sft

cfg = load_config([sys.argv[1], "logging.report_to=trackio"])
stage = sys.argv[2]
(log_records if stage == "rl" else sft)(cfg, stage_dir(cfg, stage))
from trackio import Api
from trackio.sqlite_storage import SQLiteStorage
(run,) = Api().runs(cfg.logging.project)
logs = SQLiteStorage.get_logs(cfg.logging.project, run.name)
print("RESULT", json.dumps({"name": run.name, "config": sorted(run.config), "logs": logs}, default=str))
"""


@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_trackio_local_store(tmp_path, stage):
    res = subprocess.run([sys.executable, "-c", TRACKIO, f"run_root={tmp_path / 'runs'}", stage], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert (tmp_path / "runs" / "tiny" / stage / "tracking" / "trackio" / "intellect3-recipe.db").exists()
    assert out["name"] == f"tiny-{stage}"
    if stage == "rl":
        assert {"preset", "rl", "logging"} <= set(out["config"])
        assert [(r["step"], r["reward"], r["reward_by_env/math"]) for r in out["logs"]] == \
            [(s, pytest.approx(a), pytest.approx(b)) for s, a, b in zip((1, 2, 3), *LOGGED.values())]
    else:
        assert "recipe" in out["config"]  # the recipe's config beside the Trainer's arguments
        assert [r["train/global_step"] for r in out["logs"] if "train/loss" in r] == [1, 2]  # its x axis


def test_a_bad_value_is_one_line_naming_the_key(cfg_factory):
    with pytest.raises(ConfigError) as e:
        cfg_factory("logging.report_to=mlflow")
    assert "logging.report_to" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "trackio"])
def test_a_missing_package_names_the_extra(cfg_factory, tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # what an environment without it imports
    cfg = cfg_factory(f"logging.report_to={backend}")
    for make in (lambda: open_tracker(cfg, "rl", tmp_path), lambda: TrainerTracking(cfg, "sft", tmp_path)):
        with pytest.raises(ConfigError) as e:
            make()
        msg = str(e.value)
        assert f"logging.report_to={backend}" in msg and "pip install -e .[tracking]" in msg and "\n" not in msg
    assert list(tmp_path.iterdir()) == []


def test_a_stage_that_fails_fails_its_wandb_run_and_a_stopped_one_does_not(cfg_factory, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = cfg_factory("logging.report_to=wandb")
    for name, error, code in (("failed", RuntimeError("boom"), 1), ("stopped", Stopped(15, "resume"), 0)):
        folder = tmp_path / name
        with pytest.raises(type(error)), open_tracker(cfg, "rl", folder) as tracker:
            tracker.log(RECORDS[0], 1)
            raise error
        assert wandb_exit_code(folder) == code, name
