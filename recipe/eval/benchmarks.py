"""The paper's benchmarks (docs/recipe.md, "Evaluation"): dataset, pinned revision, prompt, scorer and
protocol of each, and converters from each dataset's own rows to the project's row schema.

Scorers are environments (recipe/envs): `math` (math-verify) for MATH-500 and AIME, `science` (the option
letter) for GPQA, MMLU-Pro and HLE's multiple-choice rows, `exact` for HLE's exact-match rows, `code` (the
sandbox's tests, all of them must pass) for LiveCodeBench. Samples per problem follow the release evals,
prime-rl `configs/int3/eval/full-eval.toml` (PR 1272, 62a9a16; docs/recipe.md, "Evaluation"): MATH-500 avg@4,
AIME avg@64, GPQA avg@8, LiveCodeBench avg@2, HLE and MMLU-Pro avg@1. Sampling settings and their sources:
recipe/eval/sampling.py.

validate_benchmarks checks eval.benchmarks against this registry; the eval and plan stages call it.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import pickletools
import random
import string
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import date
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from huggingface_hub import hf_hub_download

from recipe import hub
from recipe.chat import encode_prompt
from recipe.config import EvalConfig
from recipe.data.schema import message
from recipe.envs.math import INSTRUCTION as MATH_INSTRUCTION
from recipe.errors import ConfigError, HubError, StageError
from recipe.eval import sampling
from recipe.eval.metrics import summarize
from recipe.eval.runner import evaluate, model_context, problem_records

FIXTURES = Path(__file__).resolve().parent.parent.parent / "data" / "fixtures" / "benchmarks"
SPLIT = "eval"  # the schema's split of every benchmark row

MC_INSTRUCTION = ("Answer the following multiple choice question (options {letters}). Think step by step, then "
                  "give the letter of the correct option in \\boxed{{}}, for example \\boxed{{A}}.")
HLE_EXACT = "Think step by step, then give your final answer in \\boxed{}."
HLE_CHOICE = "Think step by step, then give the letter of the correct answer choice in \\boxed{}."
LCB_HEAD = ("You will be given a programming problem. Write a correct and efficient Python 3 program that "
            "matches the specification and passes all tests.\n\n### Question:\n")
LCB_STARTER = ("### Format: You will use the following starter code to write the solution to the problem and "
               "enclose your code within delimiters.\n```python\n{starter}\n```\n\n")
LCB_STDIN = ("### Format: Read the inputs from stdin, solve the problem and write the answer to stdout (do not "
             "directly test on the sample inputs). Enclose your code within delimiters as follows.\n```python\n"
             "# YOUR CODE HERE\n```\n\n")
LCB_TAIL = "### Answer: (use the provided format with backticks)\n"


class BenchmarkError(StageError):  # a stage error: the CLI prints one line, no traceback
    pass


@dataclass(frozen=True)
class Benchmark:
    name: str  # registry key, used in configs and run folders
    title: str  # as in the paper's table
    hub_id: str
    config_name: Optional[str]
    split: str
    revision: str  # full commit id
    env: str  # the scoring environment of most rows (HLE mixes science and exact)
    samples: int  # k of avg@k, as the paper
    prompt: Callable  # raw hub row -> the user message's text
    convert: Callable  # (raw hub row, index, spec) -> schema row (its prompt from `prompt`), or None to leave it out
    pass_k: tuple = (1,)
    expected_problems: Optional[int] = None  # the paper's count, checked after loading (a warning)
    data_files: tuple = ()  # read these files of the repository instead of datasets' builder (LCB)
    all_tests_must_pass: bool = False  # code: a sample counts as correct only when every test passes
    contest_dates: Optional[tuple] = None  # (from, to) YYYY-MM-DD, both included; rows outside are left out
    # sampling; None = the eval config's, else the model's generation_config.json (recipe.eval.sampling)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: Optional[int] = None
    max_problems: Optional[int] = None
    sources: tuple = ()  # (setting, where its value comes from) of each sampling setting, once resolved

    def protocol(self) -> dict:
        """What a results.json records about how the benchmark was run: every sampling setting beside its
        source (`temperature` and `temperature_source`, ...)."""
        keys = ["hub_id", "config_name", "split", "revision", "env", "samples", "pass_k", "expected_problems",
                "all_tests_must_pass", "contest_dates", "temperature", "top_p", "max_new_tokens", "max_problems"]
        out = {k: (list(v) if isinstance(v, tuple) else v) for k in keys for v in [getattr(self, k)]}
        if self.sources:  # a spec built without resolve() records what it always did
            out.update({"top_k": self.top_k, **{f"{k}_source": s for k, s in self.sources}})
        return out


# ---------------------------------------------------------------- helpers


def _row(spec: Benchmark, index: int, source_id, env: str, task: str, text: str, answer: str,
         difficulty: float = 0.0, **info) -> dict:
    source = {"dataset": spec.hub_id, "config": spec.config_name, "split": spec.split, "revision": spec.revision,
              "index": index, "id": source_id}
    return {
        "id": f"{spec.name}/{source_id}", "env": env, "task": str(task or spec.name), "split": SPLIT,
        "prompt": [message("user", text)], "completion": [], "answer": str(answer).strip(),
        "info": json.dumps({"benchmark": spec.name, "source": source, **info}, sort_keys=True, ensure_ascii=False),
        "difficulty": float(difficulty), "tools": "[]",
    }


def mc_prompt(question: str, choices: list[str]) -> str:
    letters = string.ascii_uppercase[:len(choices)]
    options = "\n".join(f"{letter}) {choice}" for letter, choice in zip(letters, choices))
    return f"{MC_INSTRUCTION.format(letters=', '.join(letters))}\n\n{question.strip()}\n\n{options}"


def math_prompt(problem: str) -> str:
    return f"{MATH_INSTRUCTION}\n{problem}"  # INTELLECT-3's math environment instruction


def shuffled_choices(correct: str, incorrect: list[str], key: str) -> tuple[list[str], int]:
    """GPQA lists the correct answer first: shuffle, seeded by the problem's id, so every run (and every
    sample) sees the same order. Returns (choices, index of the correct one)."""
    rng = random.Random(int(hashlib.sha256(key.encode()).hexdigest()[:16], 16))
    choices = [correct, *incorrect]
    order = list(range(len(choices)))
    rng.shuffle(order)
    return [choices[i] for i in order], order.index(0)


def gpqa_choices(raw: dict) -> tuple[list[str], int]:
    incorrect = [raw[f"Incorrect Answer {i}"].strip() for i in (1, 2, 3)]
    return shuffled_choices(raw["Correct Answer"].strip(), incorrect, raw["Record ID"])


# ---------------------------------------------------------------- prompt builders, one per dataset


def problem_prompt(raw: dict) -> str:  # MATH-500, AIME
    return math_prompt(raw["problem"])


def gpqa_prompt(raw: dict) -> str:
    return mc_prompt(raw["Question"], gpqa_choices(raw)[0])


def mmlu_pro_prompt(raw: dict) -> str:
    return mc_prompt(raw["question"], list(raw["options"]))


def hle_prompt(raw: dict) -> str:  # multiple-choice questions carry their choices in the text
    return f"{raw['question']}\n\n{HLE_CHOICE if raw['answer_type'] == 'multipleChoice' else HLE_EXACT}"


def lcb_prompt(raw: dict) -> str:
    starter = (raw.get("starter_code") or "").strip("\n")
    fmt = LCB_STARTER.format(starter=starter) if starter.strip() else LCB_STDIN
    return f"{LCB_HEAD}{raw['question_content'].strip()}\n\n{fmt}{LCB_TAIL}"


# ---------------------------------------------------------------- converters, one per dataset


def math500_row(raw: dict, index: int, spec: Benchmark) -> dict:
    return _row(spec, index, raw["unique_id"], "math", raw.get("subject"), spec.prompt(raw), raw["answer"],
                difficulty=float(raw.get("level") or 0), subject=raw.get("subject"), level=raw.get("level"))


def aime_row(raw: dict, index: int, spec: Benchmark) -> dict:
    return _row(spec, index, raw["id"], "math", spec.name, spec.prompt(raw), raw["answer"])


def gpqa_row(raw: dict, index: int, spec: Benchmark) -> dict:
    choices, gold = gpqa_choices(raw)
    letters = string.ascii_uppercase[:len(choices)]
    return _row(spec, index, raw["Record ID"], "science", raw.get("High-level domain"), spec.prompt(raw),
                letters[gold], letters=letters, choices=choices, subdomain=raw.get("Subdomain"))


def mmlu_pro_row(raw: dict, index: int, spec: Benchmark) -> dict:
    options = list(raw["options"])
    letters = string.ascii_uppercase[:len(options)]
    answer, answer_index = str(raw["answer"]).strip(), int(raw["answer_index"])
    if not 0 <= answer_index < len(options) or letters[answer_index] != answer:
        raise ValueError(f"answer {answer!r} and answer_index {answer_index} disagree ({len(options)} options)")
    return _row(spec, index, raw["question_id"], "science", raw.get("category"), spec.prompt(raw), answer,
                letters=letters, choices=options, src=raw.get("src"))


def hle_row(raw: dict, index: int, spec: Benchmark) -> dict | None:
    if raw.get("image"):  # the text-only subset
        return None
    kind = raw["answer_type"]
    if kind == "multipleChoice":  # graded on the letter; how many choices there are is not a field
        return _row(spec, index, raw["id"], "science", raw.get("category"), spec.prompt(raw), raw["answer"],
                    letters=string.ascii_uppercase, answer_type=kind)
    if kind == "exactMatch":
        return _row(spec, index, raw["id"], "exact", raw.get("category"), spec.prompt(raw), raw["answer"],
                    answer_type=kind)
    raise ValueError(f"unknown answer_type {kind!r}")


_PICKLE_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_PICKLE_FRAMING_OPS = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "STOP"}


def pickled_string(blob: bytes) -> str:
    """The one str a pickle holds, read by pickletools.genops, which parses opcodes and executes nothing: a hub
    file is untrusted, and any opcode beyond a string and its framing (imports, calls) is refused."""
    strings = []
    for op, arg, _ in pickletools.genops(blob):
        if op.name in _PICKLE_STRING_OPS:
            strings.append(arg)
        elif op.name not in _PICKLE_FRAMING_OPS:
            raise ValueError(f"pickle opcode {op.name} refused: only a pickled str is accepted")
    if len(strings) != 1:
        raise ValueError(f"expected one pickled str, found {len(strings)}")
    return strings[0]


def decode_lcb_tests(value) -> list[dict]:
    """LiveCodeBench test cases: public ones are a JSON string, private ones base64 of zlib of a pickled JSON
    string (or of the JSON text itself)."""
    if isinstance(value, list):
        return value
    text = (value or "").strip()
    if not text:
        return []
    if text.startswith("["):
        return json.loads(text)
    blob = zlib.decompress(base64.b64decode(text))
    return json.loads(pickled_string(blob) if blob[:1] == b"\x80" else blob.decode("utf-8"))


def lcb_tests(cases: list[dict], fn_name: str | None) -> list[dict]:
    """In the sandbox's format. A functional case's input holds one JSON argument a line."""
    out = []
    for case in cases:
        if case.get("testtype") == "functional":
            if not fn_name:
                raise ValueError("a functional test but no func_name in metadata")
            args = [json.loads(line) for line in case["input"].split("\n") if line.strip()]
            out.append({"fn": fn_name, "args": args, "expected": json.loads(case["output"])})
        else:
            out.append({"input": case["input"], "output": case["output"]})
    return out


def in_window(contest_date, window: tuple | None) -> bool:
    if window is None:
        return True
    day = str(contest_date)[:10]  # "2024-08-03T00:00:00" or a datetime
    return window[0] <= day <= window[1]


def lcb_row(raw: dict, index: int, spec: Benchmark) -> dict | None:
    if not in_window(raw["contest_date"], spec.contest_dates):
        return None
    meta = raw.get("metadata") or "{}"
    meta = json.loads(meta) if isinstance(meta, str) else dict(meta)
    fn_name = meta.get("func_name")
    cases = decode_lcb_tests(raw["public_test_cases"]) + decode_lcb_tests(raw["private_test_cases"])
    level = {"easy": 1.0, "medium": 2.0, "hard": 3.0}.get(str(raw.get("difficulty")).lower(), 0.0)
    return _row(spec, index, raw["question_id"], "code", raw.get("difficulty"), spec.prompt(raw), "", difficulty=level,
                tests=lcb_tests(cases, fn_name), fn_name=fn_name, all_tests_must_pass=spec.all_tests_must_pass,
                prelude=True, platform=raw.get("platform"), contest_date=str(raw["contest_date"]))


# ---------------------------------------------------------------- the registry

_LCB_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")  # release_v6

REGISTRY: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("math500", "MATH-500", "HuggingFaceH4/MATH-500", None, "test",
              revision="6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be", env="math", samples=4,
              prompt=problem_prompt, convert=math500_row, pass_k=(1, 4), expected_problems=500),
    Benchmark("aime24", "AIME24", "HuggingFaceH4/aime_2024", None, "train",
              revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a", env="math", samples=64,
              prompt=problem_prompt, convert=aime_row, pass_k=(1, 8, 32, 64), expected_problems=30),
    Benchmark("aime25", "AIME25", "math-ai/aime25", None, "test",
              revision="563bb8404243c5f09de6ec262f2db674fe5bce9b", env="math", samples=64,
              prompt=problem_prompt, convert=aime_row, pass_k=(1, 8, 32, 64), expected_problems=30),
    Benchmark("lcb_v6", "LCB v6", "livecodebench/code_generation_lite", None, "test",
              revision="0fe84c3912ea0c4d4a78037083943e8f0c4dd505", env="code", samples=2,
              prompt=lcb_prompt, convert=lcb_row, pass_k=(1, 2), expected_problems=454, data_files=_LCB_FILES,
              all_tests_must_pass=True,
              # unverified: the window taken to give 454 problems of release_v6; prime-rl's own count is 541
              # (612fe3a:configs/int3/prod/orch.toml:57), whose window (if any) was not read
              contest_dates=("2024-08-01", "2025-05-01")),
    Benchmark("gpqa_diamond", "GPQA", "Idavidrein/gpqa", "gpqa_diamond", "train",
              revision="633f5ee89ab8ad4522a9f850766b73f62147ffdd", env="science", samples=8,
              prompt=gpqa_prompt, convert=gpqa_row, pass_k=(1, 4, 8), expected_problems=198),
    # text-only subset; HLE grades with an LLM judge, here rules grade (recipe/envs/exact.py): a deviation
    Benchmark("hle", "HLE", "cais/hle", None, "test",
              revision="5a81a4c7271a2a2a312b9a690f0c2fde837e4c29", env="exact", samples=1,
              prompt=hle_prompt, convert=hle_row, expected_problems=2158),
    Benchmark("mmlu_pro", "MMLU-Pro", "TIGER-Lab/MMLU-Pro", None, "test",
              revision="b189ec765aa7ed75c8acfea42df31fdae71f97be", env="science", samples=1,
              prompt=mmlu_pro_prompt, convert=mmlu_pro_row, expected_problems=12032),
]}
PAPER_ORDER = ["math500", "aime24", "aime25", "lcb_v6", "gpqa_diamond", "hle", "mmlu_pro"]  # the paper's columns


def resolve(bench_cfg, eval_cfg, generation: dict | None = None) -> Benchmark:
    """The registry's benchmark with one config entry's settings applied (null keeps the registry's value, or
    for sampling the eval config's, then `generation`: the sampling keys of the model's generation_config.json,
    recipe.eval.sampling.read_generation_config). Each sampling setting's source is kept in `sources`; a
    max_new_tokens set nowhere stays None, for run_benchmark to fit to the context."""
    spec = REGISTRY[bench_cfg.name]

    def pick(*values):
        return next(v for v in values if v is not None)

    samples = pick(bench_cfg.samples, spec.samples)
    pass_k = tuple(bench_cfg.pass_k) if bench_cfg.pass_k else tuple(k for k in spec.pass_k if k <= samples)
    window = spec.contest_dates
    if window is not None:
        window = (pick(bench_cfg.contest_date_from, window[0]), pick(bench_cfg.contest_date_to, window[1]))
    chosen = sampling.resolve([(sampling.CONFIG, bench_cfg), (sampling.REGISTRY, spec), (sampling.CONFIG, eval_cfg)],
                              generation or {})
    return dataclasses.replace(
        spec, samples=samples, pass_k=pass_k or (1,), contest_dates=window,
        **{k: chosen[k] for k in sampling.KEYS},
        sources=tuple((k, chosen[f"{k}_source"]) for k in sampling.KEYS),
        max_problems=pick(bench_cfg.max_problems, eval_cfg.benchmark_max_problems, 0) or None)


def validate_benchmarks(ev) -> None:
    """eval.benchmarks against the registry: known names, each once, pass_k within the samples."""
    seen = set()
    for i, b in enumerate(ev.benchmarks):
        key = f"eval.benchmarks[{i}]"
        if b.name not in REGISTRY:
            raise ConfigError(f"config error: {key}.name={b.name!r} is not a known benchmark "
                              f"(known: {', '.join(REGISTRY)})")
        if b.name in seen:
            raise ConfigError(f"config error: {key}.name={b.name!r} is listed twice")
        seen.add(b.name)
        spec = REGISTRY[b.name]
        # the range of each setting is checked with the rest of the config (recipe.config.RANGES); the
        # registry's samples (the paper's k) are known only here
        samples = b.samples if b.samples is not None else spec.samples
        if b.pass_k is not None and (not b.pass_k or min(b.pass_k) < 1 or max(b.pass_k) > samples):
            raise ConfigError(f"config error: {key}.pass_k={list(b.pass_k)} must lie in 1..samples ({samples})")
        for field_name in ("contest_date_from", "contest_date_to"):
            value = getattr(b, field_name)
            if value is None:
                continue
            if spec.contest_dates is None:
                raise ConfigError(f"config error: {key}.{field_name}: {b.name} rows carry no contest date")
            try:
                date.fromisoformat(value)
            except ValueError:
                raise ConfigError(f"config error: {key}.{field_name}={value!r} is not a YYYY-MM-DD date") from None


# ---------------------------------------------------------------- loading


def _fail(spec: Benchmark, what: str) -> BenchmarkError:
    return BenchmarkError(f"benchmark {spec.title} ({spec.name}): {what}")


def fixture_rows(spec: Benchmark) -> list[dict]:
    path = FIXTURES / f"{spec.name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonl_files(spec: Benchmark, cache_dir) -> Iterator[dict]:
    """Files of the repository at the pinned revision, through the HF cache. LiveCodeBench ships a loading
    script, which datasets no longer runs; its jsonl files are read directly (and no hub code is executed)."""
    for name in spec.data_files:
        path = hf_hub_download(spec.hub_id, name, repo_type="dataset", revision=spec.revision, cache_dir=cache_dir)
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def _hub_rows(spec: Benchmark, cache_dir, streaming: bool) -> Iterator[dict]:
    offline = hub.offline()
    try:
        with hub.libraries_offline() if offline else contextlib.nullcontext():
            if spec.data_files:
                yield from _jsonl_files(spec, cache_dir)
            else:
                import datasets  # here, not at the top: the RL and eval stages import this module (1 s of imports)

                yield from datasets.load_dataset(spec.hub_id, spec.config_name, split=spec.split,
                                                 revision=spec.revision, cache_dir=cache_dir,
                                                 streaming=streaming and not offline)
    except Exception as e:  # datasets and huggingface_hub raise many types (connection, gated, bad revision)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = (f"offline mode is on and it is not in the local cache; {hub.HOWTO}" if offline else
                "check the id, config and revision (a gated dataset such as GPQA or HLE needs its terms accepted "
                "and HF_TOKEN)")
        raise _fail(spec, f"cannot load {spec.hub_id}@{spec.revision}: {type(e).__name__}: {first[:200]}; "
                          f"{hint}") from None


def raw_rows(spec: Benchmark, cache_dir=None, offline_fixture: bool = False, timeout: float = 10.0) -> Iterable[dict]:
    """The dataset's own rows: the shipped fixture, or the hub at the pinned revision (checked first, so a
    machine without network fails in seconds with one line)."""
    if offline_fixture:
        return fixture_rows(spec)
    if len(spec.revision) != 40 or any(c not in string.hexdigits for c in spec.revision):
        raise _fail(spec, f"revision {spec.revision!r} of {spec.hub_id} is not a full commit id")
    try:
        hub.ensure_reachable([hub.Ref("datasets", spec.hub_id, spec.revision)], timeout)
    except HubError as e:
        raise _fail(spec, str(e)) from None
    return _hub_rows(spec, cache_dir, streaming=spec.max_problems is not None)


def load_benchmark(spec: Benchmark, cache_dir=None, offline_fixture: bool = False, timeout: float = 10.0) -> list[dict]:
    """Schema rows of a benchmark (rows its converter leaves out, like HLE's image questions, are skipped),
    at most spec.max_problems of them."""
    def converted():
        for i, raw in enumerate(raw_rows(spec, cache_dir, offline_fixture, timeout)):
            try:
                row = spec.convert(raw, i, spec)
            except (KeyError, TypeError, ValueError, zlib.error) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                raise _fail(spec, f"row {i} of {spec.hub_id}: {what}") from None
            if row is not None:
                yield row

    rows = list(islice(converted(), spec.max_problems))
    if spec.expected_problems and spec.max_problems is None and not offline_fixture \
            and len(rows) != spec.expected_problems:
        print(f"benchmark {spec.title}: {len(rows)} problems, the paper's protocol has {spec.expected_problems}",
              file=sys.stderr)
    return rows


# ---------------------------------------------------------------- running


def run_benchmark(engine, tokenizer, spec: Benchmark, rows: list[dict], out_dir: Path, batch_size: int, seed: int,
                  desc: str = "") -> dict:
    """Every problem k times with the benchmark's sampling settings, through the resumable eval runner; adds the
    benchmark's own score (avg@k over all its problems) and protocol to the runner's per-env/task results.
    A max_new_tokens that is not the config's is fitted to the engine's context first (recipe.eval.sampling);
    the protocol records the value sampled with and its source."""
    context = model_context(engine)
    sources = dict(spec.sources)
    fitted = sampling.fit_max_new_tokens(
        {"max_new_tokens": spec.max_new_tokens, "max_new_tokens_source": sources.get("max_new_tokens", "config")},
        max((len(encode_prompt(tokenizer, r["prompt"])) for r in rows), default=0), context)
    if spec.sources:
        spec = dataclasses.replace(spec, max_new_tokens=fitted["max_new_tokens"], sources=tuple(
            {**sources, "max_new_tokens": fitted["max_new_tokens_source"]}.items()))
    ecfg = EvalConfig(samples=spec.samples, pass_k=list(spec.pass_k), temperature=spec.temperature,
                      top_p=spec.top_p, top_k=spec.top_k, max_new_tokens=fitted["max_new_tokens"],
                      batch_size=batch_size, seed=seed)
    res = evaluate(engine, tokenizer, rows, ecfg, Path(out_dir), desc=desc or spec.title, context=context)
    records, _ = problem_records(Path(out_dir) / "samples.jsonl", rows, spec.samples)
    res["benchmark"] = summarize([r["scores"] for r in records], list(spec.pass_k))
    res.update({"name": spec.name, "title": spec.title, "protocol": spec.protocol()})
    return res


def main(argv: list[str]) -> int:
    """`python -m recipe.eval.benchmarks [--fixtures] [NAME...]`: load (and so cache) benchmarks, print counts."""
    fixtures = "--fixtures" in argv
    names = [a for a in argv if not a.startswith("--")] or PAPER_ORDER
    for name in names:
        if name not in REGISTRY:
            print(f"error: unknown benchmark {name!r} (known: {', '.join(REGISTRY)})", file=sys.stderr)
            return 2
        spec, started = REGISTRY[name], time.time()
        try:
            rows = load_benchmark(spec, offline_fixture=fixtures)
        except BenchmarkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        envs = sorted({r["env"] for r in rows})
        print(f"{name}: {len(rows)} problems (paper: {spec.expected_problems}), envs {envs}, "
              f"{spec.hub_id}@{spec.revision[:10]}, {time.time() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
