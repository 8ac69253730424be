"""Bad input, and what you see: every row of README's table of that name is a case here, and every case a row.

A case runs a stage's entry point in-process (what `python -m recipe.<stage> ARGS` runs; stage_main prints the
error and exits) and checks the one line on stderr, the exit code, and that no traceback escaped; some check
what the stage left behind too. Conditions are made real where a test can: a full disk is a small tmpfs mounted
on the run root (root only: the case is skipped otherwise), SIGTERM is sent to the test's own process (from the
stage's first metrics record), a held folder is a lock taken on it. Cases without a
command (a hub row, an orchestrator input) call the function that reads the input and check the RecipeError that
the stage would print. A handful run as real subprocesses, for the exit code and stderr of the process itself.

In messages, `<runs>` is the run root and `…` stands for any text (hashes, library wording).
"""
from __future__ import annotations

import errno
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipe.errors import RecipeError

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    input: str  # the README row's "bad input"
    command: str  # the README row's command: `make STAGE ARGS=...`, or the function that reads the input
    message: str  # what you see: the line on stderr (or its stable beginning)
    args: list[str] = field(default_factory=list)
    setup: Callable | None = None  # setup(root, cfg, monkeypatch): the run folders the case needs
    call: Callable | None = None  # for cases without a command: call(tmp_path) raises the RecipeError
    exit: int = 2
    check: Callable | None = None  # check(runs): what the stage left behind

    @property
    def marker(self) -> str:
        """The stderr line the case checks starts with this: `error:`, or a stop's `<stage>: stopped by ...`."""
        return "error:" if self.message.startswith("error:") else self.message.split(";")[0]

    @property
    def stage(self) -> str:
        return "data" if self.command == ANY_STAGE else self.command.split()[1]

    def readme_row(self) -> list[str]:
        """bad input | command | what you see | exit, as the README's table has them."""
        if self.call is not None or self.command == ANY_STAGE:
            command = self.command
        else:
            command = f"`{self.command}" + (f' ARGS="{" ".join(self.args)}"' if self.args else "") + "`"
        return [self.input, command, f"`` {self.message} ``", str(self.exit)]


ANY_STAGE = "any stage"  # config errors: every stage loads the config first (the test runs `make data`)


def config_case(override: str, message: str) -> Case:
    return Case(f"`{override}`", ANY_STAGE, message, args=[override])


# -- run folders ---------------------------------------------------------------------------------------------
def row(i: int = 0, **kw) -> dict:
    from recipe.data.schema import message

    r = {"id": f"q{i}", "env": "math", "task": "add", "split": "eval", "prompt": [message("user", f"What is {i}+1?")],
         "completion": [], "answer": str(i + 1), "info": "{}", "difficulty": 0.0, "tools": "[]"}
    return {**r, **kw}


def sft_rows() -> list[dict]:
    from recipe.data.schema import message

    return [row(i, split="sft", completion=[message("assistant", f"<think>\n</think>\n{i + 1}")]) for i in range(4)]


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def finish_data(cfg, monkeypatch, **files) -> Path:
    """A finished data stage, through the data stage itself: each split's rows, or raw bytes for a file written
    as is (its sha256 goes into the manifest, as `make data` would have written it)."""
    from recipe.config import DataSource
    from recipe.data import __main__ as data_main
    from recipe.runs import Stage, sha256_file

    splits = {"sft": sft_rows(), "rl": [row(i, split="rl") for i in range(4)], "eval": [row(i) for i in range(2)],
              "pretrain": [{"text": "1+1=2"}]}
    raw = {k: v for k, v in files.items() if isinstance(v, bytes)}
    splits.update({k: v for k, v in files.items() if not isinstance(v, bytes)})
    monkeypatch.setitem(data_main.BUILDERS, DataSource.tiny, lambda data_cfg: splits)

    def body(stage, upstream):
        out = data_main.data_stage(stage, upstream)
        manifest = json.loads((stage.dir / "data_manifest.json").read_text())
        for split, data in raw.items():
            (stage.dir / f"{split}.parquet").write_bytes(data)
            manifest["files"][f"{split}.parquet"]["sha256"] = sha256_file(stage.dir / f"{split}.parquet")
        (stage.dir / "data_manifest.json").write_text(json.dumps(manifest))
        return out

    Stage(cfg, "data").run(body, fresh=True)
    return cfg.run_root


def finish_model_stage(cfg, name: str, model: Path | None, damage: Callable | None = None) -> None:
    """A finished base or sft stage whose model folder is a copy of `model`, damaged before the stage finishes
    (so its manifest describes the damaged files), or no folder at all (model None)."""
    from recipe.runs import Stage

    def body(stage, upstream):
        out = stage.dir / "model"
        if model is not None:
            shutil.copytree(model, out)
            if damage:
                damage(out)
        return {"inputs": {}, "outputs": {"model": out} if model is not None else {}}

    Stage(cfg, name).run(body, requires=("data",) if name == "base" else ("data", "base"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.fakes import save_tiny_qa_model  # here: `python tests/test_bad_inputs.py` has no `tests` package

    out = tmp_path_factory.mktemp("model") / "model"
    save_tiny_qa_model(out, [f"What is {i}+1? <think>\n</think>\n{i + 1}" for i in range(50)])
    return out


def with_data(**files):
    return lambda cfg, mp, model: finish_data(cfg, mp, **files)


def with_base(damage=None, pretrain=None):
    def setup(cfg, mp, model):
        finish_data(cfg, mp, **({"pretrain": pretrain} if pretrain is not None else {}))
        finish_model_stage(cfg, "base", model, damage)
    return setup


def with_sft(model_present=True):
    def setup(cfg, mp, model):
        with_base()(cfg, mp, model)
        finish_model_stage(cfg, "sft", model if model_present else None)
    return setup


def truncate(name: str):
    def damage(folder: Path):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:len(data) // 2])
    return damage


def remove(name: str):
    return lambda folder: (folder / name).unlink()


def replace(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def not_utf8_table() -> bytes:
    from recipe.data.schema import SCHEMA

    t = pa.Table.from_pylist([row(0)], schema=SCHEMA)
    answer = pa.array([b"\xff\xfe 1"], pa.binary()).view(pa.string())
    return table_bytes(t.set_column(t.schema.get_field_index("answer"), "answer", answer))


def prompt_as_text_table() -> bytes:
    from recipe.data.schema import SCHEMA

    schema = pa.schema([pa.field("prompt", pa.string()) if f.name == "prompt" else f for f in SCHEMA])
    return table_bytes(pa.Table.from_pylist([row(0, prompt="What is 0+1?")], schema=schema))


def rows_table(rows: list[dict]) -> bytes:
    from recipe.data.schema import SCHEMA

    return table_bytes(pa.Table.from_pylist(rows, schema=SCHEMA))


def edit_after_make_data(cfg, mp, model):
    root = finish_data(cfg, mp)
    with open(Path(root) / "tiny" / "data" / "eval.parquet", "r+b") as f:
        f.seek(40)
        f.write(b"edited")


def delete_after_make_data(name):
    def setup(cfg, mp, model):
        root = finish_data(cfg, mp)
        (Path(root) / "tiny" / "data" / name).unlink()
    return setup


def manifest_not_json(cfg, mp, model):
    root = finish_data(cfg, mp)
    (Path(root) / "tiny" / "data" / "data_manifest.json").write_text("{not json")


def finished_with_other_config(cfg, mp, model):
    from recipe.config import load_config

    finish_data(load_config([f"run_root={cfg.run_root}"]), mp)


def samples_not_utf8(cfg, mp, model):
    with_sft()(cfg, mp, model)
    out = Path(cfg.run_root) / "tiny" / "eval" / "sft"
    out.mkdir(parents=True)
    (out / "samples.jsonl").write_bytes(b'{"id": "q0", "sample": 0, "score": 1.0}\n\xff\xfe\n')


def damaged_results(cfg, mp, model):
    out = Path(cfg.run_root) / "tiny" / "eval" / "sft"
    out.mkdir(parents=True)
    (out / "results.json").write_text('{"overall": {"avg": 0.5')


def read_only_root(cfg, mp, model):
    ro = Path(cfg.run_root)
    ro.mkdir(parents=True)
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: the file system's answer is made up here, as a read-only mount
        real = os.mkdir

        def mkdir(path, *a, **kw):
            if str(path).startswith(str(ro)):
                if not Path(path).parent.exists():
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
                raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *a, **kw)

        mp.setattr(os, "mkdir", mkdir)


def run_root_is_a_file(cfg, mp, model):
    Path(cfg.run_root).write_text("not a folder")


FULL_DISK_KB = 96  # a run root this small takes the config and the small splits, not a 256 kB pretraining split


def full_disk_during_data(cfg, mp, model):
    """The run root is a tmpfs of FULL_DISK_KB kB; the pretraining split (random text: parquet cannot shrink it)
    does not fit. Returns the unmount."""
    from recipe.config import DataSource
    from recipe.data import __main__ as data_main

    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs mounted on the run root: mounting needs root")
    root = Path(cfg.run_root)
    root.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_KB}k", "tmpfs", str(root)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    splits = {"sft": sft_rows(), "rl": [row(i, split="rl") for i in range(4)], "eval": [row(i) for i in range(2)],
              "pretrain": [{"text": os.urandom(512).hex()} for _ in range(256)]}
    mp.setitem(data_main.BUILDERS, DataSource.tiny, lambda data_cfg: splits)
    return lambda: subprocess.run(["umount", str(root)], check=True)


def nothing_done_nothing_half_written(runs: Path) -> None:
    data = runs / "tiny" / "data"
    assert not (data / "DONE.json").exists() and not (data / "pretrain.parquet").exists()
    assert (data / "config.yaml").exists() and (data / "sft.parquet").exists()  # written before the disk filled
    assert not [p.name for p in data.iterdir() if ".tmp" in p.name]  # no temporary file holds on to space


def sigterm_at_first_metrics(mp) -> None:
    """SIGTERM to this process once the stage has logged its first metrics record (as `kill` would send it); the
    records of the eval during RL (eval_during_rl.jsonl, the start model's at step 0) do not count."""
    import signal

    from recipe.runs import MetricsLog

    log = MetricsLog.log

    def log_then_term(self, record):
        log(self, record)
        if self.path.name == "metrics.jsonl" and not getattr(self, "signalled", False):
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)

    mp.setattr(MetricsLog, "log", log_then_term)


def sigterm_during_sft(cfg, mp, model):
    """The first record comes at step 1 (sft.logging_steps=1), after that step's end: the stop, at step 2's."""
    with_base()(cfg, mp, model)
    sigterm_at_first_metrics(mp)


def sigterm_during_rl(cfg, mp, model):
    from recipe.rl import loop
    from tests.fakes import TokenEngine

    class Answers(TokenEngine):  # the rows ask "What is <i>+1?"
        def answer(self, prompt):
            return str(int(re.search(r"(\d+)\+1", prompt).group(1)) + 1)

    with_sft()(cfg, mp, model)
    mp.setattr(loop, "make_engine", lambda c, path, version, log_dir: Answers(load_tokenizer(path), version))
    sigterm_at_first_metrics(mp)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def stopped_with_a_checkpoint(stage: str, checkpoint: str):
    def check(runs: Path) -> None:
        d = runs / "tiny" / stage
        assert (d / "checkpoints" / checkpoint).is_dir() and not (d / "DONE.json").exists()
    return check


def held_data_folder(cfg, mp, model):
    """Another run holds the data stage's folder: its lock, taken here (flock conflicts between two opens of the
    file, in one process as in two). Returns the release."""
    from recipe.runs import StageLock, stage_dir

    lock = StageLock(stage_dir(cfg, "data"), "data")
    lock.acquire()
    return lock.release


# -- cases without a command: the function that reads the input -------------------------------------------
def hub_sft_prompt_is_text(tmp_path):
    from recipe.data.hub import sft_row

    sft_row({"prompt": "hello", "completion": []}, "am_chat", 7)


def hub_rl_row_without_question(tmp_path):
    from recipe.config import load_config
    from recipe.data.hub import rl_row

    rl_row({"prompt": "1+1?", "avg@8_qwen3_4b_thinking_2507": 0.5}, "math", 3, load_config(["preset=intellect3"]).data)


def hub_rl_rate_not_a_number(tmp_path):
    from recipe.config import load_config
    from recipe.data.hub import rl_row

    rl_row({"question": "1+1?", "answer": "2", "avg@8_qwen3_4b_thinking_2507": "n/a"}, "math", 3,
           load_config(["preset=intellect3"]).data)


def env_mix_without_rows(tmp_path):
    from tests.fakes import CharTokenizer, ScriptedEngine
    from recipe.config import load_config
    from recipe.rl.orchestrator import Orchestrator

    cfg = load_config(["rl.env_mix={math:0.5,science:0.5}"])
    Orchestrator([row(0, split="rl")], CharTokenizer(), cfg.rl, ScriptedEngine(lambda p, i: "1"), seed=0)


def damaged_newest_rl_checkpoint(tmp_path):
    import torch

    from recipe.rl.trainer import CombinedOptimizer, build_scheduler, latest_checkpoint, save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = CombinedOptimizer([torch.optim.AdamW(model.parameters())])
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, build_scheduler(opt, 0), {}, keep=2)
    truncate("state/__0_0.distcp")(tmp_path / "step_000002")  # the DCP shard of model and optimizer
    assert latest_checkpoint(tmp_path).name == "step_000001"
    return 0


def eval_prompt_longer_than_context(tmp_path):
    from tests.fakes import CharTokenizer
    from recipe.config import EvalConfig
    from recipe.eval import runner
    from recipe.rollout import Completion

    class Engine:
        def generate(self, prompts, params):
            return [Completion([ord(c) for c in "<think>t</think>1"], [0.0] * 17, "stop", 0) for _ in prompts]

    bar = runner.tqdm
    runner.tqdm = lambda *a, **kw: bar(*a, **kw, disable=True)  # the progress bar is on stderr too
    try:
        res = runner.evaluate(Engine(), CharTokenizer(), [row(0), row(1, prompt=[{"role": "user", "content": "x" * 99}])],
                              EvalConfig(samples=1, pass_k=[1], max_new_tokens=8), tmp_path, context=64)
    finally:
        runner.tqdm = bar
    assert res["skipped_too_long"] == 1
    return 0


def write_rows_missing_key(tmp_path):
    from recipe.data.schema import write_rows

    write_rows([{"id": "x"}], tmp_path / "bad.parquet")


def benchmarks_cli_unknown(tmp_path):
    from recipe.eval.benchmarks import main

    return main(["nope"])


CASES = [
    # -- keys and presets
    config_case("rl.foo=1", "error: config error: unknown key rl.foo: rl (RLConfig) has no key 'foo'"),
    config_case("+rl.foo=1", "error: config error: unknown key rl.foo: rl (RLConfig) has no key 'foo'"),
    config_case("++rl.foo=1", "error: config error: unknown key rl.foo: rl (RLConfig) has no key 'foo'"),
    config_case("+foo=1", "error: config error: unknown key foo: the top level has no key 'foo'"),
    config_case("sft.lrr=1e-3", "error: config error: unknown key sft.lrr: sft (TrainConfig) has no key 'lrr'; "
                                "did you mean lr?"),
    config_case("data.tasks=[{env:math,tsk:add}]", "error: config error: unknown key data.tasks[].tsk: data.tasks[] "
                                                   "(TaskSpec) has no key 'tsk'; did you mean task?"),
    config_case("rl.env_mix.science=0.5", "error: config error: rl.env_mix has no entry 'science' to change: add "
                                          "one with +rl.env_mix.science=<value>, or give the whole rl.env_mix={...}, "
                                          "which replaces it"),
    config_case("preset=tiyn", "error: config error: preset=tiyn: there is no configs/preset/tiyn.yaml (known: "
                               "gpu_small, intellect3, tiny); did you mean tiny?"),
    config_case("rl=fast", "error: config error: rl=fast: there is no configs/rl/fast.yaml (known: gpu_small, "
                           "intellect3, tiny)"),
    config_case("rl", "error: config error: Error parsing override 'rl'; missing EQUAL at '<EOF>'"),
    # -- types and choices
    config_case("sft.lr=abc", "error: config error: sft.lr=abc: Value 'abc' of type 'str' could not be converted "
                              "to Float"),
    config_case("rl.max_steps=1.5", "error: config error: rl.max_steps=1.5: Value '1.5' of type 'float' could not "
                                    "be converted to Integer"),
    config_case("rl.max_steps=null", "error: config error: rl.max_steps=null: field 'rl.max_steps' is not Optional"),
    config_case("eval.pass_k=4", "error: config error: eval.pass_k=4: Invalid value assigned: int is not a "
                                 "ListConfig, list or tuple."),
    config_case("rl.engine=tgi", "error: config error: rl.engine=tgi: Invalid value 'tgi', expected one of "
                                 "[hf, vllm]"),
    config_case("logging.report_to=mlflow", "error: config error: logging.report_to=mlflow: Invalid value "
                                            "'mlflow', expected one of [none, tensorboard, wandb, trackio]"),
    config_case("rl.optimizer=sgd", "error: config error: rl.optimizer=sgd: Invalid value 'sgd', expected one of "
                                    "[adamw, muon]"),
    config_case("model.dtype=fp32", "error: config error: model.dtype=fp32: Invalid value 'fp32', expected one of "
                                    "[float32, float16, bfloat16]"),
    config_case("sft.scheduler=cosin", "error: config error: sft.scheduler=cosin: Invalid value 'cosin', expected "
                                       "one of [linear, cosine, …]"),
    config_case("eval.checkpoints=[sft,final]", "error: config error: eval.checkpoints[1]='final' is not a checkpoint: "
                                                "base, sft, rl, a released model of eval.released (none in this "
                                                "preset), hub:<org>/<name>@<40-hex commit> or a model folder (a path "
                                                "with a /)"),
    config_case("eval.checkpoints=[hub:PrimeIntellect/INTELLECT-3]",
                "error: config error: eval.checkpoints[0]='hub:PrimeIntellect/INTELLECT-3': hub model "
                "PrimeIntellect/INTELLECT-3 has no revision: every hub reference is pinned, "
                "hub:PrimeIntellect/INTELLECT-3@<40-hex commit>"),
    config_case("eval.checkpoints=[hub:PrimeIntellect/INTELLECT-3@main]",
                "error: config error: eval.checkpoints[0]='hub:PrimeIntellect/INTELLECT-3@main': revision 'main' of "
                "PrimeIntellect/INTELLECT-3 is not a full commit id (40 hex digits): a branch or tag can move"),
    config_case("~rl.max_steps", "error: config error: ~rl.max_steps: RLConfig (DictConfig) does not support "
                                 "deletion"),
    config_case("sft.lr=${nope}", "error: config error: sft.lr does not resolve: Interpolation key 'nope' not "
                                  "found"),
    # -- sizes, steps and ranges
    config_case("rl.max_steps=0", "error: config error: rl.max_steps must be an integer >= 1, got 0"),
    config_case("sft.max_steps=-1", "error: config error: sft.max_steps must be an integer >= 1, got -1"),
    config_case("sft.batch_size=0", "error: config error: sft.batch_size must be an integer >= 1, got 0"),
    config_case("rl.micro_batch_size=0", "error: config error: rl.micro_batch_size must be an integer >= 1, got 0"),
    config_case("rl.checkpoint_every=0", "error: config error: rl.checkpoint_every must be an integer >= 1, got 0"),
    config_case("rl.max_new_tokens=0", "error: config error: rl.max_new_tokens must be an integer >= 1, got 0"),
    config_case("rl.rollouts_per_example=1", "error: config error: rl.rollouts_per_example must be an integer "
                                             ">= 2, got 1"),
    config_case("rl.temperature=0", "error: config error: rl.temperature must be a number > 0, got 0.0"),
    config_case("eval.temperature=-1", "error: config error: eval.temperature must be a number >= 0, got -1.0"),
    config_case("eval.top_p=0", "error: config error: eval.top_p must be a number in (0, 1], got 0.0"),
    config_case("eval.pass_k=[1,8]", "error: config error: eval.pass_k=[1, 8] must lie in 1..eval.samples (4): "
                                     "pass@k needs k samples a problem"),
    config_case("eval.pass_k=[0,1]", "error: config error: eval.pass_k[0] must be an integer >= 1, got 0"),
    config_case("eval.max_problems_per_task=0", "error: config error: eval.max_problems_per_task must be an integer "
                                                ">= 1, got 0"),
    config_case("rl.env_mix.math=-1", "error: config error: rl.env_mix.math must be a number >= 0, got -1.0"),
    config_case("rl.env_mix={}", "error: config error: rl.env_mix needs non-negative weights with a positive sum, "
                                 "got {}"),
    config_case("rl.mask_ratio_low=1.5", "error: config error: rl.mask_ratio_low must be a number in (0, 1), "
                                         "got 1.5"),
    config_case("data.no_think_fraction=1.5", "error: config error: data.no_think_fraction must be a number in "
                                              "[0, 1], got 1.5"),
    config_case("rl.max_off_policy_steps=0", "error: config error: rl.max_off_policy_steps (0) must be >= "
                                             "rl.max_async_level (1): the engine would cancel requests the trainer "
                                             "may still take"),
    config_case("rl.decay_steps=91", "error: config error: rl.warmup_steps (0) + rl.decay_steps (91) must be <= "
                                     "rl.max_steps (90): the decay takes the run's last steps, after the warmup"),
    config_case("rl.vllm_port=70000", "error: config error: rl.vllm_port must be an integer in [1, 65535], "
                                      "got 70000"),
    config_case("seed=-1", "error: config error: seed must be an integer >= 0, got -1"),
    config_case("launcher.nodes=0", "error: config error: launcher.nodes must be an integer >= 1, got 0"),
    config_case("model.tiny.num_key_value_heads=3", "error: config error: model.tiny.num_attention_heads (4) must "
                                                    "be a multiple of model.tiny.num_key_value_heads (3)"),
    config_case("model.tiny.num_experts_per_tok=9", "error: config error: model.tiny.num_experts_per_tok (9) must "
                                                    "be <= model.tiny.n_routed_experts (8)"),
    # -- lengths against the tiny model's context (512 positions)
    config_case("rl.max_new_tokens=500", "error: config error: rl.max_new_tokens (500) plus a prompt (16 tokens or "
                                         "more) must fit the model's context, model.tiny.max_position_embeddings "
                                         "(512)"),
    config_case("eval.max_new_tokens=512", "error: config error: eval.max_new_tokens (512) plus a prompt (16 tokens "
                                           "or more) must fit the model's context, "
                                           "model.tiny.max_position_embeddings (512)"),
    config_case("sft.max_length=1024", "error: config error: sft.max_length (1024) must be <= the model's context, "
                                       "model.tiny.max_position_embeddings (512)"),
    # -- the offline pass-rate filter: one key, per environment, applied by `make data`
    config_case("rl.max_pass_rate=0.874", "error: config error: unknown key rl.max_pass_rate: rl (RLConfig) has no "
                                          "key 'max_pass_rate'; the pass-rate filter is "
                                          "data.max_pass_rate={<environment>: <rate>}, applied by `make data`"),
    config_case("data.max_pass_rate={math:0.9}", "error: config error: data.max_pass_rate={'math': 0.9}: the tiny "
                                                 "rows carry no pass rate to filter on (their difficulty is a task "
                                                 "level); the filter is for hub data (data.source=intellect3)"),
    Case("`preset=intellect3 data.max_pass_rate={maths:0.874}`", ANY_STAGE,
         "error: config error: data.max_pass_rate names ['maths'], not among the RL subsets "
         "data.rl_dataset.subsets (['math', 'code', 'science', 'logic']); did you mean math?",
         args=["preset=intellect3", "data.max_pass_rate={maths:0.874}"]),
    # -- benchmarks
    Case("`eval.benchmarks=[{name:aime},…]`", "make eval",
         "error: config error: eval.benchmarks[0].name='aime' is not a known benchmark (known: math500, …)",
         args=["eval.benchmarks=[{name:aime}]"]),
    Case("`eval.benchmarks=[{name:hle},{name:hle}]`", "make eval",
         "error: config error: eval.benchmarks[1].name='hle' is listed twice",
         args=["eval.benchmarks=[{name:hle},{name:hle}]"]),
    Case("`eval.benchmarks=[{name:aime24,samples:0}]`", "make eval",
         "error: config error: eval.benchmarks[0].samples must be an integer >= 1, got 0",
         args=["eval.benchmarks=[{name:aime24,samples:0}]"]),
    Case("an unknown benchmark to cache", "python -m recipe.eval.benchmarks nope",
         "error: unknown benchmark 'nope' (known: math500, …)", call=benchmarks_cli_unknown),
    # -- the tiny tasks
    Case("a task of no environment", "make data", "error: config error: data.tasks[0].env='algebra' is not an "
         "environment (known: code, exact, logic, math, science, tools, verifiers)",
         args=["data.tasks=[{env:algebra,task:add}]"]),
    Case("a verifiers taskset that is not installed", "make data", "error: config error: data.tasks[0]: verifiers "
         "taskset 'no_such_taskset' cannot be loaded: ModuleNotFoundError: taskset 'no_such_taskset' not found …",
         args=["data.tasks=[{env:verifiers,task:x,params:{taskset:no_such_taskset}}]"]),
    Case("an unknown tiny task", "make data", "error: tiny data: unknown task 'mul' (known: add, fn_fit, "
         "tool_mul, …)", args=["data.tasks=[{env:math,task:mul}]"]),
    Case("task params the generator does not take", "make data",
         "error: config error: data.tasks[0].params={'digits': 2}: task 'add' refuses them: gen_add() got an "
         "unexpected keyword argument 'digits'", args=["data.tasks=[{env:math,task:add,params:{digits:2}}]"]),
    # -- stages in the wrong order, or redone with another config
    Case("`make sft` before `make data`", "make sft", "error: sft: stage 'data' has not finished "
         "(<runs>/tiny/data/DONE.json missing): run `make data` first"),
    Case("`make sft` before `make base`", "make sft", "error: sft: stage 'base' has not finished "
         "(<runs>/tiny/base/DONE.json missing): run `make base` first", setup=with_data()),
    Case("`make rl` before `make sft`", "make rl", "error: rl: stage 'sft' has not finished "
         "(<runs>/tiny/sft/DONE.json missing): run `make sft` first", setup=with_data()),
    Case("an upstream stage finished under another config", "make base", "error: base: stage 'data' in "
         "<runs>/tiny/data was finished under another config (hash …; this config gives …): redo it under this "
         "config with `make data ARGS=\"force=true <this run's overrides>\"`, or pass run_root=<dir> to keep both runs",
         args=["data.seed=7"], setup=finished_with_other_config),
    Case("a finished stage rerun with another config", "make data", "error: data: <runs>/tiny/data was finished "
         "with another config (hash …, now …); pass force=true to redo it, or run_root=<dir> to keep both runs",
         args=["data.seed=7"], setup=finished_with_other_config),
    # -- data files
    Case("a data file deleted after `make data`", "make eval", "error: data file <runs>/tiny/data/eval.parquet is "
         "missing: run `make data` first", setup=delete_after_make_data("eval.parquet")),
    Case("a data file edited after `make data`", "make eval", "error: data file <runs>/tiny/data/eval.parquet does "
         "not match its manifest sha256 (corrupt or edited): rerun `make data ARGS=force=true`",
         setup=edit_after_make_data),
    Case("data_manifest.json deleted", "make eval", "error: <runs>/tiny/data/data_manifest.json is missing: run "
         "`make data` first", setup=delete_after_make_data("data_manifest.json")),
    Case("data_manifest.json not JSON", "make eval", "error: <runs>/tiny/data/data_manifest.json is corrupt (…): "
         "rerun `make data ARGS=force=true`", setup=manifest_not_json),
    Case("a data file that is not parquet", "make eval", "error: data file <runs>/tiny/data/eval.parquet is not "
         "readable parquet: …", setup=with_data(eval=b"id,prompt\nq0,hello\n")),
    Case("a data column of the wrong type", "make eval", "error: data file <runs>/tiny/data/eval.parquet: column "
         "prompt is string, expected list<item: struct<role: string, content: string, tool_calls: string>>",
         setup=with_data(eval=prompt_as_text_table())),
    Case("non-UTF-8 bytes in a data row", "make eval", "error: data file <runs>/tiny/data/eval.parquet: row 0, "
         "column answer is not UTF-8 text", setup=with_data(eval=not_utf8_table())),
    Case("a prompt row without messages", "make eval", "error: data file <runs>/tiny/data/eval.parquet: row 1 "
         "(id 'q1'): the prompt has no message", setup=with_data(eval=rows_table([row(0), row(1, prompt=[])]))),
    Case("a prompt message without a role", "make eval", "error: data file <runs>/tiny/data/eval.parquet: row 0 "
         "(id 'q0'): malformed message {'role': None, 'content': 'hi', 'tool_calls': None}: role and content must "
         "be text", setup=with_data(eval=rows_table([row(0, prompt=[{"role": None, "content": "hi",
                                                                      "tool_calls": None}])]))),
    Case("an empty pretraining split", "make base", "error: <runs>/tiny/data/pretrain.parquet has no rows: "
         "`make base` pretrains the tiny model on them (data.pretrain_rows_per_task >= 1)",
         setup=with_data(pretrain=[])),
    Case("a hub model that is not in the HF cache, offline", "make eval",
         "error: eval.checkpoints 'hub:org/none@0123456789abcdef0123456789abcdef01234567': "
         "org/none@0123456789abcdef0123456789abcdef01234567 is not in the local HF cache (…; offline mode is on: …); "
         "fill the HF cache on a machine with network …",
         args=["eval.held_out=false", "eval.checkpoints=[hub:org/none@0123456789abcdef0123456789abcdef01234567]"]),
    Case("a model folder that does not exist", "make eval",
         "error: eval.checkpoints: model folder no/such/model does not exist (a hub model is written "
         "hub:<org>/<name>@<40-hex commit>)", args=["eval.held_out=false", "eval.checkpoints=[no/such/model]"]),
    Case("samples.jsonl with non-UTF-8 bytes", "make eval", "error: <runs>/tiny/eval/sft/samples.jsonl line 2 is not "
         "UTF-8 text (the file is damaged): delete it to evaluate this checkpoint again",
         args=["eval.checkpoints=[sft]", "eval.samples=1", "eval.pass_k=[1]", "eval.max_new_tokens=4"],
         setup=samples_not_utf8),
    Case("a damaged results.json", "make report", "error: <runs>/tiny/eval/sft/results.json is damaged (…): rerun "
         "the command that wrote it", setup=damaged_results),
    Case("a row the data writer gets without its keys", "recipe.data.schema.write_rows",
         "error: <tmp>/bad.parquet: row 0 lacks key(s) ['env', 'task', …]", call=write_rows_missing_key),
    # -- hub data
    Case("hub SFT row whose prompt is text", "recipe.data.hub.sft_row (make data PRESET=intellect3)",
         "error: INTELLECT-3-SFT/am_chat row 7: expected a list of messages, got str", call=hub_sft_prompt_is_text),
    Case("hub RL row without a question", "recipe.data.hub.rl_row (make data PRESET=intellect3)",
         "error: INTELLECT-3-RL/math row 3: no 'question' column (columns: ['avg@8_qwen3_4b_thinking_2507', "
         "'prompt'])", call=hub_rl_row_without_question),
    Case("hub RL row whose pass rate is not a number", "recipe.data.hub.rl_row (make data PRESET=intellect3)",
         "error: INTELLECT-3-RL/math row 3: pass rate avg@8_qwen3_4b_thinking_2507='n/a' is not a number",
         call=hub_rl_rate_not_a_number),
    Case("rl.env_mix names an environment without RL rows", "recipe.rl.orchestrator.Orchestrator (make rl)",
         "error: rl.env_mix names environment(s) ['science'] with no RL rows (the data has ['math'])",
         call=env_mix_without_rows),
    Case("a damaged newest RL checkpoint (a file truncated or missing)", "recipe.rl.trainer.latest_checkpoint "
         "(make rl)", "rl: skipping checkpoint step_000002: state/__0_0.distcp is … bytes, the checkpoint's index needs "
         "…; removed it, resuming from the checkpoint before it", call=damaged_newest_rl_checkpoint, exit=0),
    Case("an eval prompt longer than the model's context", "recipe.eval.runner.evaluate (make eval)",
         "eval: skipping 1 of 2 problems whose prompt plus max_new_tokens (8) exceeds the model's context (64); "
         "written as skipped to <tmp>/samples.jsonl", call=eval_prompt_longer_than_context, exit=0),
    # -- model folders
    Case("the base model folder without weights", "make sft", "error: model folder <runs>/tiny/base/model lacks "
         "model.safetensors or model.safetensors.index.json or pytorch_model.bin: redo the stage that wrote it "
         "(force=true)", setup=with_base(remove("model.safetensors"))),
    Case("a truncated weights file", "make sft", "error: cannot load the model of <runs>/tiny/base/model from the "
         "local folder: a weights file is truncated or corrupt (…)", setup=with_base(truncate("model.safetensors"))),
    Case("missing tokenizer files", "make sft", "error: model folder <runs>/tiny/base/model lacks tokenizer.json: "
         "redo the stage that wrote it (force=true)", setup=with_base(remove("tokenizer.json"))),
    Case("a model config.json that is not JSON", "make sft", "error: cannot load the tokenizer of "
         "<runs>/tiny/base/model from the local folder: It looks like the config file at "
         "'<runs>/tiny/base/model/config.json' is not a valid JSON file.",
         setup=with_base(replace("config.json", "{not json"))),
    Case("a missing model folder", "make rl", "error: model folder <runs>/tiny/sft/model does not exist: redo the "
         "stage that wrote it (force=true)", args=["rl.pin_cores=false"], setup=with_sft(model_present=False)),
    # -- the run root
    Case("a read-only run root", "make data", "error: cannot write or read <runs>/tiny: … (check run_root and "
         "its permissions)", setup=read_only_root),
    Case("a run root that is a file", "make data", "error: cannot write or read <runs>/tiny/data: Not a directory "
         "(check run_root and its permissions)", setup=run_root_is_a_file),
    Case("a full disk during a stage", "make data", "error: cannot write <runs>/tiny/data/pretrain.parquet: No space "
         "left on device (free space there, or pass run_root=<dir> on another disk; the stage is not marked done, "
         "and a rerun resumes or redoes it)", setup=full_disk_during_data, check=nothing_done_nothing_half_written),
    Case("a second run on a stage folder in use", "make data", "error: data: <runs>/tiny/data is in use by another "
         "run (pid … on …, started …: …); wait for it to end or stop it, or pass run_root=<dir> to run elsewhere",
         setup=held_data_folder),
    # -- signals: the stage stops at its next step with a checkpoint, exit code 128 + 15
    Case("SIGTERM (`kill`, a scheduler's time limit) during SFT", "make sft", "sft: stopped by SIGTERM; the next run "
         "resumes from checkpoint <runs>/tiny/sft/checkpoints/checkpoint-2", args=["sft.logging_steps=1", "sft.threads=1"],
         setup=sigterm_during_sft, exit=143, check=stopped_with_a_checkpoint("sft", "checkpoint-2")),
    Case("SIGTERM (`kill`, a scheduler's time limit) during RL", "make rl", "rl: stopped by SIGTERM; the next run "
         "resumes from checkpoint <runs>/tiny/rl/checkpoints/step_000001 (step 1)",
         args=["rl.env_mix={math:1.0}", "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.pin_cores=false"],
         setup=sigterm_during_rl, exit=143, check=stopped_with_a_checkpoint("rl", "step_000001")),
]


def pattern(message: str, runs: Path, tmp: Path) -> re.Pattern:
    text = message.replace("<runs>", str(runs)).replace("<tmp>", str(tmp))
    return re.compile("^" + ".*".join(re.escape(part) for part in text.split("…")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.input.strip("`")[:60])
def test_bad_input_gives_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys, request):
    from recipe.config import load_config

    monkeypatch.delenv("RECIPE_DEBUG", raising=False)
    runs = tmp_path / "runs"
    if case.call is not None:
        try:
            code = case.call(tmp_path)
        except RecipeError as e:
            code, err = case.exit, f"error: {e}\n"
        else:
            err = capsys.readouterr().err
        assert code == case.exit
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and pattern(case.message, runs, tmp_path).match(lines[0]), lines
        return
    argv = [f"run_root={runs}", *case.args]
    undo = None
    if case.setup is not None:
        undo = case.setup(load_config(argv), monkeypatch, request.getfixturevalue("tiny_model"))
    try:
        capsys.readouterr()
        module = {"report": "recipe.eval.report"}.get(case.stage, f"recipe.{case.stage}.__main__")  # as the Makefile
        main = importlib.import_module(module).main
        with pytest.raises(SystemExit) as ex:  # any other exception is a traceback: the test fails with it
            main(argv)
        err = capsys.readouterr().err
        assert ex.value.code == case.exit
        lines = [ln for ln in re.split(r"[\r\n]", err) if ln.startswith(case.marker)]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert pattern(case.message, runs, tmp_path).match(lines[0]), lines[0]
        if case.check is not None:
            case.check(runs)
    finally:
        if callable(undo):
            undo()


# -- a handful through a real process: exit code and stderr of `python -m recipe.<stage>` ---------------------
@pytest.mark.parametrize("args,expected", [
    (["+rl.foo=1"], "error: config error: unknown key rl.foo"),
    (["sft.max_steps=-1"], "error: config error: sft.max_steps must be an integer >= 1, got -1"),
    (["preset=intellect3"], "error: cannot load PrimeIntellect/INTELLECT-3-SFT@"),
], ids=["unknown key", "range", "hub offline"])
def test_the_process_exits_2_with_one_line(args, expected, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("RECIPE_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "recipe.data", f"run_root={tmp_path / 'runs'}", *args],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert [ln for ln in res.stderr.splitlines() if ln.strip()][-1].startswith(expected), res.stderr


# -- a full disk leaves what was written before as it was -----------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs: mounting needs root")
    root = tmp_path / "disk"
    root.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield root
    subprocess.run(["umount", str(root)], check=True)


def fill(root: Path) -> None:
    with open(root / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_full_disk_leaves_what_was_written_before_as_it_was(small_disk):
    import torch

    from recipe.rl.trainer import CombinedOptimizer, build_scheduler, latest_checkpoint, publish_weights, save_checkpoint
    from recipe.runs import MetricsLog, full_disk, write_atomic

    model = torch.nn.Linear(4, 4)
    opt = CombinedOptimizer([torch.optim.AdamW(model.parameters())])
    ckpts, weights, marker = small_disk / "checkpoints", small_disk / "weights", small_disk / "DONE.json"
    save_checkpoint(ckpts, 1, model, opt, build_scheduler(opt, 0), {}, keep=2)
    publish_weights(model, weights, 1)
    write_atomic(marker, "old")
    metrics = MetricsLog(small_disk / "metrics.jsonl")
    metrics.log({"step": 1})
    assert not full_disk(RuntimeError("unexpected pos 576 vs 534"), small_disk)
    fill(small_disk)
    assert full_disk(RuntimeError("unexpected pos 576 vs 534"), small_disk)  # torch.save's way of saying it

    with pytest.raises(Exception):
        save_checkpoint(ckpts, 2, model, opt, build_scheduler(opt, 0), {}, keep=2)
    assert latest_checkpoint(ckpts) == ckpts / "step_000001" and [p.name for p in ckpts.iterdir()] == ["step_000001"]
    with pytest.raises(Exception):
        publish_weights(model, weights, 2)
    assert sorted(p.name for p in weights.iterdir()) == ["LATEST", "policy_000001.safetensors"]
    with pytest.raises(OSError) as e:
        write_atomic(marker, "new" * 100_000)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(marker)  # the error names the file
    assert marker.read_text() == "old" and not [p for p in small_disk.iterdir() if ".tmp" in p.name]
    with pytest.raises(OSError):
        metrics.log({"step": 2, "note": "x" * 100_000})
    assert (small_disk / "metrics.jsonl").read_text() == '{"step": 1}\n'  # no half line for a resume to trip on


# -- the README's table is these cases ------------------------------------------------------------------------
def readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Bad input, and what you see", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")][2:]  # past the header and its rule
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines]


def test_the_readme_table_lists_every_case_and_no_other():
    assert len(CASES) >= 40
    assert readme_rows() == [c.readme_row() for c in CASES]


if __name__ == "__main__":  # prints the README's table
    print("| bad input | command | what you see (stderr) | exit |\n|---|---|---|---|")
    print("\n".join("| " + " | ".join(c.readme_row()) + " |" for c in CASES))
