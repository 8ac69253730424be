"""INTELLECT-3's own data: PrimeIntellect/INTELLECT-3-SFT and -RL at pinned revisions, in the fixed row schema.

SFT rows keep their chat messages (tool calls as a JSON string). RL rows become one user message (math gets the
math environment's instruction first), with the precomputed pass rate as difficulty. The offline difficulty
filter (recipe.data.schema.too_easy, data.max_pass_rate: environment -> threshold) drops prompts a small model
already solves too often; INTELLECT-3 filters math alone (pass rate above 0.874), code is not filtered. It is
applied here only: RL takes the rl split as it is. An `eval` split is a hash-selected slice of the RL prompts
that never appears in `rl`.

The hub is checked before anything is downloaded, so a machine without network fails in seconds with one line
that says what to do, instead of hanging in retries.
"""
from __future__ import annotations

import hashlib
import json
import math
from itertools import islice
from typing import Callable, Iterable

from recipe import hub
from recipe.data.schema import message, too_easy
from recipe.envs.math import INSTRUCTION as MATH_INSTRUCTION
from recipe.errors import DataError

EVAL_MODULUS = 50  # one prompt in 50 (by hash) is held out for eval

Loader = Callable[[str], Iterable[dict]]


# ---------------------------------------------------------------- pure conversions


def _tool_calls_json(tool_calls) -> str | None:
    """The schema stores tool calls as a JSON string; no calls is None, not '[]'."""
    if tool_calls is None or tool_calls == [] or tool_calls == "":
        return None
    if isinstance(tool_calls, str):
        json.loads(tool_calls)  # already serialised: only check it parses
        return tool_calls
    return json.dumps(tool_calls, ensure_ascii=False)


def _messages(raw_messages, where: str) -> list[dict]:
    if not isinstance(raw_messages, list):
        raise DataError(f"{where}: expected a list of messages, got {type(raw_messages).__name__}")
    out = []
    for m in raw_messages:
        try:
            # content may be None next to tool calls; the schema keeps strings only
            out.append(message(m["role"], m.get("content") or "", _tool_calls_json(m.get("tool_calls"))))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: malformed message {str(m)[:120]!r} ({type(e).__name__}: {e})") from None
    return out


def _tools_json(tools, where: str) -> str:
    if tools is None or tools == "":
        return "[]"
    if isinstance(tools, str):
        try:
            json.loads(tools)
        except ValueError:
            raise DataError(f"{where}: 'tools' is not valid JSON: {tools[:120]!r}") from None
        return tools
    return json.dumps(tools, ensure_ascii=False)


def sft_row(raw: dict, subset: str, index: int) -> dict:
    """One INTELLECT-3-SFT row (source, prompt, completion, split, tools) as a schema row."""
    where = f"INTELLECT-3-SFT/{subset} row {index}"
    prompt = _messages(raw.get("prompt"), where)
    completion = _messages(raw.get("completion"), where)
    source = raw.get("source") or {}
    if source.get("dataset") is not None and source.get("index") is not None:
        # the subset is part of the id: two subsets may draw from the same upstream dataset
        row_id = f"{subset}:{source['dataset']}:{source['index']}"
    else:
        blob = json.dumps([prompt, completion], sort_keys=True).encode()
        row_id = f"{subset}:{hashlib.sha256(blob).hexdigest()[:16]}"
    info = {"subset": subset, "index": index, "source": source, "source_split": raw.get("split")}
    return {
        "id": row_id, "env": "sft", "task": subset, "split": "sft",
        "prompt": prompt, "completion": completion, "answer": "",
        "info": json.dumps(info, sort_keys=True, ensure_ascii=False),
        "difficulty": 0.0,  # SFT rows carry no pass rate
        "tools": _tools_json(raw.get("tools"), where),
    }


def pass_rate_column(raw: dict, preferred: str) -> str | None:
    """The configured pass-rate column when the subset has it, else its first avg@k column (subsets differ:
    math has avg@8 of Qwen3-4B thinking and instruct, code avg@8 instruct, science and logic avg@16 instruct)."""
    if preferred and preferred in raw:
        return preferred
    return next((k for k in raw if k.startswith("avg@")), None)


def _entry(value, where: str) -> dict:
    """The dataset's own `info` column: a JSON string (code, logic) or a struct (science)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise DataError(f"{where}: 'info' is not valid JSON: {value[:120]!r}") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: 'info' should be an object, got {type(value).__name__}")
    # code: the tests are JSON inside the JSON; decode them once here so verifiers read plain objects
    if isinstance(value.get("tests"), str):
        try:
            value = {**value, "tests": json.loads(value["tests"])}
        except ValueError:
            raise DataError(f"{where}: 'info.tests' is not valid JSON") from None
    return value


def _task_of(subset: str, entry: dict) -> str:
    if subset == "logic":  # SynLogic task type; the key was renamed between dataset revisions
        return str(entry.get("task") or entry.get("task_name") or subset)
    if subset == "science":
        return str(entry.get("domain") or subset)
    return subset


def rl_row(raw: dict, subset: str, index: int, data_cfg) -> dict:
    """One INTELLECT-3-RL row as a schema row: a single user message, difficulty = precomputed pass rate."""
    where = f"INTELLECT-3-RL/{subset} row {index}"
    if not isinstance(raw.get("question"), str):
        raise DataError(f"{where}: no 'question' column (columns: {sorted(raw)})")
    column = pass_rate_column(raw, data_cfg.pass_rate_column)
    if column is None and subset in data_cfg.max_pass_rate:
        raise DataError(f"{where}: no pass-rate column (avg@k) to filter on (columns: {sorted(raw)})")
    value = raw[column] if column is not None else None
    try:
        rate = float("nan") if value is None else float(value)  # NaN: unknown, kept (schema.too_easy)
    except (TypeError, ValueError):
        raise DataError(f"{where}: pass rate {column}={str(value)[:40]!r} is not a number") from None
    text = f"{MATH_INSTRUCTION}\n{raw['question']}" if subset == "math" else raw["question"]
    entry = _entry(raw.get("info"), where)
    ds = data_cfg.rl_dataset
    info = {
        "task": _task_of(subset, entry),
        "source": {"dataset": ds.id, "revision": ds.revision, "subset": subset, "index": index},
        "pass_rate_column": column,
        "pass_rates": {k: raw[k] for k in raw if k.startswith("avg@")},
        "entry": entry,
    }
    return {
        "id": f"{subset}-{index}", "env": subset, "task": info["task"], "split": "rl",
        "prompt": [message("user", text)], "completion": [],
        "answer": "" if raw.get("answer") is None else str(raw["answer"]),
        "info": json.dumps(info, sort_keys=True, ensure_ascii=False),
        "difficulty": rate, "tools": "[]",
    }


def is_eval(row: dict) -> bool:
    """Held out by a hash of the prompt text, so a prompt (and every duplicate of it) sits in one split only."""
    text = "\n".join(m["content"] for m in row["prompt"])
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % EVAL_MODULUS == 0


# ---------------------------------------------------------------- the hub


def check_pinned(ds, kind: str) -> None:
    """Every hub reference must name a dataset and a revision: `main` today is not `main` next month."""
    if not (ds.id or "").strip():
        raise DataError(f"data.{kind}.id is empty: name the hub dataset to load")
    if not (ds.revision or "").strip():
        raise DataError(f"data.{kind}: revision of {ds.id} is empty; pin it to a commit "
                        f"(data.{kind}.revision=<sha>) so that the data cannot change under the recipe")
    if not ds.subsets:
        raise DataError(f"data.{kind}: no subsets listed for {ds.id}")


def dataset_ref(ds) -> hub.Ref:
    return hub.Ref("datasets", ds.id, ds.revision)


def hub_loader(ds, max_rows: int | None) -> Loader:
    """subset -> raw rows of one pinned hub dataset. A row cap streams (a smoke run does not download 7M rows);
    offline, only the local cache can serve, so nothing streams."""

    def load(subset: str):
        import datasets

        offline = hub.offline()
        try:
            if offline:
                with hub.libraries_offline():
                    rows = datasets.load_dataset(ds.id, subset, split=ds.split, revision=ds.revision)
            else:
                rows = datasets.load_dataset(ds.id, subset, split=ds.split, revision=ds.revision,
                                             streaming=max_rows is not None)
            yield from islice(rows, max_rows)
        except DataError:
            raise
        except Exception as e:  # datasets raises many types (connection, missing config, bad revision)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            hint = (f"offline mode is on and it is not in the local cache; {hub.HOWTO}" if offline
                    else "check the id, subset and revision")
            raise DataError(f"cannot load {ds.id}@{ds.revision} subset '{subset}': "
                            f"{type(e).__name__}: {first[:200]}; {hint}") from None

    return load


# ---------------------------------------------------------------- building the splits


def _rows(load: Loader, subset: str, max_rows: int | None):
    """Raw rows of one subset with their index in the source (the index is part of each row's id)."""
    return enumerate(islice(load(subset), max_rows))


def build_sft(data_cfg, load: Loader) -> list[dict]:
    rows = []
    for subset in data_cfg.sft_dataset.subsets:
        converted = [sft_row(raw, subset, i) for i, raw in _rows(load, subset, data_cfg.max_rows)]
        print(f"data: sft/{subset}: {len(converted)} rows")
        rows.extend(converted)
    return rows


def build_rl(data_cfg, load: Loader) -> tuple[list[dict], list[dict]]:
    """(rl rows, eval rows): filtered by pass rate first (the offline filter, data.max_pass_rate per environment;
    RL takes the rows as they are), so eval measures the distribution RL trains on."""
    rl, held_out = [], []
    limits = dict(data_cfg.max_pass_rate)
    for subset in data_cfg.rl_dataset.subsets:
        converted = [rl_row(raw, subset, i, data_cfg) for i, raw in _rows(load, subset, data_cfg.max_rows)]
        kept = [r for r in converted if not too_easy(r, limits)]
        evals = [dict(r, split="eval") for r in kept if is_eval(r)]
        if subset in limits:
            column = json.loads(converted[0]["info"])["pass_rate_column"] if converted else "-"
            unrated = sum(math.isnan(r["difficulty"]) for r in converted)
            filtered = (f"dropped {len(converted) - len(kept)} with {column} > {limits[subset]:g}"
                        + (f", kept {unrated} without a pass rate" if unrated else ""))
        else:
            filtered = "no pass-rate filter"
        print(f"data: rl/{subset}: {len(converted)} rows, {filtered}; {len(kept) - len(evals)} rl, {len(evals)} eval")
        rl.extend(r for r in kept if not is_eval(r))
        held_out.extend(evals)
    return rl, held_out


def build_intellect3(data_cfg, loader: Loader | None = None) -> dict[str, list[dict]]:
    """{'sft', 'rl', 'eval'} schema rows from INTELLECT-3-SFT and -RL. `loader` (subset -> raw rows) replaces
    the hub in tests; the SFT and RL subset names do not overlap, so one loader can serve both."""
    sft_ds, rl_ds = data_cfg.sft_dataset, data_cfg.rl_dataset
    check_pinned(sft_ds, "sft_dataset")
    check_pinned(rl_ds, "rl_dataset")
    if loader is None:
        hub.ensure_reachable([dataset_ref(sft_ds), dataset_ref(rl_ds)], data_cfg.hub_timeout_s, DataError)
        sft_load, rl_load = hub_loader(sft_ds, data_cfg.max_rows), hub_loader(rl_ds, data_cfg.max_rows)
    else:
        sft_load = rl_load = loader
    sft = build_sft(data_cfg, sft_load)
    rl, held_out = build_rl(data_cfg, rl_load)
    return {"sft": sft, "rl": rl, "eval": held_out}
