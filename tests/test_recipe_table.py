"""docs/recipe.md §11 is the table of truth for the `intellect3` preset: every row is checked against the resolved
config, and `make plan` prints it with the sources."""
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.config import load_config
from recipe.launch.recipe_table import SECTION, compare, production_rows

ROOT = Path(__file__).resolve().parent.parent


def test_the_intellect3_preset_holds_every_value_of_the_table():
    rows = production_rows()
    assert len(rows) >= 30 and len({r.key for r in rows}) == len(rows)  # no key twice
    assert all(r.source for r in rows)  # every value has its source
    differ = [(r.key, r.value, actual) for r, actual, ok in compare(load_config(["preset=intellect3"])) if not ok]
    assert not differ, differ


def test_a_value_that_drifts_from_the_table_is_caught():
    cfg = load_config(["preset=intellect3", "rl.lr=2e-6", "rl.env_mix={math:0.5,code:0.5}", "launcher.nodes=45",
                       "launcher.inference_nodes=29", "eval.benchmarks.1.samples=32"])
    differ = {r.key for r, _, ok in compare(cfg) if not ok}
    assert differ == {"rl.lr", "rl.env_mix", "launcher.nodes", "launcher.inference_nodes", "eval.benchmarks[1]"}
    more = load_config(["preset=intellect3", "+rl.env_mix.science=0.1", "eval.benchmarks.0.max_problems=5"])
    assert {r.key for r, _, ok in compare(more) if not ok} == {"rl.env_mix", "eval.benchmarks[0]"}


def test_a_table_row_naming_a_key_the_config_lacks_is_caught(tmp_path):
    doc = tmp_path / "recipe.md"
    doc.write_text(f"{SECTION}\n\n| key | value | source |\n|---|---|---|\n| `rl.lr` | 1.0e-6 | x |\n"
                   f"| `rl.no_such_key` | 3 | y |\n")
    rows = production_rows(doc)
    assert [r.value for r in rows] == [1e-6, 3]
    assert [ok for _, _, ok in compare(load_config(["preset=intellect3"]), rows)] == [True, False]
    doc.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no section"):
        production_rows(doc)


def test_make_plan_prints_the_table_with_its_sources(tmp_path):
    res = subprocess.run([sys.executable, "-m", "recipe.launch", "preset=intellect3", f"run_root={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    n = len(production_rows())
    assert f"production values (docs/recipe.md §11): {n} of {n} as in INTELLECT-3's run" in res.stdout
    assert "rl.lr" in res.stdout and "[prime-rl `train.toml:15`]" in res.stdout and "DIFFERS" not in res.stdout
