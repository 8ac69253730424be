"""Eval during RL (rl.eval_every): the current policy on a fixed eval set, through the RL's own engine.

prime-rl's production run (configs/int3/prod/orch.toml at PR 1272: `[eval] interval = 30`, AIME 2025 with 16
rollouts a problem) evaluates the policy every 30 steps on the inference servers that generate the rollouts. Here:

- When: at step 0 (the start model; prime-rl's `eval_base_model` defaults to true), at every multiple of
  rl.eval_every, and at the last step. Rank 0 runs it right after the step's weights went to the engine (and
  after the step's checkpoint), so every sample comes from that step's policy; the trainer waits meanwhile (under
  several ranks the others wait in their next collective: launcher.collective_timeout_s must exceed an eval).
- What: rl.eval_set, `held_out` (eval.parquet of `make data`; with rl.eval_max_problems the first problems of
  each task in turn, so every task is in the subset) or a benchmark of recipe/eval/benchmarks.py (the first
  rl.eval_max_problems of it), k = rl.eval_samples samples a problem.
- Sampling: the RL's own settings (rl.temperature, top_p 1, rl.max_new_tokens). With k > 1 samples, greedy
  decoding would give k copies of one answer; at the RL temperature avg@k estimates what the training reward
  estimates, the expected reward of the policy as it samples, on problems it never trains on. The seed is
  eval.seed at every eval: problem p's sample s draws the same random numbers each time, so the curve moves with
  the policy, not with the draw.
- Scoring: the eval runner's (recipe.eval.runner.evaluate): each problem's environment, multi-turn tool calls
  answered. The samples go to <rl stage>/eval_during_rl/step_NNNNNN/samples.jsonl.
- Record: one JSON line an eval in <rl stage>/eval_during_rl.jsonl (step, set, k, avg@k, pass@k, problems,
  seconds, ...), appended as MetricsLog appends. avg@k is the mean over environments, as the held-out table of
  RESULTS.md has it; also added to the step's metrics record as eval_avg. A resumed run keeps the file and skips
  the steps it already holds; an eval a stop or kill cut short is run again on resume (at the checkpoint's step,
  its finished problems are kept: the weights are the same).

The engine is shared: SharedEngine hands the orchestrator the RL's events and keeps the eval's completions apart
(eval requests have negative ids; the orchestrator's count up from 0).
"""
from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from recipe.config import BenchmarkConfig, EvalConfig
from recipe.data.schema import read_split
from recipe.errors import ConfigError
from recipe.eval.benchmarks import REGISTRY, load_benchmark, resolve
from recipe.eval.metrics import summarize
from recipe.eval.runner import evaluate, problem_records
from recipe.inference.engine import Cancelled, Done, Request
from recipe.rollout import Completion, SamplingParams
from recipe.runs import STOP, MetricsLog, require_done, write_atomic

HELD_OUT = "held_out"
RECORDS = "eval_during_rl.jsonl"
SAMPLES = "eval_during_rl"
STALL_S = 600.0  # no eval completion for this long: the engine is stuck (the orchestrator waits as long)


class EvalStopped(Exception):
    """A stop was requested while the eval waited on the engine: the eval is dropped, the run stops."""


class SharedEngine:
    """The RL's engine, shared by the orchestrator (the Engine contract: submit, poll, update_weights) and the
    eval (generate, as the eval runner asks). One caller polls the engine at a time; a poll routes the eval's
    completions to the eval and hands the rest to the orchestrator, so each sees only its own requests."""

    def __init__(self, engine):
        self.engine = engine
        self._poll_lock = threading.Lock()  # one poller of the engine at a time
        self._cv = threading.Condition()  # guards the fields below
        self._theirs: deque = deque()  # events for the orchestrator
        self._mine: dict[int, Completion] = {}  # eval request id -> completion
        self._sent: dict[int, Request] = {}  # eval requests not back yet (a Cancelled one is sent again)
        self._next_id = -1
        self.eval_busy_s = 0.0  # the engine's busy seconds that went to eval requests

    # -- the Engine contract, for the orchestrator -----------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, requests: list[Request]) -> None:
        self.engine.submit(requests)

    def update_weights(self, path, version: int) -> None:
        self.engine.update_weights(path, version)

    def close(self) -> None:
        self.engine.close()

    def poll(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                if self._theirs:
                    return self._theirs.popleft()
            left = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            self._pump_or_wait(left)
            if deadline is not None and time.monotonic() >= deadline:
                with self._cv:
                    return self._theirs.popleft() if self._theirs else None

    # -- the eval --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, prompt i seeded params.seed + i (as HFEngine and VLLMEngine generate),
        through the engine's queue beside the RL's requests."""
        with self._cv:
            ids = list(range(self._next_id, self._next_id - len(prompts), -1))
            self._next_id -= len(prompts)
            reqs = [Request(rid, list(p), replace(params, seed=params.seed + i), self.engine.policy_version)
                    for i, (rid, p) in enumerate(zip(ids, prompts))]
            self._sent.update((r.id, r) for r in reqs)
        self.engine.submit(reqs)
        last, have = time.monotonic(), 0
        while True:
            with self._cv:
                n = sum(1 for rid in ids if rid in self._mine)
                if n == len(ids):
                    return [self._mine.pop(rid) for rid in ids]
            if n > have:
                last, have = time.monotonic(), n
            if STOP.requested:
                raise EvalStopped()
            if time.monotonic() - last > STALL_S:
                raise RuntimeError(f"rl eval: the engine returned no eval completion for {STALL_S:.0f} s")
            self._pump_or_wait(0.05)

    # -- polling ---------------------------------------------------------------------------------------------
    def _pump_or_wait(self, timeout: float) -> None:
        """Poll the engine once for up to `timeout` seconds, or, while another caller polls it, wait as long for
        what that poll brings."""
        if self._poll_lock.acquire(blocking=False):
            try:
                self._route(self.engine.poll(timeout))
            finally:
                self._poll_lock.release()
        else:
            with self._cv:
                self._cv.wait(timeout)

    def _route(self, event) -> None:
        if event is None:
            return
        resend = []
        with self._cv:
            if isinstance(event, Done):
                mine = [(rid, c) for rid, c in event.results if rid < 0]
                theirs = [(rid, c) for rid, c in event.results if rid >= 0]
                for rid, c in mine:
                    self._sent.pop(rid, None)
                    self._mine[rid] = c
                share = len(mine) / max(1, len(event.results))  # the busy seconds, by requests
                self.eval_busy_s += event.busy_s * share
                if theirs:
                    self._theirs.append(Done(theirs, event.busy_s * (1 - share)))
            elif isinstance(event, Cancelled):  # waited too long on the engine: an eval request goes again
                resend = [self._sent[rid] for rid in event.request_ids if rid in self._sent]
                theirs = [rid for rid in event.request_ids if rid >= 0]
                if theirs:
                    self._theirs.append(Cancelled(theirs))
            else:
                self._theirs.append(event)
            self._cv.notify_all()
        if resend:
            self.engine.submit([replace(r, submitted_version=self.engine.policy_version) for r in resend])


# -- what is evaluated -----------------------------------------------------------------------------------------
def spread_over_tasks(rows: list[dict], n: int | None) -> list[dict]:
    """The first n rows taking one of each task in turn (each task's rows in file order), so that a small cap
    still covers every task; all rows when n is None or not smaller."""
    if n is None or n >= len(rows):
        return list(rows)
    by_task: dict[str, deque] = {}
    for r in rows:
        by_task.setdefault(f"{r['env']}/{r['task']}", deque()).append(r)
    out = []
    while len(out) < n:
        for queue in by_task.values():
            if queue and len(out) < n:
                out.append(queue.popleft())
    order = {id(r): i for i, r in enumerate(rows)}
    return sorted(out, key=lambda r: order[id(r)])


def eval_rows(cfg) -> list[dict]:
    """The problems of rl.eval_set, capped at rl.eval_max_problems. A benchmark is read from the hub at its
    pinned revision (the HF cache offline), as `make eval` reads it."""
    rl = cfg.rl
    if rl.eval_set == HELD_OUT:
        rows = spread_over_tasks(read_split(require_done(cfg, "data", by="rl"), "eval"), rl.eval_max_problems)
    else:
        if rl.eval_set not in REGISTRY:
            raise ConfigError(f"config error: rl.eval_set={rl.eval_set!r} is neither {HELD_OUT} nor a known "
                              f"benchmark (known: {', '.join(REGISTRY)})")
        spec = resolve(BenchmarkConfig(name=rl.eval_set, samples=rl.eval_samples,
                                       max_problems=rl.eval_max_problems), cfg.eval)
        rows = load_benchmark(spec, timeout=cfg.eval.hub_timeout_s)
    if not rows:
        raise ConfigError(f"config error: rl.eval_set={rl.eval_set!r} has no problems to evaluate")
    return rows


def eval_config(cfg) -> EvalConfig:
    """How each problem is sampled: k samples at the RL's temperature and length, eval.seed every time."""
    rl = cfg.rl
    k = rl.eval_samples
    return EvalConfig(samples=k, pass_k=sorted({1, k}), temperature=rl.temperature, top_p=1.0,
                      max_new_tokens=rl.max_new_tokens, batch_size=max(k, rl.gen_batch_size), seed=cfg.eval.seed)


def start(cfg, stage_dir: Path, resume_step: int | None) -> "EvalDuringRL | None":
    """Rank 0's evals of this run; None when rl.eval_every is 0, or when the held-out set is asked for and the
    data has no held-out split (`make data` always writes one; hand-made RL data may not): said in one line."""
    if not cfg.rl.eval_every:
        return None
    if cfg.rl.eval_set == HELD_OUT and not has_split(require_done(cfg, "data", by="rl"), "eval"):
        print(f"rl: no eval during RL: rl.eval_set={HELD_OUT} and the data has no held-out split (eval.parquet)",
              file=sys.stderr)
        return None
    return EvalDuringRL(cfg, stage_dir, resume_step)


def has_split(data_dir: Path, split: str) -> bool:
    """Whether the data manifest lists the split; True when it cannot be read (reading the split says why)."""
    try:
        files = json.loads((Path(data_dir) / "data_manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return not isinstance(files, dict) or f"{split}.parquet" in files


def clear(stage_dir: Path) -> None:
    """A fresh run (no checkpoint to resume) in a folder: no records or samples of an earlier run stay."""
    (Path(stage_dir) / RECORDS).unlink(missing_ok=True)
    shutil.rmtree(Path(stage_dir) / SAMPLES, ignore_errors=True)


def due(step: int, rl) -> bool:
    return rl.eval_every > 0 and (step % rl.eval_every == 0 or step == rl.max_steps)


class EvalDuringRL:
    """Rank 0's evals of one RL run: the rows, the record file, and the steps it already holds."""

    def __init__(self, cfg, stage_dir: Path, resume_step: int | None):
        """resume_step: the step of the checkpoint the run resumes from, None for a fresh run (clear() first)."""
        self.rl = cfg.rl
        self.path = Path(stage_dir) / RECORDS
        self.samples_root = Path(stage_dir) / SAMPLES
        self.resume_step = resume_step
        records = read_records(self.path)
        if self.path.exists():  # a resumed run continues the file: its whole records, each once
            write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        self.log = MetricsLog(self.path, resume_step=max([r["step"] for r in records], default=0))
        self.done = {r["step"] for r in records}
        self.rows = eval_rows(cfg)
        self.ecfg = eval_config(cfg)

    def due(self, step: int) -> bool:
        return due(step, self.rl) and step not in self.done

    def run(self, engine: SharedEngine, tokenizer, step: int, context: int | None) -> dict | None:
        """Evaluate the engine's current policy (version `step`), append the record and return it; None when a
        stop cut it short (the resumed run evaluates this step again)."""
        out = self.samples_root / f"step_{step:06d}"
        if step != self.resume_step:  # samples of an abandoned attempt were drawn from other weights
            shutil.rmtree(out, ignore_errors=True)
        k = self.ecfg.samples
        t0, busy0 = time.perf_counter(), engine.eval_busy_s
        try:
            res = evaluate(engine, tokenizer, self.rows, self.ecfg, out, desc=f"rl eval step {step}",
                           context=context)
        except EvalStopped:
            print(f"rl: the eval at step {step} was stopped; a resumed run evaluates it again")
            return None
        records, _ = problem_records(out / "samples.jsonl", self.rows, k)
        envs = res["env"]
        record = {"step": step, "set": self.rl.eval_set, "k": k, "problems": len(records),
                  f"avg@{k}": _mean([e[f"avg@{k}"] for e in envs.values()]),
                  f"pass@{k}": _mean([e.get(f"pass@{k}", 0.0) for e in envs.values()]),
                  "pass@1": _mean([e.get("pass@1", 0.0) for e in envs.values()]),
                  "avg_over_problems": summarize([r["scores"] for r in records], [k]).get(f"avg@{k}"),
                  "by_env": {e: v[f"avg@{k}"] for e, v in envs.items()},
                  "policy_version": engine.policy_version, "temperature": self.ecfg.temperature,
                  "max_new_tokens": self.ecfg.max_new_tokens, "seed": self.ecfg.seed,
                  "mean_completion_tokens": res.get("mean_completion_tokens"),
                  "masked_problems": res.get("masked_problems", 0),
                  "skipped_too_long": res.get("skipped_too_long", 0),
                  "seconds": time.perf_counter() - t0, "engine_busy_s": engine.eval_busy_s - busy0}
        self.log.log(record)
        self.done.add(step)
        scores = (f"avg@{k} {record[f'avg@{k}']:.3f}, pass@{k} {record[f'pass@{k}']:.3f}" if records else
                  "no problem judged")
        print(f"rl: eval at step {step}: {self.rl.eval_set} {scores} over {len(records)} problems "
              f"({record['seconds']:.1f} s)")
        return record


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def read_records(path: Path) -> list[dict]:
    """The records of eval_during_rl.jsonl (a line cut by a kill is skipped), by step, one a step."""
    out: list[dict] = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return sorted({r["step"]: r for r in out}.values(), key=lambda r: r["step"])
