"""Trainer ranks: who they are, how a step's samples reach them, and how the model is sharded over them.

One process (launcher.num_processes=1) is `World()`: rank 0 of 1, no process group, no FSDP, so every collective
below is a no-op that hands its input back. Under torchrun (WORLD_SIZE > 1) `init_world` joins the process
group (gloo on CPU, NCCL on GPUs, with a gloo group beside it for pickled objects) with a timeout, so a rank left
waiting on a peer that hangs fails instead of waiting forever. docs/architecture.md ("Ranks") has the roles.
"""
from __future__ import annotations

import datetime
import heapq
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from recipe.launch.roles import launched


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    # one process trains where the model fits best: the GPU when there is one (as accelerate placed it before)
    device: torch.device = field(default_factory=lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    objects: object = None  # the process group pickled objects travel on (None: the default group)

    @property
    def main(self) -> bool:
        """Rank 0: the one process that owns the engines, the orchestrator and every file but DCP shards."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.objects)

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def scatter(self, shares: list | None):
        """Rank 0 hands shares[r] to rank r (the other ranks pass None); returns this rank's share."""
        if not self.distributed:
            return shares[0]
        out = [None]
        dist.scatter_object_list(out, shares if self.main else None, src=0, group=self.objects)
        return out[0]

    def _reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values: list) -> list:
        """Elementwise sum over ranks (float64, exact for counts); one process: `values` as they are."""
        return self._reduce(values, dist.ReduceOp.SUM) if self.distributed else list(values)

    def max(self, value: int) -> int:
        return int(self._reduce([value], dist.ReduceOp.MAX)[0]) if self.distributed else value

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set: every rank takes the same decision (e.g. to stop after this step)."""
        return bool(self.max(int(flag)))


def init_world(timeout_s: float, cpu: bool = False) -> World:
    """This process's World: joins the launcher's process group when there is one, else World(). cpu=True: gloo
    on the CPU even where there are GPUs (`make base` trains on the CPU)."""
    if not launched():
        return World(device=torch.device("cpu")) if cpu else World()
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available() and not cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        device, objects = torch.device("cuda", local), dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        device, objects = torch.device("cpu"), None
    return World(dist.get_rank(), dist.get_world_size(), device, objects)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def sample_tokens(sample) -> int:
    """What a sample costs the trainer: every token of its forward pass."""
    return len(sample.prompt_ids) + len(sample.completion_ids)


def split_by_tokens(samples: list, n: int) -> list[list]:
    """n shares of `samples` with token sums as even as a greedy pass makes them: longest sample first, each onto
    the share with the fewest tokens so far (ties: the lower rank). Deterministic; each share keeps the batch's
    order. A share is empty only when there are fewer samples than ranks."""
    heap = [(0, r) for r in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(samples)), key=lambda i: (-sample_tokens(samples[i]), i)):
        load, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + sample_tokens(samples[i]), r))
    return [[samples[i] for i in sorted(idx)] for idx in shares]


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers causal LM (model.model.layers)."""
    return list(model.model.layers)


def shard_model(model) -> None:
    """FSDP2 over every rank: each decoder layer is a unit of its own (gathered for its forward and backward
    only), the root holds the rest (embeddings, final norm, head). Gradients are summed over ranks, not averaged
    (FSDP2's default): each rank's loss is already its tokens' share of the step's global mean
    (recipe.rl.trainer.train_step), so the sum is the one-process gradient."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
