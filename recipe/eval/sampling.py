"""The eval's sampling settings and where each comes from.

The release evals (prime-rl `configs/int3/eval/full-eval.toml`) set max_tokens and nothing else: temperature,
top_p and top_k are left unset (prime-rl's EvalSamplingConfig defaults them to None and sends only what is set),
so vLLM, serving with its default `--generation-config auto`, takes them from the model folder's
generation_config.json, and a request without max_tokens may run to the end of the context. This module does
the same on the client side, so that every setting is known and recorded with its source:

    config                     the eval config: eval.benchmarks[i] first, then eval (recipe/config.py)
    registry                   the benchmark's own value in recipe/eval/benchmarks.py
    generation_config.json     the model folder's file (the keys vLLM's `auto` reads: temperature, top_p, top_k,
                               max_new_tokens), when nothing above sets the value
    default                    vLLM's neutral value when the file does not set it either: temperature 1, top_p 1,
                               top_k -1 (none)
    context                    max_new_tokens set nowhere: the model's context less the benchmark's longest
                               prompt, so that every prompt plus max_new_tokens fits (vLLM's own bound is per
                               request; one value a benchmark keeps its samples independent of the batching)

A max_new_tokens from generation_config.json is bounded the same way (source `generation_config.json, bounded
by the context` when the bound bites). A configured one is taken as it stands: a prompt it does not leave room
for is skipped and counted (recipe/eval/runner.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from recipe import hub
from recipe.errors import StageError

KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}  # vLLM's SamplingParams defaults
GENERATION_CONFIG = "generation_config.json"
CONFIG, REGISTRY, DEFAULT, CONTEXT = "config", "registry", "default", "context"
BOUNDED = f"{GENERATION_CONFIG}, bounded by the context"


def read_generation_config(model, revision: str | None = None) -> dict:
    """The sampling keys (KEYS) the model's generation_config.json sets: a local folder's file, or a hub model's
    at `revision` (through the HF cache; offline, the cache alone). {} when the model has no such file; a file
    that cannot be had or read is an error, not a silent fallback to the defaults."""
    local = Path(str(model))
    if local.is_dir():
        path = local / GENERATION_CONFIG
        if not path.is_file():
            return {}
        where = str(path)
    else:
        path, where = _hub_file(str(model), revision), f"{model}@{revision}/{GENERATION_CONFIG}"
        if path is None:
            return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"eval: {where} does not read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise StageError(f"eval: {where} is not a JSON object")
    return {k: data[k] for k in KEYS if data.get(k) is not None}


def _hub_file(repo: str, revision: str | None) -> str | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    if not revision:
        raise StageError(f"eval: model {repo}: no revision given; every hub reference must be pinned")
    try:
        return hf_hub_download(repo, GENERATION_CONFIG, revision=revision, local_files_only=hub.offline())
    except RemoteEntryNotFoundError:  # the repository has no such file
        return None
    except LocalEntryNotFoundError:  # offline, and not in the cache
        raise StageError(f"eval: {GENERATION_CONFIG} of {repo}@{revision} is not in the local HF cache (offline "
                         f"mode is on; {hub.HOWTO})") from None
    except Exception as e:  # connection, gated repository, bad revision
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StageError(f"eval: cannot read {GENERATION_CONFIG} of {repo}@{revision}: {type(e).__name__}: "
                         f"{first[:200]}") from None


def resolve(layers: list[tuple[str, object]], generation: dict) -> dict:
    """{key: value, key_source: source} for every KEYS entry. layers: (source, object with the keys as
    attributes, None = unset), first wins; then generation_config.json's values, then NEUTRAL. A max_new_tokens
    set nowhere stays None with source `context` (fit_max_new_tokens sets it once the context is known)."""
    out = {}
    for key in KEYS:
        for source, obj in layers:
            value = getattr(obj, key, None)
            if value is not None:
                break
        else:
            if generation.get(key) is not None:
                source, value = GENERATION_CONFIG, generation[key]
            elif key in NEUTRAL:
                source, value = DEFAULT, NEUTRAL[key]
            else:
                source, value = CONTEXT, None
        out[key], out[f"{key}_source"] = _typed(key, value), source
    return out


def _typed(key: str, value):
    if value is None:
        return None
    return int(value) if key in ("top_k", "max_new_tokens") else float(value)


def fit_max_new_tokens(sampling: dict, longest_prompt: int, context: int | None) -> dict:
    """sampling with max_new_tokens bound to the context when it does not come from the config: the context
    less the longest prompt (source `context`), or generation_config.json's value if that is smaller."""
    source = sampling["max_new_tokens_source"]
    if source in (CONFIG, REGISTRY):
        return sampling
    if context is None:
        if sampling["max_new_tokens"] is None:
            raise StageError("eval: max_new_tokens is set nowhere (eval config, generation_config.json) and the "
                             "engine does not say the model's context: set eval.max_new_tokens")
        return sampling
    room = context - longest_prompt
    if room < 1:
        raise StageError(f"eval: the longest prompt ({longest_prompt} tokens) leaves no room in the model's "
                         f"context ({context})")
    value = sampling["max_new_tokens"]
    if value is None:
        return {**sampling, "max_new_tokens": room, "max_new_tokens_source": CONTEXT}
    if value > room:
        return {**sampling, "max_new_tokens": room, "max_new_tokens_source": BOUNDED}
    return sampling
