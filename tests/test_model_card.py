"""Model cards (recipe/model_card.py): a finished stage's model folder carries a README.md that huggingface_hub
reads back with the stage, config hash, command, model and data; `make eval` adds the held-out scores without
changing the folder's hashes, so the stage still skips as done and eval does not start over; a failed write
leaves the card as it was."""
import errno
import json
import sys

import pytest
from huggingface_hub import ModelCard

import recipe.eval.__main__ as ev
import recipe.runs
from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.inference import Completion
from recipe.model_card import build_card, make_command, write_card
from recipe.rl.dist import run_stage_on_ranks
from recipe.runs import CARD_NAME, Stage, done_hash, sha256_tree, stage_dir, write_atomic
from tests.fakes import CharTokenizer, save_tiny_qa_model

EVAL_ROWS = 6


class RightOnEvenEngine:
    """The eval engine's contract on character ids: problem `Q<n>` answered right when n is even."""

    tokenizer = CharTokenizer()

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for p in prompts:
            n = int("".join(chr(c) for c in p).split("Q")[1].split("<")[0])
            text = f"<think>t</think>\\boxed{{{n if n % 2 == 0 else -1}}}"
            out.append(Completion([ord(c) for c in text], [0.0] * len(text), "stop", 0))
        return out


@pytest.fixture
def finished_sft(tmp_path, monkeypatch):
    """A finished data stage (held-out math rows), base marked done, and an sft stage run as the training stages
    run (recipe.rl.dist.run_stage_on_ranks, one process) with a tiny model as its output, under a recorded
    `python -m recipe.sft` command line."""
    args = [f"run_root={tmp_path / 'runs'}", "eval.checkpoints=[sft]", "eval.samples=2", "eval.pass_k=[1,2]"]
    cfg = load_config(args)
    data = stage_dir(cfg, "data")
    rows = [{"id": f"e{i}", "env": "math", "task": "add", "split": "eval", "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"}
            for i in range(EVAL_ROWS)]
    files = {"eval.parquet": {"rows": EVAL_ROWS, "sha256": write_rows(rows, data / "eval.parquet")},
             "sft.parquet": {"rows": 40, "sha256": "ab" * 32}}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    for name in ("data", "base"):
        write_atomic(stage_dir(cfg, name) / "DONE.json", json.dumps({"config_hash": Stage(cfg, name).hash}))

    def lead(stage, upstream, tell, world):  # the training stages' body: here, a tiny model as the output
        tell(None)
        save_tiny_qa_model(stage.dir / "model")
        return {"inputs": {}, "outputs": {"model": stage.dir / "model"}}

    def run_sft():
        run_stage_on_ranks(cfg, args, "sft", ("data", "base"), 1, lead, follow=None)

    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "recipe.sft", "preset=tiny", *args,
                                           "sft.max_steps=300"])
    run_sft()
    return cfg, args, run_sft


def test_a_finished_stage_leaves_a_card_that_huggingface_hub_reads(finished_sft):
    cfg, _, _ = finished_sft
    sft = stage_dir(cfg, "sft")
    card = ModelCard.load(sft / "model" / CARD_NAME)
    assert card.data.recipe["stage"] == "sft" and card.data.recipe["preset"] == "tiny"
    assert card.data.recipe["config_hash"] == done_hash(sft)
    assert card.data.recipe["command"] == "make sft PRESET=tiny ARGS='eval.checkpoints=[sft] eval.samples=2 " \
                                          "eval.pass_k=[1,2] sft.max_steps=300'"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"intellect3-recipe", "sft"} <= set(card.data.tags)
    assert card.data.base_model is None and card.data.datasets is None  # tiny: built here, procedural data
    assert f"config `{done_hash(sft)}`" not in card.text  # (the lineage names the parents, not the stage)
    assert f"`{done_hash(sft)}` (the stage's DONE.json)" in card.text
    assert f"`base` (config `{done_hash(stage_dir(cfg, 'base'))}`) ← `tiny-glm4moe` (built here)" in card.text
    assert "`make sft PRESET=tiny ARGS=" in card.text and "`python -m recipe.sft preset=tiny" in card.text
    assert "no hub revision" in card.text and "| math | add |" in card.text
    assert f"`eval.parquet` (the held-out split): {EVAL_ROWS} rows" in card.text
    assert "`sft.parquet` (this stage's training split): 40 rows, sha256 `" + "ab" * 32 in card.text
    assert "Not evaluated yet" in card.text and not card.data.eval_results
    assert "tmp" not in card.data.recipe["command"]  # run_root (a path of this machine) is left out


def test_a_hub_preset_card_names_base_model_datasets_and_revisions(cfg_factory):
    cfg = cfg_factory("preset=intellect3")
    manifest = {"preset": "intellect3", "config_hash": "0123456789abcdef", "ended": "2026-01-01T00:00:00Z",
                "wall_s": 12.0, "command": "python -u -m recipe.rl preset=intellect3 rl.max_steps=5",
                "git": {"commit": "f" * 40, "dirty": True}}
    card = ModelCard(str(build_card(cfg, "rl", manifest)))  # through its text, as a reader gets it
    assert card.data.base_model == "zai-org/GLM-4.5-Air-Base"
    assert card.data.base_model_revision == cfg.model.revision
    assert card.data.datasets == ["PrimeIntellect/INTELLECT-3-SFT", "PrimeIntellect/INTELLECT-3-RL"]
    assert card.data.dataset_revisions == {"PrimeIntellect/INTELLECT-3-SFT": "ff48f66",
                                           "PrimeIntellect/INTELLECT-3-RL": "3c1ecf6"}
    assert card.data.recipe["command"] == "make rl PRESET=intellect3 ARGS=rl.max_steps=5"
    assert f"at revision `{cfg.model.revision}`" in card.text and "with uncommitted changes" in card.text
    assert "← `zai-org/GLM-4.5-Air-Base`" in card.text and "`base`" not in card.text  # no base stage
    assert "`PrimeIntellect/INTELLECT-3-RL` at revision `3c1ecf6`" in card.text


def test_make_command_from_recorded_commands():
    assert make_command("python -m recipe.base preset=tiny run_root=/x", "tiny") == "make base PRESET=tiny"
    assert make_command("python -u -m recipe.rl rl.env_mix={math:1.0} 'a=b c'", "tiny") == \
        "make rl PRESET=tiny ARGS='rl.env_mix={math:1.0} a=b c'"
    assert make_command("python -m pytest tests", "tiny") is None
    assert make_command("python driver.py preset=tiny", "tiny") is None


def test_eval_adds_the_scores_and_the_stage_still_skips_as_done(finished_sft, monkeypatch, capsys):
    cfg, args, run_sft = finished_sft
    sft = stage_dir(cfg, "sft")
    model = sft / "model"
    manifest = json.loads((sft / "manifest.json").read_text())
    done_before, card_before = (sft / "DONE.json").read_bytes(), (model / CARD_NAME).read_text()
    engines = []
    monkeypatch.setattr(ev, "make_eval_engine", lambda cfg, path, out: engines.append(RightOnEvenEngine())
                        or engines[-1])
    monkeypatch.setattr(ev, "write_report", lambda cfg: stage_dir(cfg, "eval") / "RESULTS.md")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "recipe.eval", "preset=tiny", *args])
    ev.main(args)
    card = ModelCard.load(model / CARD_NAME)
    assert card.text != card_before and card.data.recipe["config_hash"] == done_hash(sft)
    (result,) = card.data.eval_results
    assert (result.dataset_config, result.metric_type, result.metric_value) == ("math", "avg@2", 0.5)
    assert "| math | 0.500 ± 0.224 | 0.500 | 6 |" in card.text  # Q0, Q2, Q4 right: s.e. sqrt(0.25 * 6/5 / 6)
    assert "Written by `make eval PRESET=tiny ARGS='eval.checkpoints=[sft] eval.samples=2" in card.text
    # the card is not part of the model: the manifest's output hashes still hold, DONE.json is untouched
    assert sha256_tree(model) == manifest["outputs"]["model"] and CARD_NAME not in manifest["outputs"]["model"]
    assert (sft / "DONE.json").read_bytes() == done_before
    capsys.readouterr()
    ev.main(args)  # the same model under the same key: nothing to evaluate, no engine started
    assert len(engines) == 1 and "already evaluated" in capsys.readouterr().out
    run_sft()
    assert "sft: already done" in capsys.readouterr().out  # skipped as done
    assert ModelCard.load(model / CARD_NAME).data.eval_results  # and the scores stay


def test_a_failed_write_leaves_the_card_as_it_was(finished_sft, monkeypatch):
    cfg, _, _ = finished_sft
    model = stage_dir(cfg, "sft") / "model"
    before = (model / CARD_NAME).read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipe.runs.os, "fsync", full)
    results = {"key": "k", "env": {"math": {"avg@2": 1.0, "samples": 2, "stderr": 0.0, "problems": 6}},
               "overall": {"avg": 1.0}, "provenance": {"command": "python -m recipe.eval", "config_hash": "c",
                                                       "git": {"commit": "x"}}}
    with pytest.raises(OSError):
        write_card(cfg, "sft", model, results=results)
    assert (model / CARD_NAME).read_bytes() == before  # the old card, whole
    (model / CARD_NAME).unlink()
    with pytest.raises(OSError):
        write_card(cfg, "sft", model)
    assert not (model / CARD_NAME).exists()  # no card rather than half of one
    assert not [p for p in model.iterdir() if p.name.startswith(".")]  # no temporary file left
