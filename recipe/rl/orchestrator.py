"""The orchestrator: keeps groups of rollouts in flight on the engine and hands the trainer scored batches.

- Continuous batching: a group (rollouts_per_example samples of one prompt) is submitted as soon as there is
  room, and each finished group makes room for the next.
- max_async_level=0 is run to be reproducible bit for bit (see "Level 0" below).
- Every completion carries the policy version that wrote it. How old a group may be is rl.staleness:
  - drop_stale: the batch for trainer step s only takes groups written by version >= s - max_async_level; older
    finished ones are dropped and counted as stale (groups_stale). The engine itself cancels a request that
    waited past max_off_policy_steps versions before it ran (a Cancelled event; the same samples are resent).
  - prime_rl, as prime-rl's orchestrator does at PR 1272 (src/prime_rl/orchestrator/scheduler.py, below "s.py"):
    - the orchestrator assembles batches itself, ahead of the trainer: each finished group is taken into the
      batch of the orchestrator's step s as it comes and a new group is submitted in its place at once
      (s.py:187-204), and once batch s is full the orchestrator goes on to step s + 1 (orchestrator.py:201,
      245-265 and 412: it writes batch s for the trainer and goes on), whether or not the trainer has taken
      batch s. Nothing is taken into batch s, and nothing new submitted, before the weights of step
      s - max_async_level are on the engine (s.py:127-140, strict_async_level = true,
      orchestrator/config.py:541-546: step s waits for checkpoint s - max_async_level). So at level 1 the
      groups of batch s + 1 are submitted under policy s - 1 while the trainer works on step s - 1 or s (a group
      that finishes behind later ones joins a later batch, older still), and the engine has up to two batches
      of work ahead of the trainer;
    - every group in flight counts the weight updates it lives through; at an update, a group whose count is
      already > max_off_policy_steps is cancelled on the engine, running requests included, and a new group is
      submitted in its place; the others count one more (s.py:152-172). So a group lives through
      max_off_policy_steps + 1 updates and is cancelled at the next one. (prime-rl cancels the group's asyncio
      task, s.py:158: its HTTP requests are dropped and vLLM aborts them; here Engine.cancel does it.)
    - a finished group is never dropped for its age: each goes into the next batch (s.py:187-204);
    - batch_size groups are kept in flight or finished and not yet taken into a batch (s.py:48
      problems_per_batch, oversampling_factor 1.0 in production; s.py:182-183). prime-rl lets all their
      requests run at once (max_concurrent = 4096 = 256 x 16, configs/int3/prod/orch.toml:5, a semaphore:
      orchestrator.py:164-166); here the engine's client caps them at rl.gen_batch_size, 4096 in intellect3.
  max_async_level=0 is the synchronous baseline under either rule: nothing is submitted ahead of the weights it
  must use (prime-rl's level 0 still keeps its groups in flight across the update; here it does not).
- Filters: the offline pass-rate filter is `make data`'s (data.max_pass_rate): the rows come filtered. Online
  (rl.online_filter), groups whose rewards are all equal (all 0 or all 1) carry no signal and are dropped. Without
  the online filter (prime-rl's production run) such a group stays in the batch: advantage 0, its tokens in the
  loss's count.
- The context: the least of the model's max_position_embeddings and the server's (given as `context`) and
  rl.seq_len. A request asks for at most min(max_new_tokens, context - its prompt's tokens) new tokens, so a
  sample's prompt + completion never exceed it. A prompt that leaves no room for one new token never enters: such
  prompts are counted and left out at start, with one line. A multi-turn sample whose next turn would have no
  room ends there, truncated (recipe.rollout.next_reply), and is counted.
- A sample the verifier could not judge (a sandbox or tool failure) is masked, or scores 0 with
  rl.mask_sandbox_failures=false (prime-rl has no sample masking); both are counted.
- Advantage = reward - mean reward of the group (no division by the std).
- start() moves the event loop (polling the engine, tool turns, scoring, top-ups) to a thread of its own, so
  that the next tool turn is submitted and rollouts are scored while the trainer works: neither a sandbox run nor
  a tool call sits between two optimizer steps. Without start(), next_batch polls the engine itself (tests).

Level 0 (max_async_level=0): a run repeats bit for bit. Which requests share an engine batch decides the logits
of each row to ~1e-7 on CPU (padding width, batch size), and those enter the loss through the importance ratio,
so the batches themselves must repeat, not only the sampled tokens (each request has its own seed). So at level 0:
  - exactly the groups still needed are submitted (ready + in flight == need: no allowance for filtering);
  - every request made while one engine event is handled (tool-turn continuations, replacements of filtered
    groups, top-ups) goes to the engine in one submit call at the end of it, and only once every request sent
    before has come back: the engine process takes one submit call as its pending set, so each engine batch is
    that set (split in gen_batch_size chunks, first in first out), the same in every run;
  - a batch holds its groups in group-id order; nothing is left in flight when it is full, so nothing is
    stale or cancelled when the weights change, and no decision reads the clock.
Levels 1 and 2 submit each request at once and keep the filter allowance: the engine is never left waiting.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from recipe.chat import completion_text, encode_prompt
from recipe.envs import RewardResult, get_env
from recipe.envs.judge import judge_from_config
from recipe.errors import ConfigError, StageError
from recipe.inference.engine import Cancelled, Done, Engine, Event, Request
from recipe.rollout import Completion, SamplingParams, Transcript, next_reply, score_in_threads, score_sample


@dataclass
class Group:
    gid: int
    row: dict
    prompt_ids: list[int]
    submitted_version: int
    completions: dict = field(default_factory=dict)  # sample index -> Completion
    rewards: list = field(default_factory=list)
    masked: list = field(default_factory=list)  # per sample: the verifier could not judge it (e.g. sandbox down)
    texts: list = field(default_factory=list)
    transcripts: dict = field(default_factory=dict)  # sample index -> Transcript (multi-turn envs only)
    off_policy_steps: int = 0  # staleness prime_rl: weight updates it lived through while in flight

    @property
    def version(self) -> int:
        """The oldest policy that wrote any of its samples."""
        return min(c.policy_version for c in self.completions.values())


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    advantage: float
    reward: float
    policy_version: int
    env: str


class Orchestrator:
    def __init__(self, rows: list[dict], tokenizer, rl_cfg, engine: Engine, seed: int, context: int | None = None):
        """`context`: the model's max_position_embeddings (or less, the server's); rl.seq_len bounds it too.
        None and no rl.seq_len: prompts are not checked and requests are not capped."""
        # a plain RLConfig: reading a field of an OmegaConf node costs about 30 us, and the event loop reads them for
        # every request it makes (about 1 s of the trainer's core over bench-trl's recipe arm: docs/performance.md)
        self.cfg = OmegaConf.to_object(rl_cfg) if isinstance(rl_cfg, DictConfig) else rl_cfg
        self.engine = engine
        self.prime_rl = rl_cfg.staleness == "prime_rl"  # (a StrEnum of recipe.config: equal to its string)
        self._seen_version = engine.policy_version  # prime_rl: the updates counted so far end here
        self._step = 0  # prime_rl: the step whose batch is being assembled (the async gate)
        # prime_rl at max_async_level >= 1 assembles batches itself, ahead of the trainer (_assemble)
        self.pipelined = self.prime_rl and rl_cfg.max_async_level > 0
        self._assembly_started = False  # from the first next_batch, which says the step it starts at
        self._assembling: list[Group] = []  # groups taken into the batch of step _step, in finishing order
        self._batches: deque[list[Group]] = deque()  # assembled batches the trainer has not taken yet
        self.tokenizer = tokenizer
        self.too_long = 0
        bounds = [c for c in (context, rl_cfg.seq_len) if c is not None]
        self.context = min(bounds) if bounds else None
        if self.context is not None:
            what = (f"the model's context ({context})" if rl_cfg.seq_len is None else
                    f"rl.seq_len ({rl_cfg.seq_len})" if context is None else
                    f"the context ({self.context}: the least of the model's {context} and rl.seq_len {rl_cfg.seq_len})")
            fit = [r for r in rows if len(encode_prompt(tokenizer, r["prompt"])) < self.context]
            self.too_long = len(rows) - len(fit)
            if rows and not fit:
                raise StageError(f"rl: every one of the {len(rows)} RL prompts leaves no room for a completion in "
                                 f"{what}: raise rl.seq_len or use a model with a longer context")
            if self.too_long:
                print(f"rl: left out {self.too_long} of {len(rows)} prompts that leave no room for a completion in "
                      f"{what}", file=sys.stderr)
            rows = fit
        self.rows = {}
        for r in rows:
            self.rows.setdefault(r["env"], []).append(r)
        unknown = sorted(set(rl_cfg.env_mix) - set(self.rows))
        if unknown:
            raise ConfigError(f"rl.env_mix names environment(s) {unknown} with no RL rows "
                              f"(the data has {sorted(self.rows)})")
        judge = judge_from_config(getattr(rl_cfg, "judge", None))  # math and science re-check rule negatives
        code = {"max_tests": rl_cfg.code_max_tests, "partial_credit": rl_cfg.code_partial_credit}
        self.envs = {name: get_env(name, judge=judge, **(code if name == "code" else {})) for name in self.rows}
        self.mix = [(e, w) for e, w in rl_cfg.env_mix.items() if w > 0]
        self.rng = random.Random(seed)
        self.cursor = {e: 0 for e in self.rows}
        self.order = {e: self._shuffled(e, 0) for e in self.rows}
        self.epoch = {e: 0 for e in self.rows}
        self.retired: dict[str, str] = {}  # row id -> easy or hard (rl.easy_border, rl.hard_border)
        self.next_gid = 0
        self.next_rid = 0
        self.inflight: dict[int, Group] = {}
        self.requests: dict[int, tuple[int, int]] = {}  # request id -> (group id, sample index)
        self.outbox: list[Request] = []  # made, not yet sent to the engine (level 0: see the module docstring)
        self.ready: deque[Group] = deque()
        self.counters = Counter()
        self.gen_busy_s = 0.0
        self._last_filtered: list[Group] = []  # groups filtered since the last batch (for its stats)
        self._counters_at_last_batch = Counter()
        self._busy_at_last_batch = 0.0
        self.filter_rate = 0.0
        # background event loop (start()); _cv guards every field above once it runs
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._need = 0  # groups the waiting next_batch still lacks
        self.loop_busy_s = 0.0
        self._loop_busy_at_last_batch = 0.0

    # -- prompts -------------------------------------------------------------------------------------------
    def _shuffled(self, env: str, epoch: int) -> list[int]:
        order = list(range(len(self.rows[env])))
        random.Random(f"{self.cfg.seed}-{env}-{epoch}").shuffle(order)
        return order

    def _next_row(self) -> dict:
        env = self.rng.choices([e for e, _ in self.mix], weights=[w for _, w in self.mix])[0]
        rows = self.rows[env]
        # a retired prompt is passed over; when every prompt of the environment is retired, the next one is drawn
        for _ in range(len(rows)):
            row = self._advance(env)
            if row["id"] not in self.retired:
                return row
        return row

    def _advance(self, env: str) -> dict:
        if self.cursor[env] >= len(self.order[env]):  # a new epoch over this environment's prompts
            self.epoch[env] += 1
            self.order[env] = self._shuffled(env, self.epoch[env])
            self.cursor[env] = 0
        row = self.rows[env][self.order[env][self.cursor[env]]]
        self.cursor[env] += 1
        return row

    def state_dict(self) -> dict:
        with self._cv:  # copies: the event loop draws on while the checkpoint is written
            return {"cursor": dict(self.cursor), "epoch": dict(self.epoch), "rng": self.rng.getstate(),
                    "next_gid": self.next_gid, "counters": dict(self.counters), "filter_rate": self.filter_rate,
                    "retired": dict(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.epoch = dict(state["cursor"]), dict(state["epoch"])
        self.order = {e: self._shuffled(e, self.epoch[e]) for e in self.rows}
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
        self.next_gid = state["next_gid"]
        self.counters = Counter(state["counters"])
        self._counters_at_last_batch = Counter(self.counters)
        self.filter_rate = state.get("filter_rate", 0.0)
        self.retired = dict(state.get("retired", {}))

    # -- scheduling ----------------------------------------------------------------------------------------
    def _params(self, gid: int, prompt_len: int) -> SamplingParams:
        """At most max_new_tokens, and no more than the context leaves after the prompt (the sample so far)."""
        room = self.cfg.max_new_tokens if self.context is None else self.context - prompt_len
        return SamplingParams(max_new_tokens=min(self.cfg.max_new_tokens, room), temperature=self.cfg.temperature,
                              top_p=1.0, seed=self.cfg.seed * 1_000_003 + gid)

    def _submit(self, group: Group, samples: list[int]) -> None:
        for s in samples:
            self.requests[self.next_rid] = (group.gid, s)
            # a multi-turn sample goes on from its transcript so far (also when a later turn is rescheduled)
            prompt = group.prompt_ids + group.transcripts[s].ids if s in group.transcripts else group.prompt_ids
            self.outbox.append(Request(self.next_rid, prompt, self._params(group.gid * 1000 + s, len(prompt)),
                                       self.engine.policy_version))
            self.next_rid += 1
        if self.cfg.max_async_level > 0:  # at once: the engine may start on it while the rest is handled
            self._flush()

    def _flush(self) -> None:
        """Send the requests made so far in one submit call. Level 0: only once every request sent before has
        come back, so that what the engine has pending is exactly this call's requests."""
        if not self.outbox:
            return
        if self.cfg.max_async_level == 0 and len(self.requests) > len(self.outbox):
            return  # the engine still works on requests sent before: held until they are back
        reqs, self.outbox = self.outbox, []
        self.engine.submit(reqs)

    def _submit_new_group(self) -> None:
        row = self._next_row()
        g = Group(self.next_gid, row, encode_prompt(self.tokenizer, row["prompt"]), self.engine.policy_version)
        self.next_gid += 1
        self.inflight[g.gid] = g
        self._submit(g, list(range(self.cfg.rollouts_per_example)))
        self.counters["groups_submitted"] += 1

    def _top_up(self, need: int) -> None:
        """Keep `need` groups for the current batch plus max_async_level batches ahead in flight or ready
        (prime_rl: batch_size groups, as prime-rl does).

        With max_async_level=0 nothing runs ahead: the next batch is submitted only after the weights it must
        be sampled with have been sent to the engine.
        """
        self._watch_updates()
        if self._gate_closed():
            return
        # groups in flight come back filtered at about the recent rate: submit until the expected number of
        # usable groups (ready ones count in full) covers the want, so the engine is not left idle waiting for
        # replacements, and no more, since a surplus grows stale in the ready queue. Level 0 submits exactly
        # what is missing: a surplus would make the batch depend on which groups finish first.
        keep = 1.0 - min(self.filter_rate, 0.75) if self.cfg.max_async_level > 0 else 1.0
        want = need + self.cfg.batch_size * self.cfg.max_async_level
        if self.prime_rl and self.cfg.max_async_level > 0:
            # s.py:48,182-183 and 204: problems_per_batch (= batch_size groups) in flight or finished and not yet
            # taken; one taken into a batch is replaced at once
            want = self.cfg.batch_size
        while len(self.ready) + keep * len(self.inflight) < want:
            self._submit_new_group()

    def _gate_closed(self) -> bool:
        """prime_rl's async gate: while the batch of step s is assembled, nothing is taken into it and nothing
        new is submitted before policy s - max_async_level is on the engine (s.py:127-140: with
        strict_async_level the orchestrator's step s waits for checkpoint s - max_async_level)."""
        return self.prime_rl and self.engine.policy_version < self._step - self.cfg.max_async_level

    def _assemble(self) -> bool:
        """prime_rl at max_async_level >= 1: take finished groups into the batch of step _step as they come, and go
        on to the next step once it is full (the module docstring: prime-rl's generate_batch and loop), without
        waiting for the trainer to take the batch. So the groups that replace batch s's are in flight while the
        trainer still works on step s - 1: up to two batches of work ahead of the trainer, against one when a
        group joins a batch only once the trainer asks for it (which left the engine idle about 0.1 s of a 0.7 s
        step in bench-trl's recipe arm: docs/performance.md). The gate bounds it: no group joins batch s before
        policy s - max_async_level is on the engine. True when a batch got full."""
        full = False
        if not (self.pipelined and self._assembly_started):
            return full
        while self.ready and not self._gate_closed():
            self._assembling.append(self.ready.popleft())
            self._submit_new_group()  # its replacement, also for the group that fills the batch (s.py:197-204)
            if len(self._assembling) == self.cfg.batch_size:
                self._batches.append(self._assembling)
                self._assembling = []
                self._step += 1
                full = True
        return full

    def _watch_updates(self) -> None:
        """prime_rl: count the weight updates every group in flight lives through, and at an update cancel and
        replace those that already lived through more than max_off_policy_steps (s.py:152-172). An update is a
        new engine.policy_version; the RL loop sends versions one apart (a jump of k counts k updates)."""
        version = self.engine.policy_version
        updates, self._seen_version = version - self._seen_version, version
        if not self.prime_rl or updates <= 0:
            return
        cancelled = 0
        for _ in range(updates):
            for g in list(self.inflight.values()):
                if g.off_policy_steps > self.cfg.max_off_policy_steps:  # s.py:157
                    self._cancel(g)
                    cancelled += 1
                else:
                    g.off_policy_steps += 1  # s.py:161,169-170
        for _ in range(cancelled):  # s.py:164-166: a new group (a new prompt) in each one's place, at once
            self._submit_new_group()
            self.counters["groups_rescheduled"] += 1
        if cancelled:
            print(f"rl: cancelled and rescheduled {cancelled} group(s) in flight across more than "
                  f"{self.cfg.max_off_policy_steps + 1} weight updates", file=sys.stderr)

    def _cancel(self, group: Group) -> None:
        """Drop a group in flight: its requests not yet sent never go, those sent are cancelled on the engine
        (running ones included); whatever of them still comes back is ignored."""
        rids = {rid for rid, (gid, _) in self.requests.items() if gid == group.gid}
        for rid in rids:
            del self.requests[rid]
        unsent = {r.id for r in self.outbox if r.id in rids}
        self.outbox = [r for r in self.outbox if r.id not in unsent]
        if rids - unsent:
            self.engine.cancel(sorted(rids - unsent))
        del self.inflight[group.gid]
        self.counters["groups_cancelled_off_policy"] += 1
        self.counters["requests_cancelled_off_policy"] += len(rids)

    def _handle(self, event: Event) -> None:
        t0 = time.perf_counter()
        self._watch_updates()  # an update seen first: a group it cancels does not finish on this event
        self._on_event(event)  # scoring and tool turns: in the background loop, time spent beside the trainer
        self._assemble()  # (before the top-up: a group taken into a batch is replaced in the same submit)
        # replacements for the groups this event filtered go out with its tool turns, in one submit (level 0)
        self._top_up(self._need)
        self._flush()
        self.loop_busy_s += time.perf_counter() - t0

    def _on_event(self, event: Event) -> None:
        if isinstance(event, Done):
            self.gen_busy_s += event.busy_s
            for rid, completion in event.results:
                if rid not in self.requests:  # its group was cancelled (prime_rl) before this came back
                    self.counters["results_of_cancelled_requests"] += 1
                    continue
                gid, s = self.requests.pop(rid)
                group = self.inflight[gid]
                env = self.envs[group.row["env"]]
                if env.multi_turn:
                    t = group.transcripts.setdefault(s, Transcript())
                    t.add_model(completion)
                    # the transcript may grow while the next turn has room for one token (its request is capped)
                    room = None if self.context is None else self.context - len(group.prompt_ids) - 1
                    reply = next_reply(env, self.tokenizer, t, group.row, room)
                    if reply is not None:  # a tool call: the environment answers and the sample goes on
                        t.add_env(reply)
                        self.counters["tool_calls"] += 1
                        self._submit(group, [s])
                        continue
                    if t.out_of_context:  # the next turn would not fit: truncated, scored as it stands
                        self.counters["samples_out_of_context"] += 1
                    completion = t.completion()
                group.completions[s] = completion
                if len(group.completions) == self.cfg.rollouts_per_example:
                    del self.inflight[gid]
                    self._score(group)
        elif isinstance(event, Cancelled):  # too stale on the engine: reschedule the same samples
            by_group: dict[int, list[int]] = {}
            for rid in event.request_ids:
                if rid not in self.requests:  # its group was cancelled already (prime_rl)
                    continue
                gid, s = self.requests.pop(rid)
                by_group.setdefault(gid, []).append(s)
            for gid, samples in by_group.items():
                self.counters["requests_cancelled"] += len(samples)
                self._submit(self.inflight[gid], samples)

    def _score(self, group: Group) -> None:
        env = self.envs[group.row["env"]]

        def score_one(c: Completion):
            return score_sample(env, completion_text(self.tokenizer, c.token_ids), group.row, c)

        completions = [group.completions[s] for s in range(self.cfg.rollouts_per_example)]
        for res in score_in_threads(score_one, completions, lambda c: env.score_in_parallel):
            if res.errors:
                self.counters["reward_errors"] += len(res.errors)
            self.counters.update(res.counts)  # the judge's calls, flips and errors
            if res.masked and not self.cfg.mask_sandbox_failures:  # prime-rl: no masking, scored as a wrong answer
                self.counters["samples_unjudged_scored_0"] += 1
                res = RewardResult(reward=0.0, metrics=res.metrics, errors=res.errors)
            if res.masked:  # not a wrong answer: the sample leaves the loss and the group mean
                self.counters["samples_masked"] += 1
            group.rewards.append(res.reward)
            group.masked.append(res.masked)
        judged = [r for r, m in zip(group.rewards, group.masked) if not m]
        if judged:  # the prompt's difficulty pool, as its group's mean reward says (prime-rl: the mean too)
            mean = sum(judged) / len(judged)
            pool = ("easy" if self.cfg.easy_border is not None and mean > self.cfg.easy_border else
                    "hard" if self.cfg.hard_border is not None and mean < self.cfg.hard_border else None)
            if pool:
                if group.row["id"] not in self.retired:  # counted once, however often it is judged again
                    self.counters[f"prompts_retired_{pool}"] += 1
                self.retired[group.row["id"]] = pool
        flat = len(set(judged)) <= 1
        if flat:
            self.counters["groups_without_signal"] += 1
        drop = flat and self.cfg.online_filter
        self.filter_rate = 0.9 * self.filter_rate + 0.1 * drop  # running share of groups filtered out
        if drop:  # no signal: every sample got the same reward
            self.counters["filtered_all_correct" if judged and judged[0] >= 1 else "filtered_all_wrong"] += 1
            self.counters["rollouts_filtered"] += len(group.rewards)
            self._last_filtered.append(group)
            return
        self.ready.append(group)

    # -- what is under way (read by tests and monitoring) -----------------------------------------------
    @property
    def in_flight_groups(self) -> int:
        """Groups submitted to the engine whose samples are not all finished and scored yet."""
        with self._cv:
            return len(self.inflight)

    @property
    def ready_groups(self) -> int:
        """Scored groups with signal the trainer has not taken yet (prime_rl: those already assembled into the
        next batches too)."""
        with self._cv:
            return len(self.ready) + len(self._assembling) + sum(map(len, self._batches))

    @property
    def running(self) -> bool:
        """Whether the background event loop (start()) is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- the background event loop ----------------------------------------------------------------------
    def start(self) -> None:
        """Run the event loop in a thread; next_batch then only waits for scored groups."""
        self._thread = threading.Thread(target=self._loop, daemon=True, name="orchestrator")
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            with self._cv:
                self._stop = True
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        return
                    if self._assemble():  # the gate opened: new weights are on the engine
                        self._cv.notify_all()
                    self._top_up(self._need)
                    self._flush()
                event = self.engine.poll(timeout=0.05)
                if event is not None:
                    with self._cv:
                        self._handle(event)
                        self._cv.notify_all()
        except BaseException as e:  # handed to the trainer's thread, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _wait_for(self, done) -> None:
        """Block until done() (a scored group ready, or an assembled batch) holds (background loop), or poll the
        engine once (foreground)."""
        if self._thread is None:
            self._top_up(self._need)
            self._flush()
            if self._gate_closed() and not self.requests and not self.outbox:  # nothing can come
                raise RuntimeError(f"rl: the batch for step {self._step} waits for policy version "
                                   f"{self._step - self.cfg.max_async_level} (max_async_level "
                                   f"{self.cfg.max_async_level}) but the engine has {self.engine.policy_version}: "
                                   f"send the weights first")
            event = self.engine.poll(timeout=600)
            if event is None:
                raise RuntimeError("rl: the engine produced nothing for 600 s")
            self._handle(event)
            return
        deadline = time.monotonic() + 600
        while not done() and self._error is None:
            if not self._thread.is_alive():
                raise RuntimeError("rl: the orchestrator's event loop stopped")
            if time.monotonic() > deadline:
                raise RuntimeError("rl: the engine produced nothing for 600 s")
            self._cv.wait(timeout=1.0)
        if self._error is not None:
            raise RuntimeError(f"rl: the orchestrator's event loop failed: {self._error!r}") from self._error

    def next_batch(self, step: int) -> tuple[list[Sample], dict]:
        """Block until batch_size usable groups exist for trainer step `step`; returns samples and stats."""
        t0 = time.perf_counter()
        with self._cv:
            batch = self._assembled_batch(step) if self.pipelined else self._take_ready(step)
            if self._thread is None:  # (the background loop tops up by itself)
                self._top_up(0)  # the next batches' groups generate while the trainer works on this one
                self._flush()
            batch.sort(key=lambda g: g.gid)  # the trainer's sample order does not depend on finishing order
            stats = self._batch_stats(batch, step, t0)
        return self._samples(batch), stats

    def _assembled_batch(self, step: int) -> list[Group]:
        """prime_rl at max_async_level >= 1: the oldest batch the orchestrator assembled (_assemble), once there is
        one. The first call says which step assembly starts at (a resumed run's first step)."""
        if not self._assembly_started:
            self._step, self._assembly_started = step, True
        self._assemble()  # (the gate may have opened since: new weights; after this, events assemble)
        while not self._batches:
            self._wait_for(lambda: self._batches)
        batch = self._batches.popleft()
        # a trainer that skips steps (tests) moves assembly on with it
        self._step = max(self._step, step + 1)
        return batch

    def _take_ready(self, step: int) -> list[Group]:
        """Ready groups taken into the batch of `step` as the trainer asks for it (drop_stale: those new enough)."""
        min_version = step - self.cfg.max_async_level
        batch: list[Group] = []
        self._step = step
        while len(batch) < self.cfg.batch_size:
            while self.ready and len(batch) < self.cfg.batch_size:
                g = self.ready.popleft()
                if g.version < min_version and not self.prime_rl:  # prime_rl: s.py:187-204 takes it
                    self.counters["groups_stale"] += 1
                else:
                    batch.append(g)
            if len(batch) == self.cfg.batch_size:
                break
            self._need = self.cfg.batch_size - len(batch)
            self._wait_for(lambda: self.ready)
        self._need = 0
        self._step = step + 1  # what is submitted from now on is for the next batches
        return batch

    def _samples(self, batch: list[Group]) -> list[Sample]:
        samples = []
        for g in batch:
            judged = [r for r, m in zip(g.rewards, g.masked) if not m]
            mean = sum(judged) / len(judged)
            for s in range(self.cfg.rollouts_per_example):
                c = g.completions[s]
                keep = 0 if g.masked[s] else 1  # c.loss_mask: 0 on environment (tool) tokens
                samples.append(Sample(g.prompt_ids, c.token_ids, c.logprobs, [m * keep for m in c.loss_mask],
                                      (g.rewards[s] - mean) * keep, g.rewards[s], c.policy_version, g.row["env"]))
        return samples

    def _batch_stats(self, batch: list[Group], step: int, t0: float) -> dict:
        """Stats of this batch and of everything scored since the previous one (filtered groups included)."""
        delta = self.counters - self._counters_at_last_batch
        all_groups = batch + sorted(self._last_filtered, key=lambda g: g.gid)
        all_rewards = [r for g in all_groups for r, m in zip(g.rewards, g.masked) if not m] or [0.0]
        versions = Counter(step - c.policy_version for g in batch for c in g.completions.values())
        stats = {
            "wait_s": time.perf_counter() - t0,
            "gen_busy_s": self.gen_busy_s - self._busy_at_last_batch,
            "orchestrator_busy_s": self.loop_busy_s - self._loop_busy_at_last_batch,
            "reward": sum(all_rewards) / len(all_rewards),
            "pass_rate": sum(r >= 1 for r in all_rewards) / len(all_rewards),
            "filtered_groups": delta["filtered_all_correct"] + delta["filtered_all_wrong"],
            "filtered_all_correct": delta["filtered_all_correct"],
            "filtered_all_wrong": delta["filtered_all_wrong"],
            "groups_without_signal": delta["groups_without_signal"],  # filtered or (no online filter) kept
            # prompts retired as easy or hard (rl.easy_border, rl.hard_border) since the last batch: passed over after
            "retired_easy": delta["prompts_retired_easy"],
            "retired_hard": delta["prompts_retired_hard"],
            "stale_groups": delta["groups_stale"],
            "cancelled_requests": delta["requests_cancelled"],
            # prime_rl: groups cancelled in flight for living through too many weight updates, and the new groups
            # submitted in their place; the most and mean updates lived through by the groups now in flight
            # (prime-rl's batch/off_policy_level/max and /mean, s.py:212-229)
            "cancelled_groups": delta["groups_cancelled_off_policy"],
            "rescheduled_groups": delta["groups_rescheduled"],
            "off_policy_level_max": max((g.off_policy_steps for g in self.inflight.values()), default=0),
            "off_policy_level_mean": (sum(g.off_policy_steps for g in self.inflight.values()) /
                                      max(1, len(self.inflight))),
            "reward_errors": delta["reward_errors"],
            "judge_calls": delta["judge_calls"],  # rule-negative answers sent to the LLM judge (rl.judge)
            "judge_flips": delta["judge_flips"],  # ... that it found right
            "judge_errors": delta["judge_errors"],  # ... that it gave no verdict on: the rule's stands
            "masked_samples": delta["samples_masked"],
            "unjudged_scored_0": delta["samples_unjudged_scored_0"],  # rl.mask_sandbox_failures=false
            "tool_calls": delta["tool_calls"],
            "out_of_context_samples": delta["samples_out_of_context"],
            "staleness": dict(sorted(versions.items())),
            "reward_by_env": {e: sum(g.rewards[i] for g in all_groups if g.row["env"] == e
                                     for i in range(len(g.rewards))) /
                              max(1, sum(len(g.rewards) for g in all_groups if g.row["env"] == e))
                              for e in sorted({g.row["env"] for g in all_groups})},
        }
        self._counters_at_last_batch = Counter(self.counters)
        self._busy_at_last_batch = self.gen_busy_s
        self._loop_busy_at_last_batch = self.loop_busy_s
        self._last_filtered = []
        return stats
