"""The one row schema that SFT, RL and eval all read (parquet), and its checked reader.

prompt / completion: chat messages {role, content, tool_calls} as in INTELLECT-3-SFT; completion is empty for
rows that only carry a verifiable task. answer: the reference answer. info: JSON with what the verifier needs
(task name, reasoning-gym entry, tests). difficulty: a task level (tiny) or a precomputed pass rate (full).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from recipe.errors import DataError
from recipe.runs import sha256_file, write_atomic

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string())])
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("env", pa.string()),
    ("task", pa.string()),
    ("split", pa.string()),
    ("prompt", pa.list_(MESSAGE)),
    ("completion", pa.list_(MESSAGE)),
    ("answer", pa.string()),
    ("info", pa.string()),
    ("difficulty", pa.float64()),
    ("tools", pa.string()),
])
REQUIRED = [f.name for f in SCHEMA]
TEXT_SCHEMA = pa.schema([("text", pa.string())])  # plain pretraining text (tiny base model only)


def message(role: str, content: str, tool_calls: str | None = None) -> dict:
    return {"role": role, "content": content, "tool_calls": tool_calls}


def too_easy(row: dict, max_pass_rate: Mapping[str, float]) -> bool:
    """The offline difficulty filter, the recipe's one definition (`make data` applies it, recipe.data.hub): a
    prompt of an environment listed in max_pass_rate (environment -> threshold) whose precomputed pass rate
    (difficulty) is above that environment's threshold teaches little. INTELLECT-3 filters math alone (math:
    0.874); an environment not listed is never filtered. A row without a pass rate (NaN) is kept: the filter drops
    what is known to be too easy, and an unknown rate is not (`make data` counts such rows)."""
    limit = max_pass_rate.get(row["env"])
    rate = row["difficulty"]
    return limit is not None and not math.isnan(rate) and rate > limit


def check_row(row: dict, where: str) -> None:
    """What every stage relies on in a row: messages with a text role and content, and a prompt to answer
    (SFT rows may carry the whole conversation in the completion)."""
    prompt, completion = row.get("prompt") or [], row.get("completion") or []
    if not prompt and row.get("split") != "sft":
        raise DataError(f"{where}: the prompt has no message")
    for m in list(prompt) + list(completion):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: malformed message {str(m)[:120]}: role and content must be text")


def write_rows(rows: list[dict], path: Path) -> str:
    """Validate rows against the schema and write them atomically; returns the file's sha256."""
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise DataError(f"{path}: row {i} lacks key(s) {missing}")
        check_row(row, f"{path}: row {i} (id {row['id']!r})")
    return write_parquet(rows, SCHEMA, path)


def write_parquet(rows: list[dict], schema: pa.Schema, path: Path) -> str:
    """Write rows as parquet atomically; returns the file's sha256."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    write_atomic(path, sink.getvalue().to_pybytes())
    return sha256_file(path)


def read_rows(path: Path, expected_sha256: str | None = None, schema: pa.Schema = SCHEMA) -> list[dict]:
    """Read a data file, naming the file in every error: missing, corrupt, or of another schema."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} is missing: run `make data` first")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise DataError(f"data file {path} does not match its manifest sha256 (corrupt or edited): "
                        f"rerun `make data ARGS=force=true`")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"data file {path} is not readable parquet: {e}") from None
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise DataError(f"data file {path} lacks column(s) {missing}")
    for f in schema:
        if table.schema.field(f.name).type != f.type:
            raise DataError(f"data file {path}: column {f.name} is {table.schema.field(f.name).type}, "
                            f"expected {f.type}")
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        raise DataError(f"data file {path}: {_undecodable(table)} is not UTF-8 text") from None
    if schema is SCHEMA:
        for i, row in enumerate(rows):
            check_row(row, f"data file {path}: row {i} (id {row['id']!r})")
    return rows


def _undecodable(table: pa.Table) -> str:
    """'row i, column c' of the first value that is not UTF-8 (found again, value by value: the error path)."""
    for i in range(table.num_rows):
        for name in table.column_names:
            try:
                table.column(name)[i].as_py()
            except UnicodeDecodeError:
                return f"row {i}, column {name}"
    return "a value"


def split_file(data_dir: Path, split: str) -> tuple[Path, str]:
    """(file, sha256) of one split, from the data manifest."""
    data_dir = Path(data_dir)
    manifest_path = data_dir / "data_manifest.json"
    if not manifest_path.exists():
        raise DataError(f"{manifest_path} is missing: run `make data` first")
    try:
        files = json.loads(manifest_path.read_text())["files"]
        name = f"{split}.parquet"
        if name not in files:
            raise DataError(f"{manifest_path} lists no split '{split}' (has {sorted(files)})")
        return data_dir / name, files[name]["sha256"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, not UTF-8, or not the manifest's layout
        raise DataError(f"{manifest_path} is corrupt ({e}): rerun `make data ARGS=force=true`") from None


def read_split(data_dir: Path, split: str) -> list[dict]:
    """Read one split through the data manifest, so that a corrupt file is caught before it is trained on."""
    return read_rows(*split_file(data_dir, split))


def read_text_split(data_dir: Path, split: str = "pretrain") -> list[str]:
    """The plain-text split of the tiny base model, through the data manifest."""
    return [r["text"] for r in read_rows(*split_file(data_dir, split), schema=TEXT_SCHEMA)]
