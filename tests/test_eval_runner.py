"""The eval runner with a scripted engine: known completions give exactly the expected metrics; a killed
eval keeps the problems it finished; the report is byte-for-byte reproducible."""
import json
from pathlib import Path

from recipe.config import EvalConfig
from recipe.eval.runner import evaluate
from recipe.inference import Completion
from tests.fakes import CharTokenizer


class ScriptedEvalEngine:
    """Sample s of problem "Qi" answers correctly iff s < correct[i]."""

    def __init__(self, correct: dict[int, int], k: int, fail_after: int | None = None):
        self.correct, self.k, self.calls, self.fail_after = correct, k, 0, fail_after

    def generate(self, prompts, params):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt  # stands in for a kill in the middle of the run
        out = []
        for j, p in enumerate(prompts):
            i = int("".join(chr(c) for c in p).split("Q")[1].split("<")[0])
            s = j % self.k
            text = f"<think>t</think>\\boxed{{{i if s < self.correct[i] else -1}}}"
            out.append(Completion([ord(c) for c in text], [0.0] * len(text), "stop", 0))
        return out


def rows(n):
    return [{"id": f"q{i}", "env": "math", "task": "add" if i % 2 else "sub",
             "prompt": [{"role": "user", "content": f"Q{i}"}], "answer": str(i), "info": "{}"} for i in range(n)]


def test_known_completions_give_exact_metrics(tmp_path):
    correct = {0: 4, 1: 0, 2: 1, 3: 2}  # correct samples out of 4 for each problem
    cfg = EvalConfig(samples=4, pass_k=[1, 2, 4], batch_size=8)
    res = evaluate(ScriptedEvalEngine(correct, 4), CharTokenizer(), rows(4), cfg, tmp_path)
    m = res["env"]["math"]
    assert m["avg@4"] == (1 + 0 + 0.25 + 0.5) / 4
    assert m["pass@1"] == m["avg@4"]
    assert m["pass@4"] == 3 / 4
    assert abs(m["pass@2"] - (1 + 0 + 0.5 + (1 - 1 / 6)) / 4) < 1e-12  # 1 - C(n-c,2)/C(4,2)
    assert res["task"]["math/sub"]["avg@4"] == (1 + 0.25) / 2
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and {ln["reason"] for ln in lines} == {"correct", "wrong answer"}


def test_a_killed_eval_keeps_finished_problems_and_resumes(tmp_path):
    correct = {i: i % 5 for i in range(10)}
    cfg = EvalConfig(samples=4, pass_k=[1], batch_size=8)  # 2 problems a call
    try:
        evaluate(ScriptedEvalEngine(correct, 4, fail_after=3), CharTokenizer(), rows(10), cfg, tmp_path)
    except KeyboardInterrupt:
        pass
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"id": "q9", "cut by the kill')  # a half-written line
    resumed = ScriptedEvalEngine(correct, 4)
    res = evaluate(resumed, CharTokenizer(), rows(10), cfg, tmp_path)
    assert resumed.calls == 2  # only the 4 problems not finished before the kill
    full = evaluate(ScriptedEvalEngine(correct, 4), CharTokenizer(), rows(10), cfg, tmp_path / "fresh")
    assert res["env"] == full["env"]


def test_report_twice_on_the_same_runs_writes_the_same_bytes(tmp_path):
    import shutil

    from recipe.config import load_config
    from recipe.eval.report import write_report

    src = Path(__file__).parent / "data" / "runs_min"
    shutil.copytree(src, tmp_path / "runs")
    cfg = load_config([f"run_root={tmp_path / 'runs'}"])
    first = write_report(cfg).read_bytes()
    png = (tmp_path / "runs" / "results" / "tiny_curves.png").read_bytes()
    second = write_report(cfg).read_bytes()
    assert first == second and b"| sft |" in first and b"| rl |" in first
    metrics = [json.loads(x) for x in (src / "tiny" / "rl" / "metrics.jsonl").read_text().splitlines()]
    filtered = sum(r["filtered_groups"] for r in metrics)
    assert f"RL (120 steps, mean ".encode() in first and f"{filtered} groups filtered out".encode() in first
    assert (tmp_path / "runs" / "results" / "tiny_curves.png").read_bytes() == png
    # and the bytes a refactor must keep: tests/data/runs_min_RESULTS.md is this report as the code wrote it;
    # a change to the report's text is a change to that file too, made on purpose
    assert first.decode() == (src.parent / "runs_min_RESULTS.md").read_text()


def test_report_shows_the_sandbox_throughput_that_bench_sandbox_wrote(tmp_path):
    import json
    import shutil

    from recipe.config import load_config
    from recipe.eval.report import write_report

    shutil.copytree(Path(__file__).parent / "data" / "runs_min", tmp_path / "runs")
    cfg = load_config([f"run_root={tmp_path / 'runs'}"])
    assert "run `make bench-sandbox`" in write_report(cfg).read_text()
    bench = tmp_path / "runs" / "tiny" / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "sandbox.json").write_text(json.dumps({
        "backend": "bwrap", "programs": 200, "workers": 2,
        "rounds": [{"mode": m, "seconds": 5.5, "programs_per_s": 36.36, "cpu_ms": 20.0} for m in ("warm", "cold")],
        "warm": {"programs_per_s": 136.36, "cpu_ms_per_program": 3.25},
        "cold": {"programs_per_s": 36.36, "cpu_ms_per_program": 20.0},
        "command": "make bench-sandbox PRESET=tiny",
        "provenance": {"git": {"commit": "0123456789abcdef", "dirty": False}, "hardware": {"cpus": 2}}}))
    level = {"max_async_level": 1, "steps": 40, "samples": 5120, "mean_step_s": 1.5, "steps_per_hour": 2400.0,
             "speedup_vs_sync": 1.6, "mean_gen_busy_s": 1.3, "mean_train_s": 1.2, "reward_second_half": 0.481,
             "reward_second_half_se": 0.0183, "held_out_avg": 0.464, "held_out_se": 0.0201, "staleness": {"1": 5120}}
    (bench / "rl.json").write_text(json.dumps({
        "results": [level], "command": "make bench-rl PRESET=tiny",
        "provenance": {"git": {"commit": "0123456789abcdef", "dirty": False}, "hardware": {"cpus": 2}}}))
    text = write_report(cfg).read_text()
    assert "| x1.60 |" in text and "| 0.481 ± 0.018 | 0.464 ± 0.020 |" in text
    assert "**136.4 programs/s** warm, 3.2 ms" in text and "36.4 cold, 20.0 ms" in text and "(**x3.75**)" in text
    assert "backend `bwrap`" in text and "`make bench-sandbox PRESET=tiny`" in text


def test_report_says_how_loaded_the_machine_was_where_a_run_recorded_it(tmp_path):
    import json
    import shutil

    from recipe.config import load_config
    from recipe.eval.report import write_report

    shutil.copytree(Path(__file__).parent / "data" / "runs_min", tmp_path / "runs")
    cfg = load_config([f"run_root={tmp_path / 'runs'}"])
    rl_manifest = tmp_path / "runs" / "tiny" / "rl" / "manifest.json"
    m = json.loads(rl_manifest.read_text())
    rl_manifest.write_text(json.dumps({**m, "load_avg_1m_at_start": 0.53, "load_avg_1m_at_end": 1.71}))
    sft_eval = tmp_path / "runs" / "tiny" / "eval" / "sft" / "results.json"
    e = json.loads(sft_eval.read_text())
    e["provenance"].update(load_avg_1m_at_start=2.84, load_avg_1m_at_end=3.06)
    sft_eval.write_text(json.dumps(e))
    (rl_manifest.parent / "eval_during_rl.jsonl").write_text(json.dumps({
        "step": 0, "k": 2, "set": "held_out", "problems": 4, "temperature": 1.0, "max_new_tokens": 8,
        "seconds": 1.5, "avg@2": 0.25, "pass@2": 0.5, "by_env": {"math": 0.25}}) + "\n")
    bench = tmp_path / "runs" / "tiny" / "bench"
    bench.mkdir(parents=True)
    prov = {"git": {"commit": "0123456789abcdef", "dirty": False}, "hardware": {"cpus": 2},
            "load_avg_1m_at_start": 0.21, "load_avg_1m_at_end": 2.36}
    (bench / "sandbox.json").write_text(json.dumps({
        "backend": "bwrap", "programs": 200, "workers": 2,
        "rounds": [{"mode": m, "seconds": 5.5, "programs_per_s": 36.36, "cpu_ms": 20.0} for m in ("warm", "cold")],
        "warm": {"programs_per_s": 136.36, "cpu_ms_per_program": 3.25},
        "cold": {"programs_per_s": 36.36, "cpu_ms_per_program": 20.0},
        "command": "make bench-sandbox PRESET=tiny", "provenance": prov}))
    level = {"steps": 40, "samples": 5120, "mean_step_s": 1.5, "steps_per_hour": 2400.0, "speedup_vs_sync": 1.6,
             "mean_gen_busy_s": 1.3, "mean_train_s": 1.2, "reward_second_half": 0.481, "held_out_avg": 0.464,
             "staleness": {"1": 5120}}
    (bench / "rl.json").write_text(json.dumps({
        "results": [{**level, "max_async_level": 0, "load_avg_1m_at_start": 0.34},
                    {**level, "max_async_level": 1, "load_avg_1m_at_start": 1.87}],
        "command": "make bench-rl PRESET=tiny", "provenance": prov}))
    text = write_report(cfg).read_text()
    held_out, stages = text.split("### Stages")
    rows = {line.split(" | ")[0]: line for line in held_out.splitlines() if line.startswith("| ")}
    stage_rows = {line.split(" | ")[0]: line for line in stages.splitlines() if line.startswith("| ")}
    assert "| 0.5 / 1.7 |" in stage_rows["| rl"]  # the stage that recorded it
    assert "| - / - |" in stage_rows["| sft"]  # a manifest from before loads were recorded
    # the held-out table: each eval's wall time with its load, "-" for an eval from before loads were recorded
    assert "| load (1 min) at start / end |" in text.split("\n| base |")[0]
    assert "| 2.8 / 3.1 |" in rows["| sft"] and "| - / - |" in rows["| rl"]
    assert "RL stage: commit " in text and ", 2 CPUs, load 0.5 at the start, 1.7 at the end.\n" in text
    assert "2 CPUs, load 0.2 at the start, 2.4 at the end." in text.split("## Performance: code sandbox")[1]
    assert "2 CPUs, load 0.3, 1.9 at the levels' starts, 2.4 at the end." in text


def test_prompts_longer_than_the_context_are_skipped_counted_and_not_scored(tmp_path, capsys):
    import pytest

    from recipe.chat import encode_prompt
    from recipe.errors import StageError

    rs = rows(12)  # q0..q9 encode one token shorter than q10, q11
    short = len(encode_prompt(CharTokenizer(), rs[0]["prompt"]))
    cfg = EvalConfig(samples=2, pass_k=[1], batch_size=4, max_new_tokens=8)
    correct = {i: 2 for i in range(12)}
    res = evaluate(ScriptedEvalEngine(correct, 2), CharTokenizer(), rs, cfg, tmp_path, context=short + 8)
    assert res["skipped_too_long"] == 2 and res["overall"]["avg"] == 1.0
    assert res["env"]["math"]["problems"] == 10
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    skipped = [x for x in lines if x.get("skipped")]
    assert sorted(x["id"] for x in skipped) == ["q10", "q11"] and "score" not in skipped[0]
    assert "exceeds the model's context" in skipped[0]["skipped"]
    err = capsys.readouterr().err
    assert "eval: skipping 2 of 12 problems" in err
    # a rerun resumes: nothing left to sample, the same results
    again = evaluate(ScriptedEvalEngine(correct, 2, fail_after=0), CharTokenizer(), rs, cfg, tmp_path,
                     context=short + 8)
    assert again == res
    with pytest.raises(StageError, match="every one of the 12 prompts"):
        evaluate(ScriptedEvalEngine(correct, 2), CharTokenizer(), rs, cfg, tmp_path / "all", context=short)
