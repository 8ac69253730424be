"""INTELLECT-3 hub data: conversion of fixture rows to the schema, the offline pass-rate filter, the eval hold-out,
and fast, clear failures when the hub cannot be reached or a revision is not pinned."""
from __future__ import annotations

import contextlib
import http.server
import json
import math
import socket
import threading
import time
from pathlib import Path

import pytest

from recipe.config import DataConfig, HubDataset
from recipe.data import hub
from recipe.data.schema import DataError, read_rows, too_easy, write_rows
from recipe.envs.math import INSTRUCTION

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "fixtures"
RL_SUBSETS = ["math", "code", "science", "logic"]
# the subset each SFT fixture row stands for, in file order
SFT_SUBSETS = ["am_chat", "am_chat", "openreasoning_code", "toucan_tool"]
EASY_QUESTION = "What is 17 + 25?"


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def data_cfg(**overrides) -> DataConfig:
    cfg = DataConfig(
        source="intellect3",
        sft_dataset=HubDataset(id="PrimeIntellect/INTELLECT-3-SFT", revision="0123abcd",
                               subsets=sorted(set(SFT_SUBSETS))),
        rl_dataset=HubDataset(id="PrimeIntellect/INTELLECT-3-RL", revision="4567ef01", subsets=list(RL_SUBSETS)),
        hub_timeout_s=2.0,
        max_pass_rate={"math": 0.874},  # configs/data/intellect3.yaml
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def fixture_loader(subset: str):
    if subset in RL_SUBSETS:
        return read_jsonl(f"intellect3_rl_{subset}.jsonl")
    return [row for row, s in zip(read_jsonl("intellect3_sft.jsonl"), SFT_SUBSETS) if s == subset]


def roundtrip(rows: list[dict], tmp_path: Path) -> list[dict]:
    path = tmp_path / "rows.parquet"
    sha = write_rows(rows, path)
    return read_rows(path, sha)


# ---------------------------------------------------------------- conversions


def test_sft_rows_convert_and_roundtrip(tmp_path):
    raws = read_jsonl("intellect3_sft.jsonl")
    rows = [hub.sft_row(raw, subset, i) for i, (raw, subset) in enumerate(zip(raws, SFT_SUBSETS))]
    assert roundtrip(rows, tmp_path) == rows
    assert len({r["id"] for r in rows}) == len(rows)
    for row, raw, subset in zip(rows, raws, SFT_SUBSETS):
        assert (row["env"], row["task"], row["split"], row["answer"], row["difficulty"]) == ("sft", subset, "sft", "", 0.0)
        assert row["id"] == f"{subset}:{raw['source']['dataset']}:{raw['source']['index']}"
        assert [m["role"] for m in row["prompt"]] == [m["role"] for m in raw["prompt"]]
        assert row["completion"][-1]["role"] == "assistant"
        info = json.loads(row["info"])
        assert info["source"] == raw["source"] and info["source_split"] == raw["split"]
        assert isinstance(json.loads(row["tools"]), list)

    tool_row = rows[3]
    call = json.loads(tool_row["completion"][0]["tool_calls"])
    assert call[0]["function"]["name"] == "get_current_time" and call[0]["type"] == "function"
    assert json.loads(call[0]["function"]["arguments"]) == {"timezone": "Europe/Lisbon"}
    assert tool_row["completion"][1]["role"] == "tool" and tool_row["completion"][1]["tool_calls"] is None
    assert json.loads(tool_row["tools"])[0]["function"]["name"] == "get_current_time"
    assert all(m["tool_calls"] is None for r in rows[:3] for m in r["prompt"] + r["completion"])


def test_sft_row_without_source_gets_a_stable_hash_id():
    raw = {k: v for k, v in read_jsonl("intellect3_sft.jsonl")[0].items() if k != "source"}
    a, b = hub.sft_row(raw, "am_chat", 0), hub.sft_row(raw, "am_chat", 5)
    assert a["id"] == b["id"] and a["id"].startswith("am_chat:")


def test_rl_rows_convert_and_roundtrip(tmp_path):
    cfg = data_cfg()
    rows = {s: [hub.rl_row(raw, s, i, cfg) for i, raw in enumerate(read_jsonl(f"intellect3_rl_{s}.jsonl"))]
            for s in RL_SUBSETS}
    flat = [r for s in RL_SUBSETS for r in rows[s]]
    assert roundtrip(flat, tmp_path) == flat
    for s in RL_SUBSETS:
        for i, row in enumerate(rows[s]):
            assert (row["env"], row["split"], row["completion"], row["tools"]) == (s, "rl", [], "[]")
            assert row["id"] == f"{s}-{i}" and len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user"
            info = json.loads(row["info"])
            assert info["source"] == {"dataset": cfg.rl_dataset.id, "revision": cfg.rl_dataset.revision,
                                      "subset": s, "index": i}
    # math: the environment's instruction, a newline, then the question; difficulty from the configured column
    raw_math = read_jsonl("intellect3_rl_math.jsonl")
    for row, raw in zip(rows["math"], raw_math):
        assert row["prompt"][0]["content"] == f"{INSTRUCTION}\n{raw['question']}"
        assert row["answer"] == raw["answer"] and row["difficulty"] == raw["avg@8_qwen3_4b_thinking_2507"]
    # the other subsets lack the configured column: the first avg@k column is used, and no instruction is added
    code = rows["code"][0]
    assert code["prompt"][0]["content"] == read_jsonl("intellect3_rl_code.jsonl")[0]["question"]
    assert json.loads(code["info"])["pass_rate_column"] == "avg@8_qwen3_4b_instruct_2507"
    assert json.loads(code["info"])["entry"]["tests"]["outputs"] == ["6\n"]  # nested JSON decoded
    assert [r["task"] for r in rows["science"]] == ["physics", "chemistry", "biology"]
    assert rows["science"][0]["answer"] == "6" and rows["science"][0]["difficulty"] == 0.8125
    assert [r["task"] for r in rows["logic"]] == ["sort_letters", "ordering", "mini_sudoku"]
    assert rows["logic"][0]["answer"] == "" and rows["logic"][0]["difficulty"] == 0.5625


def test_rl_row_without_pass_rate_column_is_an_error_where_the_filter_needs_one():
    with pytest.raises(DataError, match="math row 3: no pass-rate column"):
        hub.rl_row({"question": "1+1?", "answer": "2"}, "math", 3, data_cfg())
    # code is not filtered: a row without the column has no pass rate (NaN), and is kept
    row = hub.rl_row({"question": "Print 1.", "answer": ""}, "code", 3, data_cfg())
    assert math.isnan(row["difficulty"]) and not too_easy(row, data_cfg().max_pass_rate)


# ---------------------------------------------------------------- filter and splits


def test_filter_drops_exactly_the_too_easy_row(capsys):
    out = hub.build_intellect3(data_cfg(), loader=fixture_loader)
    kept = out["rl"] + out["eval"]
    questions = [r["prompt"][0]["content"] for r in kept]
    assert len(kept) == 3 * len(RL_SUBSETS) - 1
    assert not any(q.endswith(EASY_QUESTION) for q in questions)
    assert all(r["difficulty"] <= 0.874 for r in kept)
    log = capsys.readouterr().out
    assert "rl/math: 3 rows, dropped 1 with avg@8_qwen3_4b_thinking_2507 > 0.874;" in log
    for s in ["code", "science", "logic"]:
        assert f"rl/{s}: 3 rows, no pass-rate filter;" in log
    assert len(out["sft"]) == 4 and {r["split"] for r in out["sft"]} == {"sft"}


def rated_loader(rates):
    """Every RL subset: one row per pass rate in `rates` (None: the row has no pass rate)."""
    def load(subset):
        if subset in RL_SUBSETS:
            return [{"question": f"{subset} question {i}", "answer": str(i), "avg@8_qwen3_4b_thinking_2507": r}
                    for i, r in enumerate(rates)]
        return fixture_loader(subset)

    return load


def test_math_rows_above_0874_are_dropped_code_rows_at_any_pass_rate_kept(capsys):
    rates = [0.0, 0.5, 0.874, 0.875, 0.9, 1.0]
    out = hub.build_intellect3(data_cfg(), loader=rated_loader(rates))
    kept = out["rl"] + out["eval"]
    by_env = {s: sorted(r["difficulty"] for r in kept if r["env"] == s) for s in RL_SUBSETS}
    assert by_env["math"] == [0.0, 0.5, 0.874]  # above 0.874 is dropped; 0.874 itself is kept
    assert by_env["code"] == by_env["science"] == by_env["logic"] == rates  # not filtered: even 1.0 stays
    assert "rl/code: 6 rows, no pass-rate filter;" in capsys.readouterr().out
    # the same config filtering code too would drop its three rows above the threshold
    out = hub.build_intellect3(data_cfg(max_pass_rate={"math": 0.874, "code": 0.874}), loader=rated_loader(rates))
    assert sorted(r["difficulty"] for r in out["rl"] + out["eval"] if r["env"] == "code") == [0.0, 0.5, 0.874]
    # no filter at all
    out = hub.build_intellect3(data_cfg(max_pass_rate={}), loader=rated_loader(rates))
    assert len(out["rl"] + out["eval"]) == len(rates) * len(RL_SUBSETS)


def test_a_row_without_a_pass_rate_is_kept_and_counted(capsys):
    out = hub.build_intellect3(data_cfg(), loader=rated_loader([None, 1.0, 0.5]))
    math_rows = [r for r in out["rl"] + out["eval"] if r["env"] == "math"]
    assert sorted(r["id"] for r in math_rows) == ["math-0", "math-2"] and math.isnan(
        next(r for r in math_rows if r["id"] == "math-0")["difficulty"])
    assert ("rl/math: 3 rows, dropped 1 with avg@8_qwen3_4b_thinking_2507 > 0.874, kept 1 without a pass rate;"
            in capsys.readouterr().out)


def test_filter_uses_the_configured_column():
    # on the instruct column two math rows pass 0.874 (1.0 and 0.875)
    out = hub.build_intellect3(data_cfg(pass_rate_column="avg@8_qwen3_4b_instruct_2507"), loader=fixture_loader)
    math_rows = [r for r in out["rl"] + out["eval"] if r["env"] == "math"]
    assert [r["id"] for r in math_rows] == ["math-0"]


def synthetic_loader(n: int):
    def load(subset):
        if subset in RL_SUBSETS:
            return [{"question": f"{subset} question {i}: what is {i} * 3?", "answer": str(3 * i),
                     "avg@16_qwen3_4b_instruct_2507": (i % 10) / 10} for i in range(n)]
        return fixture_loader(subset)

    return load


def test_eval_and_rl_never_overlap():
    out = hub.build_intellect3(data_cfg(), loader=synthetic_loader(400))
    assert out["eval"], "400 prompts a subset should hold some out"
    assert {r["split"] for r in out["rl"]} == {"rl"} and {r["split"] for r in out["eval"]} == {"eval"}
    text = lambda r: r["prompt"][0]["content"]  # noqa: E731
    assert not {r["id"] for r in out["rl"]} & {r["id"] for r in out["eval"]}
    assert not {text(r) for r in out["rl"]} & {text(r) for r in out["eval"]}
    assert all(hub.is_eval(r) for r in out["eval"]) and not any(hub.is_eval(r) for r in out["rl"])
    # math: 0.9 pass rate is dropped, so 9 of 10 rows remain; the others are not filtered; every row that
    # remains lands in exactly one split
    assert len(out["rl"]) + len(out["eval"]) == 360 + 3 * 400
    again = hub.build_intellect3(data_cfg(), loader=synthetic_loader(400))
    assert [r["id"] for r in again["eval"]] == [r["id"] for r in out["eval"]]


def test_max_rows_caps_each_subset():
    out = hub.build_intellect3(data_cfg(max_rows=7), loader=synthetic_loader(400))
    rows = out["rl"] + out["eval"]
    assert all(sum(r["env"] == s for r in rows) <= 7 for s in RL_SUBSETS)
    assert {r["id"] for r in rows} <= {f"{s}-{i}" for s in RL_SUBSETS for i in range(7)}
    assert len([r for r in out["sft"] if r["task"] == "am_chat"]) == 2


# ---------------------------------------------------------------- the hub and pinning


class FakeHub:
    """Stands in for datasets.load_dataset: records each call and serves fixture rows."""

    def __init__(self):
        self.calls = []

    def __call__(self, path, name, split, revision, streaming=False):
        self.calls.append({"id": path, "subset": name, "split": split, "revision": revision, "streaming": streaming})
        return iter(fixture_loader(name))


@pytest.fixture
def hub_at(monkeypatch):
    """Online mode with huggingface_hub's endpoint moved to a given url; load_dataset replaced by a FakeHub."""
    import datasets
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    fake = FakeHub()
    monkeypatch.setattr(datasets, "load_dataset", fake)

    def move(url: str) -> FakeHub:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        return fake

    return move


@contextlib.contextmanager
def http_server(status: int, headers: dict | None = None):
    """A local HTTP server that answers every GET with one status (a hub, or a proxy that is not one)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def assert_fails_fast(cfg, *needles):
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        hub.build_intellect3(cfg)
    elapsed = time.monotonic() - start
    msg = str(err.value)
    assert elapsed < 15, f"took {elapsed:.1f}s"
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return elapsed


def test_unreachable_hub_fails_fast_naming_the_dataset(hub_at):
    fake = hub_at("http://127.0.0.1:9")  # closed port: connection refused
    assert_fails_fast(data_cfg(), "PrimeIntellect/INTELLECT-3-SFT@0123abcd", "PrimeIntellect/INTELLECT-3-RL@4567ef01",
                      "unreachable", "http://127.0.0.1:9", "HF_HUB_OFFLINE=1")
    assert fake.calls == []


def test_silent_hub_fails_within_the_timeout(hub_at):
    # a port that accepts connections but never answers: the probe must give up after hub_timeout_s
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        fake = hub_at(f"http://127.0.0.1:{silent.getsockname()[1]}")
        elapsed = assert_fails_fast(data_cfg(hub_timeout_s=1.0), "PrimeIntellect/INTELLECT-3-SFT@0123abcd",
                                    "unreachable", "HF_HUB_OFFLINE=1")
    assert elapsed < 1.0 + 3 and fake.calls == []


def test_a_hanging_lookup_is_cut_at_the_timeout(hub_at, monkeypatch):
    # DNS resolution ignores socket timeouts: the probe's own deadline must still hold
    release = threading.Event()
    import recipe.hub

    monkeypatch.setattr(recipe.hub, "_ask", lambda url, timeout, outcome: release.wait(60))
    fake = hub_at("http://hub.invalid")
    try:
        elapsed = assert_fails_fast(data_cfg(hub_timeout_s=0.5), "no answer within 0.5s", "INTELLECT-3-RL@4567ef01")
    finally:
        release.set()
    assert elapsed < 0.5 + 3 and fake.calls == []


def test_an_answer_that_is_not_the_hub_counts_as_unreachable(hub_at):
    # a sandbox proxy may answer 404 for any host: without the hub's X-Error-Code it is not the hub
    with http_server(404) as url:
        fake = hub_at(url)
        assert_fails_fast(data_cfg(), "PrimeIntellect/INTELLECT-3-SFT@0123abcd", "unreachable",
                          "HTTP 404 from something that is not the hub")
    assert fake.calls == []


def test_hub_rejecting_the_revision_is_a_clear_error(hub_at):
    with http_server(404, {"X-Error-Code": "RevisionNotFound"}) as url:
        fake = hub_at(url)
        assert_fails_fast(data_cfg(), "404 RevisionNotFound", "PrimeIntellect/INTELLECT-3-SFT@0123abcd")
    assert fake.calls == []


def test_reachable_hub_loads_each_subset_at_the_pinned_revision(hub_at):
    with http_server(200) as url:
        fake = hub_at(url)
        out = hub.build_intellect3(data_cfg(max_rows=2))
    assert len(out["sft"]) == 2 + 1 + 1 and len(out["rl"]) + len(out["eval"]) == 2 * 4 - 1
    expected = [("PrimeIntellect/INTELLECT-3-SFT", s, "0123abcd") for s in sorted(set(SFT_SUBSETS))]
    expected += [("PrimeIntellect/INTELLECT-3-RL", s, "4567ef01") for s in RL_SUBSETS]
    assert [(c["id"], c["subset"], c["revision"]) for c in fake.calls] == expected
    assert all(c["split"] == "train" and c["streaming"] for c in fake.calls)  # a row cap streams


def test_offline_mode_without_cache_fails_fast(monkeypatch, tmp_path):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # safety net: no real request either way
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    assert_fails_fast(data_cfg(), "PrimeIntellect/INTELLECT-3-SFT@0123abcd", "offline mode", "HF_HUB_OFFLINE=1")
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == before  # flags restored


@pytest.mark.parametrize("kind", ["sft_dataset", "rl_dataset"])
@pytest.mark.parametrize("revision", ["", "  "])
def test_empty_revision_is_an_error(kind, revision):
    cfg = data_cfg()
    getattr(cfg, kind).revision = revision
    with pytest.raises(DataError, match=f"revision of {getattr(cfg, kind).id} is empty"):
        hub.build_intellect3(cfg, loader=fixture_loader)


def test_rl_code_and_science_rows_are_scored_by_their_environments():
    """INTELLECT-3-RL's code rows run their tests in the real sandbox; science rows without options fall back
    to math-verify on the reference answer."""
    from recipe.envs import get_env

    cfg = data_cfg()
    code_rows = [hub.rl_row(raw, "code", i, cfg) for i, raw in enumerate(read_jsonl("intellect3_rl_code.jsonl"))]
    programs = {0: ("n = int(input())\nprint(sum(map(int, input().split()[:n])))", "print(0)"),
                1: ("def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)", "def count_vowels(s):\n    return 0")}
    env = get_env("code")
    for i, (good, bad) in programs.items():
        row = code_rows[i]
        assert env.score(f"<think></think>```python\n{good}\n```", row).reward == 1.0
        res = env.score(f"<think></think>```python\n{bad}\n```", row)
        assert res.reward < 1.0 and not res.masked
    science = [hub.rl_row(raw, "science", i, cfg) for i, raw in enumerate(read_jsonl("intellect3_rl_science.jsonl"))]
    env = get_env("science")
    assert env.score("<think></think>\\boxed{6}", science[0]).reward == 1.0
    assert env.score("<think></think>\\boxed{7}", science[0]).reward == 0.0
