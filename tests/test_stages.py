"""Stage bookkeeping: done markers, config changes, and killed stages."""
import json

import pytest

from recipe.runs import MetricsLog, Stage, StageError, require_done


def test_done_only_after_finish_and_config_change_is_an_error(cfg_factory):
    cfg = cfg_factory()
    st = Stage(cfg, "data")
    assert not st.is_done()
    st.begin()
    assert not st.is_done()  # begun is not done: a killed stage never looks finished
    st.finish(inputs={}, outputs={})
    assert st.is_done()
    other = Stage(cfg_factory("data.seed=7"), "data")
    with pytest.raises(StageError, match="force=true"):
        other.is_done()
    assert not Stage(cfg_factory("data.seed=7", "force=true"), "data").is_done()
    # under the same config too: how an edited or damaged output is redone (`make data ARGS=force=true`)
    assert not Stage(cfg_factory("force=true"), "data").is_done()
    # sections a stage does not read do not invalidate it
    assert Stage(cfg_factory("eval.samples=8"), "data").is_done()


def test_require_done_names_the_missing_stage(cfg_factory):
    with pytest.raises(StageError, match="make sft"):
        require_done(cfg_factory(), "sft")


def test_metrics_log_drops_lines_past_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for s in range(1, 8):
        log.log({"step": s})
    MetricsLog(path, resume_step=5).log({"step": 6})
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
