"""eval.checkpoints beyond the run's stages (recipe/eval/models.py): a local model folder and a hub model at a
pinned revision, read from a Hugging Face cache filled here in the hub's own layout (HF_HUB_OFFLINE=1), run with
a real hf engine through the held-out suite and a benchmark into results.json and RESULTS.md; a hub model that
can be had neither from the cache nor from the hub fails in seconds with one line that names it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import recipe.eval.__main__ as ev
from recipe.config import TinyArch, load_config
from recipe.data.schema import message, write_rows
from recipe.eval import benchmarks as B
from recipe.eval import models as eval_models
from recipe.eval import report
from recipe.runs import Stage, stage_dir, write_atomic

REVISION = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "org/tiny-glm"
BENCH = "aime24"  # 2 fixture problems, short prompts
K = 2


# -- fixtures: a tiny model, a hub cache holding it, a finished data stage -------------------------------------
def save_model(folder: Path) -> None:
    """A tiny random Glm4MoeForCausalLM whose context holds the benchmark's prompts, and its tokenizer."""
    from recipe.model import build_tiny_model, build_tokenizer

    texts = [B.REGISTRY[BENCH].prompt(raw) for raw in B.fixture_rows(B.REGISTRY[BENCH])] + [f"Q{i}" for i in range(9)]
    tok = build_tokenizer(texts, vocab_size=400)
    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                    max_position_embeddings=1024)
    build_tiny_model(arch, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("local") / "tiny-model"
    save_model(folder)
    return folder


def fill_hub_cache(cache: Path, model: Path, hub_id: str = HUB_ID, revision: str = REVISION) -> Path:
    """The model's files as the HF cache holds a snapshot: models--<org>--<name>/snapshots/<commit>/<files> and
    refs/main naming the commit (huggingface_hub's cache layout; the blobs it links from are left out)."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_model, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return fill_hub_cache(cache, tiny_model)


def finish_data(cfg, n: int = 3) -> None:
    """A finished data stage with `n` held-out math rows (manifest and DONE.json as `make data` writes them)."""
    data = stage_dir(cfg, "data")
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "split": "eval", "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(n)]
    sha = write_rows(rows, data / "eval.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"eval.parquet": {"rows": n, "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))


def args(tmp_path, *checkpoints, extra=()) -> list[str]:
    quoted = ",".join(f"'{c}'" for c in checkpoints)
    return [f"run_root={tmp_path / 'runs'}", f"eval.checkpoints=[{quoted}]",
            f"eval.released=[{{name:INTELLECT-3,hub_id:{HUB_ID},revision:'{REVISION}'}}]",
            f"eval.samples={K}", f"eval.pass_k=[1,{K}]", "eval.max_new_tokens=4", "eval.threads=1",
            f"eval.benchmarks=[{{name:{BENCH},samples:{K},max_new_tokens:4}}]", *extra]


@pytest.fixture
def offline_benchmarks(monkeypatch):
    load = B.load_benchmark
    monkeypatch.setattr(ev, "load_benchmark", lambda spec, **kw: load(spec, offline_fixture=True))


# -- the whole path ------------------------------------------------------------------------------------------
def test_a_local_folder_and_a_cached_hub_model_run_into_results_and_the_paper_table(
        tmp_path, tiny_model, hub_cache, offline_benchmarks, one_thread, capsys):
    argv = args(tmp_path, "INTELLECT-3", str(tiny_model), f"hub:{HUB_ID}@{REVISION}")
    cfg = load_config(argv)
    finish_data(cfg)
    started = time.monotonic()
    ev.main(argv)
    eval_dir = stage_dir(cfg, "eval")
    local = eval_models.folder_name("local", str(tiny_model))
    by_ref = f"hub--org--tiny-glm--{REVISION[:12]}"
    assert sorted(p.name for p in eval_dir.iterdir() if p.is_dir()) == sorted(["INTELLECT-3", local, by_ref])
    def model(results: dict) -> dict:  # what the results' provenance records about the model evaluated
        return results["provenance"]["model"]

    for folder in ("INTELLECT-3", local, by_ref):
        held = json.loads((eval_dir / folder / "results.json").read_text())
        bench = json.loads((eval_dir / folder / BENCH / "results.json").read_text())
        assert held["env"]["math"]["problems"] == 3 and bench["benchmark"]["problems"] == 2
        assert model(held) == model(bench) and model(held)["folder"] == folder
        samples = (eval_dir / folder / BENCH / "samples.jsonl").read_text().splitlines()
        assert len(samples) == 2 * K  # sampled for real: every problem K times
    hub = json.loads((eval_dir / "INTELLECT-3" / BENCH / "results.json").read_text())
    assert model(hub)["kind"] == "hub" and model(hub)["revision"] == REVISION
    assert model(hub)["revision_verified"] is False and model(hub)["paper_row"] == "INTELLECT-3"
    assert hub["model_sha"] == f"{HUB_ID}@{REVISION}" and hub["provenance"]["inputs"]["model"] == hub["model_sha"]
    from recipe.runs import sha256_file

    assert model(hub)["weights_sha256"] == sha256_file(tiny_model / "model.safetensors")
    folder = json.loads((eval_dir / local / BENCH / "results.json").read_text())
    assert model(folder)["kind"] == "local" and model(folder)["path"] == str(tiny_model.resolve())
    assert folder["model_sha"] != hub["model_sha"] and model(folder)["revision"] is None
    by_hub_ref = json.loads((eval_dir / by_ref / BENCH / "results.json").read_text())
    assert model(by_hub_ref)["paper_row"] == "INTELLECT-3" and "revision_verified" not in model(by_hub_ref)

    page = (tmp_path / "runs" / "RESULTS.md").read_text()
    lines = page.splitlines()
    paper = lines.index("| INTELLECT-3 (paper) | 98.1 | 90.8 | 88.0 | 69.3 | 74.4 | 14.6 | 81.9 |")
    under = lines[paper + 1:paper + 3]  # the two INTELLECT-3 rows measured here sit under the paper's row
    avg = 100 * hub["benchmark"][f"avg@{K}"]
    se = 100 * hub["benchmark"]["stderr"]
    cell = f"{avg:.1f} ± {se:.1f} (avg@{K}, n=2)" + (" †" if abs(90.8 - avg) > 2 * se else "")
    assert under[0].startswith(f"| INTELLECT-3 (measured here: `tiny` eval/INTELLECT-3, {HUB_ID}@{REVISION[:10]}, "
                               f"revision unverified) | not run | {cell} |"), under
    assert under[1].startswith(f"| INTELLECT-3 (measured here: `tiny` eval/{by_ref}, {HUB_ID}@{REVISION[:10]}) |")
    assert any(ln.startswith(f"| `{local}` (measured here: `tiny` eval/{local}, local folder) | not run | ")
               for ln in lines)
    assert f"| {local} | " in page  # the held-out table has a row for it too
    out = capsys.readouterr().out
    assert "INTELLECT-3" in out and time.monotonic() - started < 120

    ev.main(argv)  # everything evaluated: nothing is sampled again
    assert capsys.readouterr().out.count("already evaluated") == 6


def test_the_held_out_and_benchmark_evals_of_a_hub_model_resume_per_problem(
        tmp_path, hub_cache, offline_benchmarks, monkeypatch, one_thread):
    argv = args(tmp_path, "INTELLECT-3", extra=["eval.batch_size=2"])  # one problem (K=2 samples) a call
    cfg = load_config(argv)
    finish_data(cfg)
    made = ev.make_eval_engine
    calls = []

    class Killed(Exception):
        pass

    def engine_killed_after(n):
        def make(cfg, path, out):
            engine = made(cfg, path, out)
            generate = engine.generate

            def counted(prompts, params):
                calls.append(len(prompts))
                if n is not None and len(calls) > n:
                    raise Killed  # stands in for a kill in the middle of the run
                return generate(prompts, params)

            engine.generate = counted
            return engine
        return make

    monkeypatch.setattr(ev, "make_eval_engine", engine_killed_after(4))  # held-out 3 problems, then 1 of the 2
    with pytest.raises(Killed):
        ev.main(argv)
    out = stage_dir(cfg, "eval") / "INTELLECT-3"
    assert not (out / BENCH / "results.json").exists() and (out / "results.json").exists()
    assert len((out / BENCH / "samples.jsonl").read_text().splitlines()) == K
    calls.clear()
    monkeypatch.setattr(ev, "make_eval_engine", engine_killed_after(None))
    ev.main(argv)
    assert calls == [K]  # only the benchmark's problem not finished before the kill
    res = json.loads((out / BENCH / "results.json").read_text())
    assert res["benchmark"]["problems"] == 2 and len((out / BENCH / "samples.jsonl").read_text().splitlines()) == 2 * K


# -- a hub model that cannot be had ------------------------------------------------------------------------------
def run_main(argv, capsys) -> tuple[int, list[str], float]:
    started = time.monotonic()
    with pytest.raises(SystemExit) as ex:
        ev.main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return ex.value.code, err, time.monotonic() - started


def test_a_hub_model_offline_and_not_in_the_cache_fails_in_seconds_naming_it(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    entry = f"hub:org/absent@{REVISION}"
    code, err, took = run_main(args(tmp_path, "sft", entry, extra=["eval.held_out=false"]), capsys)
    assert code == 2 and len(err) == 1 and took < 5, (err, took)
    assert err[0].startswith(f"error: eval.checkpoints '{entry}': org/absent@{REVISION} is not in the local HF cache")
    assert "HF_HUB_OFFLINE=1" in err[0]
    assert not (tmp_path / "runs" / "tiny" / "eval" / "sft").exists()  # checked before any work


def test_a_hub_model_without_network_fails_in_seconds_naming_it(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port: no hub answers
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    code, err, took = run_main(args(tmp_path, "INTELLECT-3", extra=["eval.held_out=false", "eval.hub_timeout_s=2"]),
                               capsys)
    assert code == 2 and len(err) == 1 and took < 5, (err, took)
    assert err[0].startswith(f"error: eval.checkpoints 'INTELLECT-3': cannot load {HUB_ID}@{REVISION}: the Hugging "
                             f"Face Hub (http://127.0.0.1:9) is unreachable")


def test_an_offline_snapshot_without_its_weights_is_refused_before_an_engine_starts(tmp_path, hub_cache, monkeypatch,
                                                                                   offline_benchmarks, capsys):
    (hub_cache / "model.safetensors").unlink()
    monkeypatch.setattr(ev, "make_eval_engine", lambda *a: pytest.fail("an engine was started"))
    code, err, _ = run_main(args(tmp_path, "INTELLECT-3", extra=["eval.held_out=false"]), capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"error: eval.checkpoints 'INTELLECT-3': the HF cache's snapshot of {HUB_ID}@{REVISION} "
                             "lacks model.safetensors")


# -- names, keys and the report's rows ---------------------------------------------------------------------------
def test_each_model_gets_its_own_folder():
    assert eval_models.folder_name("released", "INTELLECT-3") == "INTELLECT-3"
    assert eval_models.folder_name("hub", f"hub:a/b@{REVISION}", "a/b", REVISION) == "hub--a--b--0123456789ab"
    one, two = eval_models.folder_name("local", "x/model"), eval_models.folder_name("local", "y/model")
    assert one.startswith("local--model--") and two.startswith("local--model--") and one != two


def test_the_weights_digest_is_the_index_of_a_sharded_model_else_its_one_file(tmp_path):
    import torch

    from recipe.runs import sha256_file
    from recipe.weights import write_weights

    state = {"a": torch.zeros(64), "b": torch.ones(64)}
    sharded = write_weights(state, tmp_path / "sharded" / "model.safetensors", max_shard_bytes=300)
    digest = eval_models.weights_digest(sharded)
    assert digest == {"index_sha256": sha256_file(sharded / "model.safetensors.index.json")}
    single = write_weights(state, tmp_path / "single" / "model.safetensors")
    assert eval_models.weights_digest(single.parent) == {"weights_sha256": sha256_file(single)}
    assert eval_models.weights_digest(tmp_path / "empty") == {}


@pytest.mark.parametrize("override,message", [
    ("eval.released=[{name:sft,hub_id:a/b}]", "eval.released[0].name='sft' must be a folder name"),
    ("eval.released=[{name:A,hub_id:a/b},{name:A,hub_id:c/d}]", "eval.released[1].name='A' is listed twice"),
    ("eval.released=[{name:A,hub_id:ab}]", "eval.released[0].hub_id='ab' is not a hub repository id"),
    ("eval.released=[{name:A,hub_id:a/b,revision:main}]", "eval.released[0].revision='main' of a/b is not a full"),
])
def test_released_models_are_checked_with_the_config(override, message):
    from recipe.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config([override])


def test_a_released_model_without_a_revision_cannot_be_evaluated():
    from recipe.errors import ConfigError

    load_config(["eval.released=[{name:A,hub_id:a/b}]"])  # listed, not chosen: fine
    with pytest.raises(ConfigError, match=r"eval.checkpoints\[0\]='A': eval.released names a/b without a revision"):
        load_config(["eval.released=[{name:A,hub_id:a/b}]", "eval.checkpoints=[A]"])


def test_the_intellect3_preset_lists_the_papers_released_models_pinned():
    cfg = load_config(["preset=intellect3"])
    released = {m.name: m for m in cfg.eval.released}
    assert set(released) == {"INTELLECT-3", "GLM-4.5-Air"} <= set(report.PAPER_SCORES)
    assert released["INTELLECT-3"].hub_id == "PrimeIntellect/INTELLECT-3"
    assert released["GLM-4.5-Air"].hub_id == "zai-org/GLM-4.5-Air"
    for m in released.values():  # no primary source names the revisions: marked so, with where they come from
        assert len(m.revision) == 40 and m.revision_verified is False and m.revision_source.startswith("unverified")
    load_config(["preset=intellect3", "eval.checkpoints=[INTELLECT-3,GLM-4.5-Air]"])


def test_the_held_out_key_does_not_depend_on_which_models_are_evaluated():
    base = load_config([])
    assert ev.held_out_hash(base) == ev.held_out_hash(load_config(["eval.checkpoints=[sft]"]))
    assert ev.held_out_hash(base) == ev.held_out_hash(load_config(["eval.checkpoints=[sft,x/model]"]))
    assert ev.held_out_hash(base) != ev.held_out_hash(load_config(["eval.samples=2", "eval.pass_k=[1]"]))


def synthetic_result(folder: Path, bench: str, avg: float, stderr: float, problems: int, model: dict) -> None:
    spec = B.REGISTRY[bench]
    write_atomic(folder / bench / "results.json", json.dumps({
        "benchmark": {"problems": problems, f"avg@{spec.samples}": avg, "stderr": stderr},
        "protocol": {"samples": spec.samples, "expected_problems": spec.expected_problems},
        "provenance": {"model": model}}))


def test_the_paper_table_sets_each_measured_model_beside_its_paper_row_with_standard_errors(tmp_path):
    cfg = load_config([f"run_root={tmp_path / 'runs'}", "preset=intellect3"])
    eval_dir = stage_dir(cfg, "eval")
    i3 = {"kind": "hub", "hub_id": "PrimeIntellect/INTELLECT-3", "revision": "f" * 40, "paper_row": "INTELLECT-3",
          "revision_verified": False}
    # MATH-500 97.0 ± 0.4: the paper's 98.1 is 1.1 away, more than two standard errors; AIME24 90.0 ± 5.0: within
    synthetic_result(eval_dir / "INTELLECT-3", "math500", 0.970, 0.004, 500, i3)
    synthetic_result(eval_dir / "INTELLECT-3", "aime24", 0.900, 0.050, 30, i3)
    air = {"kind": "hub", "hub_id": "zai-org/GLM-4.5-Air", "revision": "a" * 40, "paper_row": "GLM-4.5-Air"}
    synthetic_result(eval_dir / "hub--zai-org--GLM-4.5-Air--aaaaaaaaaaaa", "gpqa_diamond", 0.733, 0.02, 198, air)
    other = {"kind": "local", "paper_row": None}
    synthetic_result(eval_dir / "local--mine--12345678", "hle", 0.1, 0.01, 2158, other)
    text = report.paper_section(cfg)
    lines = text.splitlines()
    row = lines[lines.index("| INTELLECT-3 (paper) | 98.1 | 90.8 | 88.0 | 69.3 | 74.4 | 14.6 | 81.9 |") + 1]
    assert row == (f"| INTELLECT-3 (measured here: `intellect3` eval/INTELLECT-3, PrimeIntellect/INTELLECT-3@"
                   f"{'f' * 10}, revision unverified) | 97.0 ± 0.4 † | 90.0 ± 5.0 | not run | not run | not run | "
                   "not run | not run |")
    row = lines[lines.index("| GLM-4.5-Air (paper) | 97.8 | 84.6 | 82.0 | 61.5 | 73.3 | 13.3 | 73.9 |") + 1]
    assert row.startswith("| GLM-4.5-Air (measured here: `intellect3` eval/hub--zai-org--GLM-4.5-Air--aaaaaaaaaaaa, "
                          f"zai-org/GLM-4.5-Air@{'a' * 10}) |") and row.endswith("| 73.3 ± 2.0 | not run | not run |")
    assert lines[-1] == ("| `local--mine--12345678` (measured here: `intellect3` eval/local--mine--12345678, local "
                         "folder) | not run | not run | not run | not run | not run | 10.0 ± 1.0 | not run |")
    assert "| this recipe: `intellect3` rl | not run |" in text  # the run's own rows stay, without a paper mark


def test_a_model_evaluated_at_another_k_shows_dashes_in_the_held_out_table(tmp_path):
    cfg = load_config([f"run_root={tmp_path / 'runs'}"])  # eval.samples 4
    prov = {"wall_s": 1.0, "config_hash": "c", "git": {"commit": "0" * 40, "dirty": False},
            "hardware": {"cpus": 2, "machine": "x"}, "packages": {}}
    for folder, k in (("sft", 4), ("local--old--1234abcd", 2)):
        stats = {f"avg@{k}": 0.5, "stderr": 0.1, f"pass@{k}": 0.75, "problems": 3}
        write_atomic(stage_dir(cfg, "eval") / folder / "results.json", json.dumps(
            {"env": {"math": stats}, "task": {"math/add": stats}, "overall": {"avg": 0.5}, "provenance": prov}))
    results = report.load_results(cfg)
    assert list(results) == ["sft", "local--old--1234abcd"]  # the stages first, then the other models
    table = report.tiny_table(cfg, results)
    assert "| sft | 0.500 ± 0.100 | 0.750 | 0.500 |" in table
    assert "| local--old--1234abcd | - | - | - |" in table
    assert "| math/add | 0.500 / 0.750 | - |" in report.task_table(cfg, results)
