"""The paper's benchmarks: registry and protocol, the shipped fixtures (raw rows in each hub dataset's own schema)
through their converters into schema rows, a right and a wrong completion scored for each, the option-letter and
code scorers, masking, fast hub failures, and `make eval` end to end on a scripted engine with resume."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import pickle
import sys
import time
import types
import zlib
from dataclasses import dataclass, field

import pytest

from recipe.config import BenchmarkConfig, EvalConfig, load_config
from recipe.data.schema import read_rows, write_rows
from recipe.envs import ENVIRONMENTS, get_env
from recipe.envs.code import extract_code, row_tests
from recipe.envs.science import extract_letter
from recipe.eval import benchmarks as B
from recipe.inference import Completion
from recipe.chat import encode_prompt
from tests.fakes import CharTokenizer

NAMES = list(B.REGISTRY)
# k of the release evals: prime-rl configs/int3/eval/full-eval.toml, rollouts_per_example of each environment
RELEASE_K = {"math500": 4, "aime24": 64, "aime25": 64, "lcb_v6": 2, "gpqa_diamond": 8, "hle": 1, "mmlu_pro": 1}
THINK = "<think>reasoning</think>\n"
# LiveCodeBench fixture programs, by question_id
PROGRAMS = {
    "fixture_abc001_a": ("n = int(input())\nprint(sum(map(int, input().split())))\n", "print(0)\n"),
    "fixture-9001": ("class Solution:\n    def countVowels(self, word: str) -> int:\n"
                     "        return sum(c in 'aeiouAEIOU' for c in word)\n",
                     "class Solution:\n    def countVowels(self, word: str) -> int:\n        return len(word)\n"),
    "fixture_cf_1A": ("import math\nprint(math.factorial(int(input())))\n", "print(1)\n"),
}


# ---------------------------------------------------------------- a stand-in for recipe.sandbox


@dataclass
class Report:
    passed: int
    total: int
    results: list = field(default_factory=list)
    sandbox_error: str | None = None

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _fake_run_tests(code: str, tests: list[dict], limits=None, broken: bool = False) -> Report:
    """recipe.sandbox's interface, run in-process (fixture programs only: trusted, tiny)."""
    if broken:
        return Report(0, len(tests), [], sandbox_error="worker crashed")
    results = []
    for t in tests:
        out, ns = io.StringIO(), {"__name__": "__main__"}
        saved = sys.stdin
        try:
            sys.stdin = io.StringIO(t.get("input", ""))
            with contextlib.redirect_stdout(out):
                exec(code, ns)
                ok = ns[t["fn"]](*t["args"]) == t["expected"] if "fn" in t else None
        except Exception:
            ok = False
        finally:
            sys.stdin = saved
        if ok is None:
            ok = out.getvalue().split() == t["output"].split()
        results.append(ok)
    return Report(sum(results), len(tests), results)


@pytest.fixture
def sandbox(monkeypatch):
    """Installs the fake as the code environment's sandbox; .broken = True makes every call a sandbox failure."""
    mod = types.ModuleType("fake_sandbox")
    mod.broken = False
    mod.calls = []

    def run_tests(code, tests, limits=None):
        mod.calls.append(code)
        return _fake_run_tests(code, tests, limits, broken=mod.broken)

    mod.run_tests = run_tests
    import recipe.envs.code

    monkeypatch.setattr(recipe.envs.code, "run_tests", run_tests)
    monkeypatch.setattr(recipe.envs.code, "_VERDICTS", {})  # verdicts of the real sandbox must not leak in
    return mod


def fixture_rows(name: str, **changes) -> list[dict]:
    return B.load_benchmark(dataclasses.replace(B.REGISTRY[name], **changes), offline_fixture=True)


def completions(row: dict) -> tuple[str, str]:
    """(a right, a wrong) completion for a schema row."""
    if row["env"] == "code":
        good, bad = PROGRAMS[json.loads(row["info"])["source"]["id"]]
        return f"{THINK}```python\n{good}```", f"{THINK}```python\n{bad}```"
    if row["env"] == "science":
        letters = json.loads(row["info"])["letters"]
        wrong = letters[(letters.index(row["answer"]) + 1) % len(letters)]
        return f"{THINK}Answer: {row['answer']}", f"{THINK}Answer: {wrong}"
    return f"{THINK}\\boxed{{{row['answer']}}}", f"{THINK}\\boxed{{123457}}"


# ---------------------------------------------------------------- registry


def test_registry_pins_every_dataset_and_follows_the_release_protocol():
    from recipe.eval.benchmarks import PAPER_ORDER as PAPER_COLUMNS

    assert set(NAMES) == set(RELEASE_K) == set(B.PAPER_ORDER) and PAPER_COLUMNS == B.PAPER_ORDER
    for name, spec in B.REGISTRY.items():
        assert len(spec.revision) == 40 and all(c in "0123456789abcdef" for c in spec.revision), name
        assert spec.samples == RELEASE_K[name] and max(spec.pass_k) <= spec.samples
        assert spec.env in ENVIRONMENTS and (B.FIXTURES / f"{name}.jsonl").exists()
    assert B.REGISTRY["gpqa_diamond"].config_name == "gpqa_diamond"
    assert B.REGISTRY["lcb_v6"].all_tests_must_pass and B.REGISTRY["lcb_v6"].data_files[-1] == "test6.jsonl"


def test_intellect3_eval_config_lists_every_benchmark_with_the_release_k_and_sampling():
    """full-eval.toml sets k and max_tokens 81920, nothing else: temperature, top_p and top_k come from the
    model's generation_config.json, or vLLM's neutral values when it sets none."""
    ev = load_config(["preset=intellect3"]).eval
    assert [b.name for b in ev.benchmarks] == ["math500", "aime24", "aime25", "lcb_v6", "gpqa_diamond", "hle",
                                               "mmlu_pro"]
    generation = {"temperature": 0.6, "top_p": 0.95}
    specs = {b.name: B.resolve(b, ev, generation) for b in ev.benchmarks}
    assert {n: s.samples for n, s in specs.items()} == RELEASE_K
    for s in specs.values():
        assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.6, 0.95, -1, 81920)
        assert s.protocol()["temperature_source"] == s.protocol()["top_p_source"] == "generation_config.json"
        assert s.protocol()["top_k_source"] == "default" and s.protocol()["max_new_tokens_source"] == "config"
    assert specs["lcb_v6"].contest_dates == ("2024-08-01", "2025-05-01")
    neutral = B.resolve(ev.benchmarks[0], ev, {})
    assert (neutral.temperature, neutral.top_p) == (1.0, 1.0) and dict(neutral.sources)["temperature"] == "default"
    assert (ev.temperature, ev.top_p, ev.top_k, ev.max_new_tokens) == (None, None, None, 81920)  # held-out alike
    assert load_config(["preset=tiny"]).eval.benchmarks == []  # the tiny preset keeps its held-out suite only


def test_resolve_takes_config_then_registry_then_eval_defaults():
    ev = EvalConfig(temperature=0.7, top_p=0.9, max_new_tokens=64, benchmark_max_problems=3)
    spec = B.resolve(BenchmarkConfig(name="aime24", samples=4, top_p=0.5), ev)
    assert (spec.samples, spec.pass_k, spec.temperature, spec.top_p, spec.max_new_tokens, spec.max_problems) == \
        (4, (1,), 0.7, 0.5, 64, 3)
    assert B.resolve(BenchmarkConfig(name="aime24"), ev).pass_k == (1, 8, 32, 64)


# ---------------------------------------------------------------- fixtures through the converters


@pytest.mark.parametrize("name", NAMES)
def test_fixture_rows_convert_to_schema_rows_and_score(name, tmp_path, sandbox):
    rows = fixture_rows(name)
    assert rows and read_rows(tmp_path / "r.parquet", write_rows(rows, tmp_path / "r.parquet")) == rows
    assert len({r["id"] for r in rows}) == len(rows) and all(r["id"].startswith(f"{name}/") for r in rows)
    spec = B.REGISTRY[name]
    prompts = {spec.prompt(raw) for raw in B.fixture_rows(spec)}  # the row's prompt is the spec's builder's
    assert all(r["prompt"][0]["content"] in prompts for r in rows)
    for row in rows:
        assert row["split"] == "eval" and [m["role"] for m in row["prompt"]] == ["user"]
        info = json.loads(row["info"])
        assert info["benchmark"] == name and info["source"]["revision"] == B.REGISTRY[name].revision
        good, bad = completions(row)
        env = get_env(row["env"])
        right, wrong = env.score(good, row), env.score(bad, row)
        assert (right.reward, wrong.reward) == (1.0, 0.0), (row["id"], right, wrong)
        assert not right.errors and not wrong.errors and not right.masked


def test_math_fields_map_to_the_schema():
    rows = fixture_rows("math500")
    assert (rows[0]["answer"], rows[0]["task"], rows[0]["difficulty"]) == ("\\frac{5}{6}", "Prealgebra", 2.0)
    assert rows[0]["id"] == "math500/test/prealgebra/fixture-1.json"
    assert rows[0]["prompt"][0]["content"].endswith("Express your answer as a common fraction.")
    assert "\\boxed{}" in rows[0]["prompt"][0]["content"]
    aime = fixture_rows("aime24")
    assert (aime[0]["id"], aime[0]["answer"], aime[0]["env"]) == ("aime24/60", "24", "math")
    assert [r["id"] for r in fixture_rows("aime25")] == ["aime25/0", "aime25/1"]


def test_gpqa_options_are_shuffled_per_problem_and_the_gold_letter_recorded():
    raws = B.fixture_rows(B.REGISTRY["gpqa_diamond"])
    rows = fixture_rows("gpqa_diamond")
    assert rows == fixture_rows("gpqa_diamond")  # deterministic
    for raw, row in zip(raws, rows):
        info = json.loads(row["info"])
        assert info["letters"] == "ABCD" and sorted(info["choices"]) == sorted(
            [raw["Correct Answer"]] + [raw[f"Incorrect Answer {i}"] for i in (1, 2, 3)])
        assert info["choices"]["ABCD".index(row["answer"])] == raw["Correct Answer"]
        assert f"\n{row['answer']}) {raw['Correct Answer']}" in row["prompt"][0]["content"]
        assert row["task"] == raw["High-level domain"] and row["id"] == f"gpqa_diamond/{raw['Record ID']}"
    assert len({r["answer"] for r in rows}) > 1  # the correct answer is not always first


def test_mmlu_pro_keeps_up_to_ten_options_and_checks_the_answer_index(monkeypatch):
    rows = fixture_rows("mmlu_pro")
    assert [json.loads(r["info"])["letters"] for r in rows] == ["ABCDEFGHIJ", "ABCD", "ABCDEFG"]
    assert [r["answer"] for r in rows] == ["C", "D", "C"] and rows[0]["task"] == "physics"
    assert "\nJ) Watt" in rows[0]["prompt"][0]["content"]
    bad = dict(B.fixture_rows(B.REGISTRY["mmlu_pro"])[0], answer_index=5)
    monkeypatch.setattr(B, "fixture_rows", lambda spec: [bad])
    with pytest.raises(B.BenchmarkError, match=r"MMLU-Pro \(mmlu_pro\): row 0 .*disagree"):
        B.load_benchmark(B.REGISTRY["mmlu_pro"], offline_fixture=True)


def test_a_missing_field_names_the_benchmark_row_and_field(monkeypatch):
    raw = B.fixture_rows(B.REGISTRY["aime24"])[0]
    del raw["problem"]
    monkeypatch.setattr(B, "fixture_rows", lambda spec: [raw])
    with pytest.raises(B.BenchmarkError, match=r"AIME24 \(aime24\): row 0 of HuggingFaceH4/aime_2024: "
                                              r"missing field 'problem'"):
        B.load_benchmark(B.REGISTRY["aime24"], offline_fixture=True)


def test_hle_keeps_text_only_rows_and_routes_answer_types():
    rows = fixture_rows("hle")
    assert len(B.fixture_rows(B.REGISTRY["hle"])) == 3 and len(rows) == 2  # the image question is left out
    assert [(r["env"], r["answer"]) for r in rows] == [("exact", "101"), ("science", "B")]
    assert "Answer Choices:" in rows[1]["prompt"][0]["content"]


def test_livecodebench_window_tests_and_prompt():
    rows = fixture_rows("lcb_v6")
    assert [r["id"] for r in rows] == ["lcb_v6/fixture_abc001_a", "lcb_v6/fixture-9001"]  # 2023 row outside
    assert len(fixture_rows("lcb_v6", contest_dates=None)) == 3
    assert len(fixture_rows("lcb_v6", contest_dates=("2025-01-18", "2025-01-18"))) == 1  # both ends included
    stdin, functional = rows
    assert row_tests(stdin) == [{"input": "3\n1 2 3\n", "output": "6\n"}, {"input": "1\n-5\n", "output": "-5\n"},
                                {"input": "4\n10 20 30 40\n", "output": "100\n"}]
    assert row_tests(functional) == [{"fn": "countVowels", "args": ["banana"], "expected": 3},
                                     {"fn": "countVowels", "args": ["sky"], "expected": 0},
                                     {"fn": "countVowels", "args": ["AEIOUaeiou"], "expected": 10}]
    info = json.loads(functional["info"])
    assert info["all_tests_must_pass"] and info["fn_name"] == "countVowels" and functional["task"] == "medium"
    assert "def countVowels(self, word: str) -> int:" in functional["prompt"][0]["content"]
    assert "stdin" in stdin["prompt"][0]["content"] and stdin["difficulty"] == 1.0


def test_private_tests_are_decoded_without_unpickling():
    cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    for blob in (pickle.dumps(json.dumps(cases), protocol=p) for p in (2, 4, 5)):
        assert B.decode_lcb_tests(base64.b64encode(zlib.compress(blob)).decode()) == cases
    assert B.decode_lcb_tests(base64.b64encode(zlib.compress(json.dumps(cases).encode())).decode()) == cases
    assert B.decode_lcb_tests(json.dumps(cases)) == cases

    class Exploit:
        def __reduce__(self):
            return (print, ("executed",))

    evil = base64.b64encode(zlib.compress(pickle.dumps(Exploit()))).decode()
    with pytest.raises(ValueError, match="opcode .* refused"):
        B.decode_lcb_tests(evil)


# ---------------------------------------------------------------- scorers


@pytest.mark.parametrize("text,letter", [
    ("B", "B"), ("(B)", "B"), ("B.", "B"), ("**B**", "B"), ("Answer: B", "B"), ("answer: (C)", "C"),
    ("**Answer:** D", "D"), ("The answer is (A).", "A"), ("\\boxed{B}", "B"), ("\\boxed{(C)}", "C"),
    ("\\boxed{\\text{D}}", "D"), ("so $\\boxed{A}$", "A"), ("(B) 6 N", "B"), ("C) 2 mol", "C"),
    ("I first thought A. Answer: C", "C"), ("Answer: B\n\\boxed{D}", "D"),
    ("A force of 6 N", None), ("Answer: Because of inertia", None), ("Z", None), ("", None), ("b", None),
])
def test_option_letter_extraction(text, letter):
    assert extract_letter(text, "ABCD") == letter


def test_science_rows_without_options_fall_back_to_math_verify():
    row = {"answer": "6", "info": json.dumps({"task": "physics"})}  # INTELLECT-3-RL science: free-form answers
    env = get_env("science")
    assert env.score(f"{THINK}\\boxed{{6.0}}", row).reward == 1.0
    assert env.score(f"{THINK}\\boxed{{7}}", row).reward == 0.0


def test_exact_match_uses_math_verify_only_for_mathematical_answers():
    env = get_env("exact")
    math_row = {"answer": "\\frac{1}{2}", "info": "{}"}
    assert env.score(f"{THINK}\\boxed{{0.5}}", math_row).reward == 1.0
    words = {"answer": "Albert Einstein", "info": "{}"}
    assert env.score(f"{THINK}\\boxed{{\\text{{albert einstein}}}}.", words).reward == 1.0
    assert env.score(f"{THINK}Answer: Albert Einstein.", words).reward == 1.0
    assert env.score(f"{THINK}\\boxed{{Einstein Albert}}", words).reward == 0.0  # a*b == b*a for math-verify


def test_code_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\nthen\n```\nuntagged\n```\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("no code") is None


def test_code_reward_all_tests_or_nothing_and_the_solution_alias(sandbox):
    row = fixture_rows("lcb_v6")[1]
    half = ("class Solution:\n    def countVowels(self, word: str) -> int:\n"
            "        return sum(c in 'aeiou' for c in word)\n")  # misses upper case: passes 2 of 3
    env = get_env("code")
    assert env.score(f"{THINK}```python\n{half}```", row).reward == 0.0  # LCB: all tests or nothing
    fraction_row = dict(row, info=json.dumps(dict(json.loads(row["info"]), all_tests_must_pass=False)))
    # a row that does not ask for every test: the share passed (eval's partial credit), or nothing without it
    assert env.score(f"{THINK}```python\n{half}```", fraction_row).reward == pytest.approx(2 / 3)
    assert get_env("code", partial_credit=False).score(f"{THINK}```python\n{half}```", fraction_row).reward == 0.0
    assert "def countVowels(*args):" in sandbox.calls[-1] and sandbox.calls[-1].startswith("from typing import *")
    assert env.score(f"{THINK}no program", row).reward == 0.0


def test_intellect3_rl_code_rows_convert_their_tests():
    info = {"entry": {"tests": json.dumps({"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]})}}
    assert row_tests({"info": json.dumps(info)}) == [{"fn": "f", "args": [1, 2], "expected": 3}]
    info = {"entry": {"tests": {"fn_name": None, "inputs": ["5\n"], "outputs": ["120\n"]}}}
    assert row_tests({"info": json.dumps(info)}) == [{"input": "5\n", "output": "120\n"}]


def test_a_sandbox_failure_masks_the_sample(sandbox):
    row = fixture_rows("lcb_v6")[0]
    good, _ = completions(row)
    sandbox.broken = True
    res = get_env("code").score(good, row)
    assert res.masked and res.reward == 0.0 and "worker crashed" in res.mask_reason and not res.errors


def test_the_real_sandbox_scores_the_fixture_programs():
    for row in fixture_rows("lcb_v6"):
        good, bad = completions(row)
        assert get_env("code").score(good, row).reward == 1.0, row["id"]
        assert get_env("code").score(bad, row).reward == 0.0, row["id"]


# ---------------------------------------------------------------- the hub


def test_unreachable_hub_fails_at_once_naming_benchmark_dataset_and_revision(monkeypatch):
    import datasets
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # closed port
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset called"))
    spec = B.REGISTRY["gpqa_diamond"]
    start = time.monotonic()
    with pytest.raises(B.BenchmarkError) as err:
        B.load_benchmark(spec, timeout=2.0)
    msg = str(err.value)
    assert time.monotonic() - start < 3 and "\n" not in msg
    for needle in ("GPQA (gpqa_diamond)", f"Idavidrein/gpqa@{spec.revision}", "unreachable", "HF_HUB_OFFLINE=1",
                   "python -m recipe.eval.benchmarks"):
        assert needle in msg, msg


@pytest.mark.parametrize("name", ["aime25", "lcb_v6"])
def test_offline_without_cache_fails_at_once(name, monkeypatch, tmp_path):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = B.REGISTRY[name]
    start = time.monotonic()
    with pytest.raises(B.BenchmarkError) as err:
        B.load_benchmark(spec, cache_dir=str(tmp_path / "cache"))
    msg = str(err.value)
    assert time.monotonic() - start < 10 and "\n" not in msg
    assert f"{spec.hub_id}@{spec.revision}" in msg and "offline mode" in msg and f"({name})" in msg


def test_reachable_hub_loads_at_the_pinned_revision_with_a_problem_cap(monkeypatch):
    import datasets

    from recipe import hub

    calls = []

    def fake_load(path, name, split, revision, cache_dir=None, streaming=False):
        calls.append((path, name, split, revision, streaming))
        return iter(B.fixture_rows(B.REGISTRY["gpqa_diamond"]))

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "ensure_reachable", lambda refs, timeout, error=None: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    spec = dataclasses.replace(B.REGISTRY["gpqa_diamond"], max_problems=2)
    rows = B.load_benchmark(spec)
    assert len(rows) == 2 and rows == fixture_rows("gpqa_diamond")[:2]
    assert calls == [("Idavidrein/gpqa", "gpqa_diamond", "train", spec.revision, True)]


# ---------------------------------------------------------------- end to end on a scripted engine


class ScriptedBenchEngine:
    """Sample s of the i-th problem is right iff s < correct(i); fails after `fail_after` calls (a kill)."""

    def __init__(self, rows, k, correct, fail_after=None):
        tok = CharTokenizer()
        self.by_prompt = {tuple(encode_prompt(tok, r["prompt"])): (i, r) for i, r in enumerate(rows)}
        self.k, self.correct, self.fail_after, self.calls = k, correct, fail_after, 0
        self.tokenizer = tok

    def generate(self, prompts, params):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt
        seen: dict[tuple, int] = {}
        out = []
        for p in prompts:
            i, row = self.by_prompt[tuple(p)]
            s = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            text = completions(row)[0 if s < self.correct(i) else 1]
            out.append(Completion([ord(c) for c in text], [0.0] * len(text), "stop", 0))
        return out


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_end_to_end_through_the_runner(name, tmp_path, sandbox):
    spec = dataclasses.replace(B.REGISTRY[name], samples=min(B.REGISTRY[name].samples, 4), pass_k=(1,),
                               temperature=1.0, top_p=1.0, max_new_tokens=32)
    rows = fixture_rows(name)
    k = spec.samples
    engine = ScriptedBenchEngine(rows, k, correct=lambda i: i % (k + 1))
    res = B.run_benchmark(engine, engine.tokenizer, spec, rows, tmp_path, batch_size=8, seed=0)
    expected = sum(min(i % (k + 1), k) / k for i in range(len(rows))) / len(rows)
    assert res["benchmark"]["problems"] == len(rows)
    assert res["benchmark"][f"avg@{k}"] == pytest.approx(expected)
    assert res["name"] == name and res["protocol"]["revision"] == spec.revision
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == k * len(rows)
    assert all({"completion", "score", "reason", "masked"} <= set(ln) for ln in lines)
    assert {ln["reason"] for ln in lines} <= {"correct", "wrong answer"}


def test_a_killed_benchmark_resumes_from_its_finished_problems(tmp_path):
    spec = dataclasses.replace(B.REGISTRY["gpqa_diamond"], samples=4, pass_k=(1, 4), temperature=1.0, top_p=1.0,
                               max_new_tokens=32)
    rows = fixture_rows("gpqa_diamond")
    correct = lambda i: i + 1  # noqa: E731
    with pytest.raises(KeyboardInterrupt):  # batch 4 = one problem (k=4) a call; killed in the second
        B.run_benchmark(ScriptedBenchEngine(rows, 4, correct, fail_after=1), CharTokenizer(), spec, rows, tmp_path,
                        4, 0)
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"id": "gpqa_diamond/recFixture0000002", "cut by the')
    resumed = ScriptedBenchEngine(rows, 4, correct)
    res = B.run_benchmark(resumed, resumed.tokenizer, spec, rows, tmp_path, 4, 0)
    assert resumed.calls == 2  # the two problems not finished before the kill
    fresh = ScriptedBenchEngine(rows, 4, correct)
    full = B.run_benchmark(fresh, fresh.tokenizer, spec, rows, tmp_path / "fresh", 4, 0)
    assert res["benchmark"] == full["benchmark"] and res["benchmark"]["avg@4"] == pytest.approx((1 + 2 + 3) / 12)


def test_masked_problems_are_left_out_then_retried(tmp_path, sandbox):
    spec = dataclasses.replace(B.REGISTRY["lcb_v6"], temperature=1.0, top_p=1.0, max_new_tokens=32)
    rows = fixture_rows("lcb_v6")
    sandbox.broken = True
    engine = ScriptedBenchEngine(rows, 2, correct=lambda i: 2)
    res = B.run_benchmark(engine, engine.tokenizer, spec, rows, tmp_path, 8, 0)
    assert res["masked_problems"] == 2 and res["benchmark"] == {"problems": 0}
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(ln["masked"] and ln["reason"].startswith("masked: ") for ln in lines)
    sandbox.broken = False
    again = ScriptedBenchEngine(rows, 2, correct=lambda i: 2)
    res = B.run_benchmark(again, again.tokenizer, spec, rows, tmp_path, 8, 0)
    assert again.calls == 1 and "masked_problems" not in res and res["benchmark"]["avg@2"] == 1.0


def test_make_eval_runs_the_configured_benchmarks_and_reports_them(tmp_path, monkeypatch, capsys):
    import recipe.eval.__main__ as ev

    made = []

    def engine_for(cfg, path, out):
        rows = [r for n in ("gpqa_diamond", "hle") for r in fixture_rows(n)]
        made.append(ScriptedBenchEngine(rows, 8, correct=lambda i: 8))
        return made[-1]

    load = B.load_benchmark
    located = []  # the base checkpoint is the hub model: its snapshot at the pinned revision, in the HF cache
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    (snapshot / "model.safetensors").write_bytes(b"")  # what the offline check of the weights looks for

    def locate(model, timeout):
        located.append((model.hub_id, model.revision))
        return dataclasses.replace(model, path=snapshot)

    monkeypatch.setattr(ev.eval_models, "locate", locate)
    monkeypatch.setattr(ev, "make_eval_engine", engine_for)
    monkeypatch.setattr(ev, "load_benchmark", lambda spec, **kw: load(spec, offline_fixture=True))
    args = [f"run_root={tmp_path / 'runs'}", "preset=intellect3", "eval.checkpoints=[base]", "eval.held_out=false",
            "eval.benchmarks=[{name:gpqa_diamond},{name:hle,samples:2}]"]
    ev.main(args)
    out = tmp_path / "runs" / "intellect3" / "eval" / "base"
    gpqa = json.loads((out / "gpqa_diamond" / "results.json").read_text())
    assert gpqa["benchmark"]["avg@8"] == 1.0 and gpqa["protocol"]["samples"] == 8 and gpqa["checkpoint"] == "base"
    assert located[0] == ("zai-org/GLM-4.5-Air-Base", load_config(["preset=intellect3"]).model.revision)
    model = gpqa["provenance"]["model"]
    assert model["kind"] == "hub" and model["stage"] == "base"
    assert gpqa["model_sha"] == f"zai-org/GLM-4.5-Air-Base@{located[0][1]}"  # a hub model's key: id@commit, as before
    proto = gpqa["protocol"]
    assert (proto["temperature"], proto["temperature_source"]) == (0.6, "generation_config.json")
    assert (proto["top_p"], proto["top_p_source"], proto["top_k"], proto["top_k_source"]) == (1.0, "default", -1,
                                                                                            "default")
    assert (proto["max_new_tokens"], proto["max_new_tokens_source"]) == (81920, "config")
    assert json.loads((out / "hle" / "results.json").read_text())["benchmark"]["avg@2"] == 1.0
    report = (tmp_path / "runs" / "RESULTS.md").read_text()
    assert "| INTELLECT-3 (paper) | 98.1 | 90.8 | 88.0 | 69.3 | 74.4 | 14.6 | 81.9 |" in report
    assert "| protocol (release evals) | avg@4 | avg@64 | avg@64 | avg@2 | avg@8 | avg@1 | avg@1 |" in report
    assert ("| this recipe: `intellect3` base | not run | not run | not run | not run | 100.0 ± 0.0 (n=3) | "
            "100.0 ± 0.0 (avg@2, n=2) | not run |") in report
    assert "| this recipe: `intellect3` rl | not run |" in report
    ev.main(args)  # finished: nothing is regenerated, no engine is started
    assert len(made) == 1 and "already evaluated" in capsys.readouterr().out




# ---------------------------------------------------------------- sampling settings and their sources


def test_a_model_folders_generation_config_sets_what_the_config_leaves_null(tmp_path):
    from recipe.eval import sampling

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 2], "temperature": 0.6, "top_p": 0.95, "top_k": 40, "do_sample": True}))
    generation = sampling.read_generation_config(tmp_path)
    assert generation == {"temperature": 0.6, "top_p": 0.95, "top_k": 40}
    ev = EvalConfig(temperature=None, top_p=None, top_k=None, max_new_tokens=None)
    spec = B.resolve(BenchmarkConfig(name="aime24"), ev, generation)
    proto = spec.protocol()
    assert (proto["temperature"], proto["temperature_source"]) == (0.6, "generation_config.json")
    assert (proto["top_p"], proto["top_p_source"]) == (0.95, "generation_config.json")
    assert (proto["top_k"], proto["top_k_source"]) == (40, "generation_config.json")
    assert (proto["max_new_tokens"], proto["max_new_tokens_source"]) == (None, "context")
    # explicit values win, the benchmark's entry over eval's
    spec = B.resolve(BenchmarkConfig(name="aime24", temperature=1.0, max_new_tokens=64),
                     EvalConfig(temperature=0.3, top_p=None, top_k=-1, max_new_tokens=None), generation)
    proto = spec.protocol()
    assert (proto["temperature"], proto["temperature_source"]) == (1.0, "config")
    assert (proto["top_p"], proto["top_p_source"]) == (0.95, "generation_config.json")
    assert (proto["top_k"], proto["top_k_source"]) == (-1, "config")
    assert (proto["max_new_tokens"], proto["max_new_tokens_source"]) == (64, "config")
    # a folder without the file: vLLM's neutral values
    (tmp_path / "generation_config.json").unlink()
    assert sampling.read_generation_config(tmp_path) == {}
    neutral = sampling.resolve([("config", ev)], {})
    assert {k: neutral[k] for k in sampling.KEYS} == {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                       "max_new_tokens": None}


def test_max_new_tokens_not_from_the_config_is_bounded_by_the_context():
    from recipe.eval import sampling

    unset = sampling.resolve([("config", EvalConfig(max_new_tokens=None))], {})
    assert sampling.fit_max_new_tokens(unset, 100, 1000) == {**unset, "max_new_tokens": 900,
                                                             "max_new_tokens_source": "context"}
    big = sampling.resolve([("config", EvalConfig(max_new_tokens=None))], {"max_new_tokens": 5000})
    assert sampling.fit_max_new_tokens(big, 100, 1000)["max_new_tokens"] == 900
    assert sampling.fit_max_new_tokens(big, 100, 1000)["max_new_tokens_source"] == \
        "generation_config.json, bounded by the context"
    small = sampling.resolve([("config", EvalConfig(max_new_tokens=None))], {"max_new_tokens": 50})
    assert sampling.fit_max_new_tokens(small, 100, 1000) == small
    configured = sampling.resolve([("config", EvalConfig(max_new_tokens=5000))], {"max_new_tokens": 50})
    assert sampling.fit_max_new_tokens(configured, 100, 1000) == configured  # the config's stands (skips)
    with pytest.raises(Exception, match="set eval.max_new_tokens"):
        sampling.fit_max_new_tokens(unset, 100, None)


def test_run_benchmark_samples_with_the_resolved_settings_and_fits_max_tokens_to_the_context(tmp_path):
    rows = fixture_rows("gpqa_diamond")

    class Recording(ScriptedBenchEngine):
        context = 2000

        def generate(self, prompts, params):
            self.params = params
            return super().generate(prompts, params)

    engine = Recording(rows, 2, correct=lambda i: 2)
    ev = EvalConfig(temperature=None, top_p=None, top_k=None, max_new_tokens=None)
    spec = B.resolve(BenchmarkConfig(name="gpqa_diamond", samples=2, pass_k=[1]), ev,
                     {"temperature": 0.6, "top_p": 0.95})
    res = B.run_benchmark(engine, engine.tokenizer, spec, rows, tmp_path, batch_size=8, seed=0)
    longest = max(len(encode_prompt(engine.tokenizer, r["prompt"])) for r in rows)
    p = engine.params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.6, 0.95, -1, 2000 - longest)
    proto = res["protocol"]
    assert (proto["max_new_tokens"], proto["max_new_tokens_source"]) == (2000 - longest, "context")
    assert proto["temperature_source"] == "generation_config.json" and "skipped_too_long" not in res


def test_the_eval_servers_take_the_models_generation_config_and_rl_servers_do_not():
    from recipe.inference.vllm.server import server_command

    cfg = load_config(["preset=tiny"])
    rl = server_command("/m", cfg)
    ev = server_command("/m", cfg, generation_config="auto")
    assert rl[rl.index("--generation-config") + 1] == "vllm" and ev[ev.index("--generation-config") + 1] == "auto"
    with pytest.raises(ValueError):
        server_command("/m", cfg, generation_config="model")
