"""The rollout protocol every environment and engine shares: a prompt is sampled, a multi-turn environment
replies to tool calls and the model goes on, and the finished sample is scored. Eval and RL both run it.

- SamplingParams and Completion are what an engine takes and gives (recipe.inference.engine).
- Transcript accumulates one sample's turns: model tokens (loss_mask 1) and environment tokens (loss_mask 0,
  logprob 0). Its completion() is the sample the trainer and the eval runner see.
- next_reply asks the environment for its reply to the last model turn; score_sample scores a finished sample
  (masked, whatever its text, when a tool failed rather than the model).
- A transcript that has used up the model's context ends where it stands, as truncated (see next_reply).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from recipe.chat import completion_text
from recipe.envs.base import Environment, MaskSample, RewardResult


@dataclass
class SamplingParams:
    max_new_tokens: int = 96
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = -1  # -1: no top-k (RL never sets it; eval takes it from its config or generation_config.json)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each token under the sampling distribution (0 on env tokens)
    finish_reason: str = "stop"  # stop | length
    policy_version: int = 0  # hf engine: the version it started under; vLLM client: the one when it came back
    loss_mask: list[int] | None = None  # 1 = written by the model (trained), 0 = written by the environment
    turns: int = 1  # model turns
    mask_reason: str | None = None  # set when the sample cannot be judged (a tool failed): it is masked

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.token_ids)
        if len(self.loss_mask) != len(self.token_ids) or len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"completion of {len(self.token_ids)} tokens has {len(self.logprobs)} logprobs and "
                             f"a loss mask of {len(self.loss_mask)}")


@dataclass
class Transcript:
    """One sample's turns so far."""

    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    turns: int = 0
    last_turn: list = field(default_factory=list)
    finish_reason: str = "stop"
    policy_version: int | None = None
    mask_reason: str | None = None
    out_of_context: bool = False  # ended because the next turn would not fit the model's context

    def add_model(self, completion: Completion) -> None:
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.loss_mask += [1] * len(completion.token_ids)
        self.last_turn = list(completion.token_ids)
        self.turns += 1
        self.finish_reason = completion.finish_reason
        v = completion.policy_version
        self.policy_version = v if self.policy_version is None else min(self.policy_version, v)

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def completion(self) -> Completion:
        return Completion(list(self.ids), list(self.logprobs), self.finish_reason, self.policy_version or 0,
                          loss_mask=list(self.loss_mask), turns=self.turns, mask_reason=self.mask_reason)


def distinct_prompts(prompts) -> tuple[list[list[int]], list[int]]:
    """(each distinct prompt once, in first-seen order; for each prompt given, the index of its distinct one): a
    group's samples share their prompt, which the engine prefills and the trainer runs once for all of them."""
    index: dict[tuple, int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], rows


def next_reply(env: Environment, tokenizer, transcript: Transcript, row: dict,
               room: int | None = None) -> list[int] | None:
    """Token ids of the environment's reply to the last model turn, or None when the sample is final.

    `room`: how many tokens the transcript may hold before the next model turn (None: no limit; RL: the context
    less the prompt and one token, the next turn's request being capped to what is left; eval: the context less
    the prompt and max_new_tokens). A reply that would leave the next turn no room ends the sample here, as
    truncated (finish_reason "length", out_of_context): it is scored as it stands, not masked, as prime-rl
    (verifiers' multi-turn rollouts) treats a rollout that ran out of context: a truncated sample.
    """
    if not env.multi_turn or transcript.turns >= env.max_turns or transcript.finish_reason != "stop":
        return None
    try:
        reply = env.tool_reply(completion_text(tokenizer, transcript.last_turn), row)
    except MaskSample as e:  # the sample ends here, masked
        transcript.mask_reason = str(e)
        return None
    if reply is None:
        return None
    ids = tokenizer.encode(reply, add_special_tokens=False)
    if room is not None and len(transcript.ids) + len(ids) > room:
        transcript.finish_reason = "length"
        transcript.out_of_context = True
        return None
    return ids


def score_sample(env: Environment, text: str, row: dict, completion: Completion) -> RewardResult:
    """env.score, except that a sample whose tool failed is masked whatever its text says."""
    if completion.mask_reason:
        return RewardResult(reward=0.0, masked=True, mask_reason=completion.mask_reason)
    return env.score(text, row)


SCORING_THREADS = 4  # sandbox runs wait on a child process: a few at once use both cores


def score_in_threads(score_one, items: list, parallel=lambda item: True) -> list:
    """[score_one(x) for x in items]; the items `parallel` picks (those of environments that run a sandboxed
    process, e.g. code) several at a time, the rest in this thread (math-verify is pure Python)."""
    out = [None] * len(items)
    pooled = [i for i, x in enumerate(items) if parallel(x)]
    if len(pooled) <= 1:
        pooled = []
    in_pool = set(pooled)
    for i, x in enumerate(items):
        if i not in in_pool:
            out[i] = score_one(x)
    if pooled:
        with ThreadPoolExecutor(max_workers=min(SCORING_THREADS, len(pooled)), thread_name_prefix="score") as pool:
            for i, res in zip(pooled, pool.map(score_one, [items[i] for i in pooled])):
                out[i] = res
    return out
