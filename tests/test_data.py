"""The tiny data: schema, format, and held-out prompts that never appear in training data."""
import json

import pyarrow.parquet as pq
import pytest

from recipe.data.schema import DataError, read_rows, read_split, write_rows


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from recipe.config import load_config
    from recipe.data.__main__ import main

    root = tmp_path_factory.mktemp("runs")
    args = [f"run_root={root}", "data.sft_rows_per_task=300", "data.rl_rows_per_task=100",
            "data.eval_rows_per_task=30", "data.pretrain_rows_per_task=100"]
    main(args)
    return root / "tiny" / "data", args, load_config(args)


def test_splits_never_overlap(data_dir):
    d, _, _ = data_dir
    prompts = {s: {r["prompt"][0]["content"] for r in read_split(d, s)} for s in ("sft", "rl", "eval")}
    assert prompts["eval"] and prompts["sft"] and prompts["rl"]
    assert not prompts["eval"] & prompts["sft"]
    assert not prompts["eval"] & prompts["rl"]
    assert not prompts["sft"] & prompts["rl"]
    pretrain = " ".join(pq.read_table(d / "pretrain.parquet").column("text").to_pylist())
    # the pretraining text never contains a held-out question
    questions = [json.loads(r["info"])["entry"]["question"] for r in read_split(d, "eval")]
    assert not [q for q in questions if q in pretrain]


def test_rows_follow_the_schema_and_the_think_format(data_dir):
    d, _, cfg = data_dir
    sft = read_split(d, "sft")
    assert len(sft) == 300 * len(cfg.data.tasks)
    assert {r["env"] for r in sft} == {"math", "logic", "code", "tools"}
    for r in [r for r in sft if r["env"] != "tools"][::20]:
        text = r["completion"][0]["content"]
        assert text.startswith("<think>\n") and "\n</think>\n" in text
        assert r["answer"] in text.split("</think>")[1]
    assert all(r["completion"] == [] for r in read_split(d, "rl"))


def test_sft_answers_are_correct_by_the_env_verifiers(data_dir):
    from recipe.envs import get_env

    d, _, _ = data_dir
    for r in read_split(d, "sft")[::37]:
        if r["env"] == "tools" and "<tool_call>" not in r["completion"][0]["content"]:
            continue  # a hasty demonstrator's guess, wrong on purpose (tests/test_tools_env.py)
        assert get_env(r["env"]).score(r["completion"][0]["content"], r).reward == 1.0, r["id"]


def test_rerun_is_a_no_op_and_manifest_hashes_match(data_dir, capsys):
    from recipe.data.__main__ import main
    from recipe.runs import sha256_file

    d, args, _ = data_dir
    before = (d / "DONE.json").stat().st_mtime_ns
    main(args)
    assert "already done" in capsys.readouterr().out
    assert (d / "DONE.json").stat().st_mtime_ns == before
    files = json.loads((d / "data_manifest.json").read_text())["files"]
    for name, meta in files.items():
        assert sha256_file(d / name) == meta["sha256"]
    manifest = json.loads((d / "manifest.json").read_text())
    for key in ("git", "packages", "hardware", "seed", "wall_s", "outputs", "config_hash"):
        assert key in manifest


def test_missing_and_corrupt_files_are_named(data_dir, tmp_path):
    import shutil

    d, _, _ = data_dir
    copy = tmp_path / "data"
    shutil.copytree(d, copy)
    with open(copy / "rl.parquet", "r+b") as f:
        f.seek(100)
        f.write(b"garbage")
    with pytest.raises(DataError, match="rl.parquet"):
        read_split(copy, "rl")
    (copy / "eval.parquet").unlink()
    with pytest.raises(DataError, match="eval.parquet"):
        read_split(copy, "eval")
    (copy / "data_manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="data_manifest.json"):
        read_split(copy, "sft")
    with pytest.raises(DataError, match="row 0"):
        write_rows([{"id": "x"}], tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet"):
        read_rows(tmp_path / "junk.parquet")


def test_fn_fit_code_task_rows_are_scored_by_the_sandbox(tmp_path):
    """The tiny code task: the demonstrated program passes its hidden tests in the sandbox; a wrong one does not."""
    from recipe.config import load_config
    from recipe.data.tiny import build_tiny
    from recipe.envs import get_env
    from recipe.chat import parse_final_answer

    cfg = load_config([f"run_root={tmp_path}", "data.sft_rows_per_task=10", "data.rl_rows_per_task=10",
                       "data.eval_rows_per_task=10", "data.no_think_fraction=0",
                       "data.tasks=[{env: code, task: fn_fit, params: {}}]"])
    rows = build_tiny(cfg.data)
    row = rows["sft"][0]
    demo = row["completion"][0]["content"]
    name = json.loads(row["info"])["entry"]["tests"]["fn_name"]
    assert row["env"] == "code" and f"```python\ndef {name}(x):" in parse_final_answer(demo)
    env = get_env("code")
    assert env.score(demo, row).reward == 1.0
    wrong = demo.replace("return ", "return 1 + ")
    assert env.score(wrong, row).reward < 1.0 and not env.score(wrong, row).masked
