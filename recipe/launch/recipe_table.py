"""docs/recipe.md §11, the production run value by value, read as data: the rows (key, value, source) and the
resolved config held against them. `make plan` prints it; tests/test_recipe_table.py checks the intellect3 preset
against every row, so the table and the preset cannot drift apart silently."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipe.md"
SECTION = "## 11. The `intellect3` preset, value by value"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|(.*)\|\s*$")


@dataclass(frozen=True)
class Row:
    key: str
    value: object
    source: str


def _value(text: str):
    value = yaml.safe_load(text)
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string; the table means the number
        try:
            return float(value)
        except ValueError:
            return value
    return value


def production_rows(doc: Path = DOC) -> list[Row]:
    """The rows of the section, in order; a ValueError naming the file if the section is missing or empty."""
    text = doc.read_text()
    if SECTION not in text:
        raise ValueError(f"{doc}: no section {SECTION!r}")
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [Row(m.group(1), _value(m.group(2).strip()), m.group(3).strip())
            for line in body.splitlines() if (m := ROW.match(line))]
    if not rows:
        raise ValueError(f"{doc}: section {SECTION!r} has no rows")
    return rows


def _same(expected, actual) -> bool:
    """Equal values; a dict row names the fields it fixes, and the others must be unset (null): an
    `eval.benchmarks[i]` entry lists its name and k, an `rl.env_mix` lists every environment."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return all(k in actual and _same(v, actual[k]) for k, v in expected.items()) and \
            all(v is None for k, v in actual.items() if k not in expected)
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return abs(expected - actual) <= 1e-12 * max(abs(expected), abs(actual), 1.0)
    return expected == actual


def compare(cfg, rows: list[Row] | None = None) -> list[tuple[Row, object, bool]]:
    """(row, the config's value, whether they agree) for every row; a key the config lacks reads as missing."""
    out = []
    for row in rows if rows is not None else production_rows():
        actual = OmegaConf.select(cfg, row.key, default="<missing>")
        if OmegaConf.is_config(actual):
            actual = OmegaConf.to_container(actual, resolve=True)
        out.append((row, actual, _same(row.value, actual)))
    return out
