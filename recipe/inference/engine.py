"""The engine contract: what the orchestrator (RL) and the eval runner may ask of any generation engine.

An asynchronous engine (RL) takes Requests, hands back events, and swaps weights while it runs:

    submit([Request])              queue requests; each carries the policy version current when it was made
    poll(timeout) -> Event | None  the next event: Done (finished completions) or Cancelled (requests that
                                   waited past max_off_policy_steps policy versions; the orchestrator
                                   reschedules them; an engine given max_off_policy_steps=None cancels
                                   nothing by itself); None after timeout. An engine that died raises.
    cancel([request id])           drop these requests, queued or running (a running one is stopped where
                                   the engine can: between decode steps, or by closing its connection); no
                                   event is promised for them, and a Done already on its way may still come
    update_weights(path, version)  load the state dict published at `path` (a safetensors file, or a folder of
                                   shards with its index: recipe.weights) as policy `version`; completions
                                   finished from then on carry it
    policy_version                 the version of the weights last sent
    close()                        stop the engine and every process it started

A synchronous engine (eval) has generate(prompts, params) -> [Completion] and a tokenizer.
Implementations: recipe.inference.hf (HFEngine, in-process), recipe.inference.worker (HFEngineProcess, the hf
engine in a process of its own), recipe.inference.vllm (a vLLM server, or several).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

from recipe.rollout import Completion, SamplingParams


@dataclass(frozen=True)
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    submitted_version: int


@dataclass(frozen=True)
class Done:
    """Requests that finished: (request id, completion) pairs, and the engine's busy seconds they cost."""

    results: list[tuple[int, Completion]]
    busy_s: float = 0.0


@dataclass(frozen=True)
class Cancelled:
    """Requests dropped for staleness, to be rescheduled by whoever submitted them."""

    request_ids: list[int]


Event = Union[Done, Cancelled]


@runtime_checkable
class Engine(Protocol):
    policy_version: int

    def submit(self, requests: list[Request]) -> None: ...

    def poll(self, timeout: float | None = None) -> Event | None: ...

    def cancel(self, request_ids: list[int]) -> None: ...

    def update_weights(self, path: str | Path, version: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Generator(Protocol):
    tokenizer: object

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...
