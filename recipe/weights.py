"""Published weights: a state dict as one safetensors file, or, above a size limit, as shards plus an index.

The trainer publishes each policy version this way and every engine reads it back (recipe.inference.hf, the vLLM
worker extension). A large model is not one file: past `max_shard_bytes` the tensors go into
`model-0000k-of-0000n.safetensors` files inside a folder, with `model.safetensors.index.json` mapping each
tensor to its file (the layout transformers' save_pretrained writes, so the folder is also what it reads).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 5 * 2 ** 30  # transformers' default shard size: a 106B model in bf16 is about 43 shards


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_plan(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in shards of at most max_shard_bytes each (a tensor larger than that gets a shard alone),
    in state-dict order, so that a shard holds neighbouring layers."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_weights(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `state` at `path` (a name ending in .safetensors) atomically and return where it went: that file
    when the state fits one shard, else the folder `path` without its suffix, holding the shards and the index.
    Either is written aside and renamed into place, so a reader sees a whole version or none; a failed write
    (a full disk) leaves nothing behind."""
    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    plan = shard_plan(state, max_shard_bytes)
    target = path if len(plan) == 1 else path.with_suffix("")
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if len(plan) == 1:
            save_file(state, tmp)
        else:
            tmp.mkdir(parents=True)
            weight_map = {}
            for i, names in enumerate(plan, 1):
                shard = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
                save_file({k: state[k] for k in names}, tmp / shard, metadata={"format": "pt"})
                weight_map.update({k: shard for k in names})
            total = sum(_nbytes(t) for t in state.values())
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True))
    except BaseException:
        _remove(tmp)
        raise
    _remove(target)
    os.replace(tmp, target)
    return target


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def remove_weights(path: Path) -> None:
    """Remove a published version, file or folder."""
    _remove(Path(path))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a published version: the file itself, or a folder's shards in index order."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    return [path / f for f in sorted(set(weight_map.values()))]


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a published version, one tensor in memory at a time (a vLLM worker streams them)."""
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole state dict of a published version (file or sharded folder), for an engine that reloads it
    every step. From each file's bytes, not safe_open: safetensors 0.8.0's safe_open keeps about two small
    objects per tensor each time it opens a file (measured with tracemalloc; safetensors issue 369), which a
    run that reloads every step piles up (`make soak` saw the engine's RSS creep)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with open(f, "rb") as fh:
            state.update(load_safetensors(fh.read()))
    return state
