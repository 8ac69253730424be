"""Generation engines behind one contract (recipe.inference.engine): token ids in, completion token ids and
per-token logprobs out, weights swapped by path and version.

hf: transformers with a KV-cached decode loop of its own, in-process (eval) or in a process of its own (RL, so
generation overlaps training). vllm: one or more vLLM servers spoken to over HTTP. serve: the hf engine
behind the same HTTP endpoints, a CPU stand-in for `vllm serve` where vLLM is not installed.
"""
from recipe.inference.engine import Cancelled, Done, Engine, Event, Generator, Request
from recipe.rollout import Completion, SamplingParams

__all__ = ["Cancelled", "Completion", "Done", "Engine", "Event", "Generator", "Request", "SamplingParams"]
