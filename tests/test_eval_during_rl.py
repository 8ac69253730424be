"""Eval during RL (rl.eval_every, recipe/rl/eval_during.py): records at step 0, every eval_every steps and the last
step, each on that step's policy through the RL's own engine; a resume neither repeats nor loses one; off at 0;
the engine shared with the orchestrator hands each its own completions; RESULTS.md shows the curve.

The engine is scripted on real token ids (tests.fakes.TokenEngine): RL groups get one right answer and the rest
wrong, as in tests/test_rl_loop.py; an eval request is answered right once the policy version reaches
RIGHT_FROM, so the records show which weights each eval saw.
"""
import contextlib
import io
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.errors import ConfigError
from recipe.inference.engine import Cancelled, Done, Request
from recipe.rl import eval_during, loop
from recipe.rl.eval_during import SharedEngine, read_records, spread_over_tasks
from recipe.rollout import Completion, SamplingParams
from recipe.runs import STOP, Stage, stage_dir, write_atomic
from tests.fakes import TokenEngine, save_tiny_qa_model

RIGHT_FROM = 2  # eval requests are answered right from this policy version on
EVAL_PROBLEMS = 6


class VersionedEngine(TokenEngine):
    """TokenEngine, with eval requests (negative ids) right from policy version RIGHT_FROM on; logs the versions
    every eval request was answered with."""

    def __init__(self, tokenizer, version):
        super().__init__(tokenizer, version)
        self.eval_versions = []  # (policy version, number of eval requests) of each answer

    def poll(self, timeout=None):
        event = super().poll(timeout)
        if not isinstance(event, Done):
            return event
        out, n = [], 0
        for rid, c in event.results:
            if rid < 0:
                n += 1
                prompt = next(r for r in self.answered if r.id == rid)
                n_right = self.answer(self.tok.decode(prompt.prompt_ids)) if c.policy_version >= RIGHT_FROM else -1
                ids = self.tok.encode(f"<think>t</think>{n_right}", add_special_tokens=False) + [self.stop_id]
                c = Completion(ids, [-1.0] * len(ids), "stop", c.policy_version)
            out.append((rid, c))
        if n:
            self.eval_versions.append((self.policy_version, n))
        return Done(out, event.busy_s)

    def submit(self, requests):
        self.answered = getattr(self, "answered", []) + list(requests)
        super().submit(requests)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_during_rl")
    start = root / "start_model"
    tok = save_tiny_qa_model(start)

    def cfg(max_steps, *extra):
        return load_config([f"run_root={root / 'runs'}", f"rl.max_steps={max_steps}", "rl.checkpoint_every=1",
                            "rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8",
                            "rl.micro_batch_size=4", "rl.pin_cores=false", "rl.seed=0", "rl.lr=1e-3",
                            "~rl.env_mix.logic", "~rl.env_mix.code", "~rl.env_mix.tools", "rl.env_mix.math=1.0",
                            "rl.eval_every=2", "rl.eval_samples=2", f"rl.eval_max_problems={EVAL_PROBLEMS}",
                            *extra])

    data = stage_dir(cfg(1), "data")
    files = {}
    for split, n in (("rl", 40), ("eval", 10)):
        rows = [{"id": f"{split}{i}", "env": "math", "task": "add" if i % 2 else "sub", "split": split,
                 "prompt": [message("user", f"Q{i + 50 * (split == 'eval')}")], "completion": [],
                 "answer": str(i + 50 * (split == "eval")), "info": "{}", "difficulty": 0.0, "tools": "[]"}
                for i in range(n)]
        files[f"{split}.parquet"] = {"rows": n, "sha256": write_rows(rows, data / f"{split}.parquet")}
    write_atomic(data / "data_manifest.json", json.dumps({"files": files}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg(1), "data").hash}))
    return {"root": root, "tok": tok, "start": start, "cfg": cfg}


def run(world, name, max_steps, *extra):
    """run_rl in stage folder `name`: (engine, printed output)."""
    engines = []

    def make_engine(cfg, model_path, version, log_dir):
        engines.append(VersionedEngine(world["tok"], version))
        return engines[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "make_engine", make_engine)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            loop.run_rl(world["cfg"](max_steps, *extra), world["root"] / name, world["start"])
    finally:
        mp.undo()
    return engines[0], out.getvalue()


def metrics(stage: Path) -> list[dict]:
    return [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]


def test_evals_at_step_0_every_eval_every_steps_and_the_last_on_that_steps_policy(world):
    engine, out = run(world, "rl_every2", 5)
    stage = world["root"] / "rl_every2"
    records = read_records(stage / "eval_during_rl.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 5]
    for r in records:
        assert r["set"] == "held_out" and r["k"] == 2 and r["problems"] == EVAL_PROBLEMS
        assert r["policy_version"] == r["step"] and r["seconds"] > 0
        assert {"avg@2", "pass@2", "pass@1", "by_env", "temperature", "max_new_tokens"} <= set(r)
        # the engine's answers follow its weights: wrong before version RIGHT_FROM, right from it on
        assert r["avg@2"] == r["pass@2"] == (1.0 if r["step"] >= RIGHT_FROM else 0.0)
        samples = [json.loads(x) for x in (stage / "eval_during_rl" / f"step_{r['step']:06d}" / "samples.jsonl")
                   .read_text().splitlines()]
        assert len(samples) == EVAL_PROBLEMS * 2
    # every eval request was answered by the weights of its step: none ran on while the trainer moved on
    assert sorted({v for v, _ in engine.eval_versions}) == [0, 2, 4, 5]
    assert sum(n for _, n in engine.eval_versions) == 4 * EVAL_PROBLEMS * 2
    by_step = {r["step"]: r for r in metrics(stage)}
    assert [s for s, r in by_step.items() if "eval_avg" in r] == [2, 4, 5]
    assert by_step[2]["eval_avg"] == 1.0 and by_step[2]["eval_s"] > 0 and "eval_avg" not in by_step[3]
    assert "rl: eval at step 4: held_out avg@2 1.000" in out


def test_the_held_out_subset_takes_every_task_in_turn(world):
    cfg = world["cfg"](1)
    rows = eval_during.eval_rows(cfg)
    assert [r["id"] for r in rows] == [f"eval{i}" for i in range(EVAL_PROBLEMS)]  # sub, add, sub, ... in order
    ordered = [{"id": i, "env": "math", "task": t} for i, t in enumerate("aaaaabbbcc")]
    assert [r["id"] for r in spread_over_tasks(ordered, 5)] == [0, 1, 5, 6, 8]
    assert spread_over_tasks(ordered, None) == ordered and spread_over_tasks(ordered, 99) == ordered


def test_a_resumed_run_continues_the_file_without_repeating_an_eval(world):
    run(world, "rl_resume", 2)
    stage = world["root"] / "rl_resume"
    assert [r["step"] for r in read_records(stage / "eval_during_rl.jsonl")] == [0, 2]
    engine, out = run(world, "rl_resume", 4)
    assert "resuming from" in out
    records = read_records(stage / "eval_during_rl.jsonl")
    lines = (stage / "eval_during_rl.jsonl").read_text().splitlines()
    assert [r["step"] for r in records] == [0, 2, 4] and len(lines) == 3
    assert [v for v, _ in engine.eval_versions] == [4]  # only step 4 was evaluated by the resumed run


def test_an_eval_cut_short_is_run_first_on_resume(world):
    run(world, "rl_cut", 2)
    stage = world["root"] / "rl_cut"
    path = stage / "eval_during_rl.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n" + second[:20])  # step 2's record cut by a kill (its checkpoint was written)
    samples = stage / "eval_during_rl" / "step_000002" / "samples.jsonl"
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:4]))  # 2 of its problems done
    engine, _ = run(world, "rl_cut", 3)
    assert [r["step"] for r in read_records(path)] == [0, 2, 3]
    # first, before any training, on the resumed weights of step 2: only the 4 problems not done before
    assert engine.eval_versions[0] == (2, (EVAL_PROBLEMS - 2) * 2)
    assert read_records(path)[1]["problems"] == EVAL_PROBLEMS
    assert all(json.loads(x) for x in path.read_text().splitlines())  # the cut line is gone


def test_off_when_eval_every_is_0_and_a_fresh_run_drops_old_records(world):
    from recipe.config import RLConfig

    assert RLConfig().eval_every == 0  # the schema's default is off
    stage = world["root"] / "rl_off"
    (stage / "eval_during_rl" / "step_000000").mkdir(parents=True)
    (stage / "eval_during_rl.jsonl").write_text('{"step": 0}\n')  # of an earlier run in this folder
    engine, out = run(world, "rl_off", 2, "rl.eval_every=0")
    assert engine.eval_versions == [] and "eval" not in out
    assert not any("eval_avg" in r for r in metrics(stage))
    assert not (stage / "eval_during_rl.jsonl").exists() and not (stage / "eval_during_rl").exists()


def test_an_unknown_eval_set_is_a_config_error(world):
    with pytest.raises(ConfigError, match="rl.eval_set='aime2099' is neither held_out nor a known benchmark"):
        eval_during.eval_rows(world["cfg"](1, "rl.eval_set=aime2099"))


# -- the shared engine -------------------------------------------------------------------------------------------
class EchoEngine:
    """Answers every request at the next poll with its own prompt; cancels the ids in `cancel` once."""

    def __init__(self):
        self.policy_version, self.pending, self.cancel = 0, [], set()
        self.lock = threading.Lock()
        self.submitted = []

    def submit(self, requests):
        with self.lock:
            self.pending += requests
            self.submitted += [r.id for r in requests]

    def poll(self, timeout=None):
        with self.lock:
            batch, self.pending = self.pending, []
        if not batch:
            time.sleep(min(timeout or 0, 0.005))
            return None
        dropped = [r.id for r in batch if r.id in self.cancel]
        if dropped:
            self.cancel -= set(dropped)
            with self.lock:
                self.pending += [r for r in batch if r.id not in dropped]
            return Cancelled(dropped)
        return Done([(r.id, Completion(list(r.prompt_ids), [0.0], "stop", self.policy_version)) for r in batch], 1.0)

    def update_weights(self, path, version):
        self.policy_version = version

    def close(self):
        pass


def test_the_shared_engine_hands_the_orchestrator_and_the_eval_their_own_completions():
    inner = EchoEngine()
    shared = SharedEngine(inner)
    got, stop = [], threading.Event()

    def orchestrator():  # polls as the orchestrator's thread does
        while not stop.is_set():
            event = shared.poll(timeout=0.05)
            if event is not None:
                got.append(event)

    thread = threading.Thread(target=orchestrator)
    thread.start()
    try:
        shared.submit([Request(i, [100 + i], SamplingParams(seed=i), 0) for i in range(5)])
        inner.cancel = {-2}  # an eval request the engine drops: sent again
        out = shared.generate([[7], [8], [9]], SamplingParams(seed=10))
        shared.submit([Request(5, [105], SamplingParams(seed=5), 0)])
        deadline = time.time() + 5
        while sum(len(e.results) for e in got if isinstance(e, Done)) < 6 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert [c.token_ids for c in out] == [[7], [8], [9]]
    theirs = [rid for e in got if isinstance(e, Done) for rid, _ in e.results]
    assert sorted(theirs) == [0, 1, 2, 3, 4, 5] and not any(isinstance(e, Cancelled) for e in got)
    assert inner.submitted.count(-2) == 2  # the cancelled eval request went to the engine again


def test_the_shared_engine_generates_alone_and_a_stop_ends_the_eval():
    shared = SharedEngine(EchoEngine())  # no orchestrator thread: generate polls the engine itself
    assert [c.token_ids for c in shared.generate([[1], [2]], SamplingParams())] == [[1], [2]]

    class Silent(EchoEngine):
        def poll(self, timeout=None):
            time.sleep(min(timeout or 0, 0.005))

    STOP.signum = 15
    try:
        with pytest.raises(eval_during.EvalStopped):
            SharedEngine(Silent()).generate([[1]], SamplingParams())
    finally:
        STOP.reset()


def test_through_the_hf_engine_process_the_eval_gets_what_hf_engine_generate_gives(world):
    """The real engine process (recipe.inference.worker): generate through SharedEngine, with the RL's requests
    in the same queue, samples exactly as HFEngine.generate does with the same seeds."""
    from recipe.inference.hf import HFEngine
    from recipe.inference.worker import HFEngineProcess

    prompts = [world["tok"].encode(f"Q{i}", add_special_tokens=False) for i in range(3)] * 2
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1234)
    expected = HFEngine.from_pretrained(str(world["start"]), batch_size=4).generate(prompts, params)
    shared = SharedEngine(HFEngineProcess(str(world["start"]), batch_size=4))
    try:
        shared.submit([Request(i, prompts[0], SamplingParams(max_new_tokens=6, seed=i), 0) for i in range(3)])
        got = shared.generate(prompts, params)
        rl_done = []
        while len(rl_done) < 3:
            rl_done += [rid for rid, _ in shared.poll(timeout=30).results]
    finally:
        shared.close()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    flat = lambda cs: [x for c in cs for x in c.logprobs]  # noqa: E731
    assert flat(got) == pytest.approx(flat(expected), abs=1e-5)  # (batched with other rows: numerics only)
    assert sorted(rl_done) == [0, 1, 2]


def test_held_out_evals_are_off_when_the_data_has_no_held_out_split(tmp_path, capsys):
    cfg = load_config([f"run_root={tmp_path}", "rl.eval_every=5"])
    data = stage_dir(cfg, "data")
    data.mkdir(parents=True)
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"rl.parquet": {"rows": 1, "sha256": "x"}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
    assert eval_during.start(cfg, tmp_path / "rl", None) is None
    assert "no eval during RL: rl.eval_set=held_out and the data has no held-out split" in capsys.readouterr().err
    assert eval_during.start(load_config([f"run_root={tmp_path}", "rl.eval_every=0"]), tmp_path / "rl", None) is None


# -- RESULTS.md ----------------------------------------------------------------------------------------------------
def test_the_report_shows_the_eval_during_rl_curve(tmp_path):
    from recipe.eval.report import write_report

    shutil.copytree(Path(__file__).parent / "data" / "runs_min", tmp_path / "runs")
    cfg = load_config([f"run_root={tmp_path / 'runs'}"])
    assert "_No eval during RL yet" in write_report(cfg).read_text()
    rl = stage_dir(cfg, "rl")
    records = [{"step": s, "set": "held_out", "k": 4, "problems": 48, "avg@4": a, "pass@4": p, "pass@1": a,
                "by_env": {"math": a, "tools": min(1.0, a + 0.2)}, "temperature": 1.0, "max_new_tokens": 96,
                "seed": 1234, "seconds": 3.0, "policy_version": s, "masked_problems": 0}
               for s, a, p in ((0, 0.45, 0.8), (30, 0.52, 0.83), (60, 0.58, 0.85))]
    (rl / "eval_during_rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(cfg).read_text()
    assert "### Eval during RL" in text and "`held_out` (48 problems" in text
    assert "| step | avg@4 | pass@4 | math avg@4 | tools avg@4 | problems | s |" in text
    assert "| 30 | 0.520 | 0.830 | 0.520 | 0.720 | 48 | 3.0 |" in text
    manifest = json.loads((rl / "manifest.json").read_text())
    assert f"commit {manifest['git']['commit'][:10]}" in text and f"`{manifest['config_hash']}`" in text
    assert f"The 3 evals took 9 s ({100 * 9 / manifest['wall_s']:.1f}% of the stage's wall time)" in text
    png = tmp_path / "runs" / "results" / "tiny_eval_during_rl.png"
    assert "![eval during RL](results/tiny_eval_during_rl.png)" in text and png.stat().st_size > 1000
    first = png.read_bytes()
    write_report(cfg)
    assert png.read_bytes() == first  # same runs, same bytes
