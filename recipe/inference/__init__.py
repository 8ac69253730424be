"""Generation engines behind one interface: token ids in, completion token ids and per-token logprobs out.

hf: transformers generation (in-process, or in a process of its own for RL so generation overlaps training).
vllm: a `vllm serve` child process spoken to over its OpenAI-compatible /v1/completions endpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_new_tokens: int = 96
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each completion token under the sampling distribution
    finish_reason: str = "stop"  # stop | length
    policy_version: int = 0
    extra: dict = field(default_factory=dict)
