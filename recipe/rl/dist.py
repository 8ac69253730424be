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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from recipe.errors import ConfigError
from recipe.launch.roles import relaunch
from recipe.model import load_pretrained
from recipe.model_card import write_card
from recipe.runs import Stage, launched, stage_dir


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


def run_stage_on_ranks(cfg, argv: list[str], name: str, requires: tuple[str, ...], threads: int, lead, follow,
                       cpu: bool = False) -> None:
    """A training stage (`recipe.<name>`) on this machine's ranks. launcher.num_processes > 1 and no launcher yet:
    run again under torchrun (recipe.launch.roles.relaunch). Else join the launcher's ranks, or be the one process:
    rank 0 runs the stage (its lock and markers) with lead(stage, upstream, tell) -> its manifest, where tell(job)
    hands the other ranks what they train from, and writes the model folder's card before marking the stage done;
    each other rank runs follow(job), or nothing when the stage was skipped or refused (they are told None)."""
    if cfg.launcher.num_processes > 1 and not launched():
        return relaunch(cfg, name, requires, f"recipe.{name}", argv, threads)
    world = init_world(cfg.launcher.collective_timeout_s, cpu=cpu)
    try:
        if world.main:
            told = False

            def tell(job) -> None:
                nonlocal told
                world.broadcast(job)
                told = True

            def card(manifest: dict) -> None:
                folder = stage_dir(cfg, name) / "model"  # where the stages export it and eval finds it
                if folder.is_dir():  # (a test's stand-in stage may export none: no card makes one up)
                    write_card(cfg, name, folder, manifest)

            try:
                Stage(cfg, name).run(lambda stage, upstream: lead(stage, upstream, tell, world), requires=requires,
                                     before_done=card)
            finally:
                if not told:  # skipped (already done) or refused: nothing for the other ranks to do
                    world.broadcast(None)
        else:
            job = world.broadcast(None)
            if job is not None:
                follow(job, world)
    finally:
        close_world(world)


def sample_tokens(sample) -> int:
    """What a sample costs the trainer: every token of its forward pass; nothing for one of advantage 0, whose
    passes train_step skips (its gradient is zero)."""
    return 0 if sample.advantage == 0 else len(sample.prompt_ids) + len(sample.completion_ids)


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


def shard_model(model, world: World, replicas: int = 1, compute_dtype: torch.dtype = torch.float32,
                reshard_after_forward: bool = True) -> None:
    """FSDP2 over every rank: each decoder layer is a unit of its own (gathered for its forward and backward
    only), the root holds the rest (embeddings, final norm, head). replicas > 1 is HSDP, as prime-rl runs
    INTELLECT-3: the ranks form `replicas` groups, each holding one whole sharded copy, and gradients are reduced
    over the groups as well. Gradients are summed over ranks, not averaged (FSDP2's default): each rank's loss is
    already its tokens' share of the step's global mean (recipe.rl.trainer.train_step), so the sum is the
    one-process gradient. A compute dtype below float32 (bf16) is FSDP2's mixed precision: the shards (the master
    weights the optimizer updates) stay float32, each layer is gathered in bf16 for its forward and backward, and
    gradients are reduced in float32. reshard_after_forward=False keeps each layer's gathered weights from its
    forward to its backward (one gather a step instead of two, for the memory of a whole bf16 copy; the GPU check's
    --keep-gathered)."""
    if world.size % replicas:
        raise ConfigError(f"launcher.hsdp_replicas = {replicas} does not divide the {world.size} trainer ranks")
    mesh = init_device_mesh(world.device.type, (replicas, world.size // replicas),
                            mesh_dim_names=("replicate", "shard")) if replicas > 1 else None
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def load_sharded(path, world: World, replicas: int, dtype: str, attn_implementation: str,
                 activation_checkpointing: bool = False):
    """(model, tokenizer) for training on this rank, its parameters float32 whatever `dtype` (the model's compute
    dtype, bf16 for the real presets): they are the master weights the optimizer updates, as in prime-rl. In bf16 a
    step of lr 1e-6 would round away on most weights (bf16 keeps 8 bits of mantissa). Forward and backward run in
    `dtype`: FSDP2's mixed precision on ranks (shard_model), autocast in one process (train_step's
    compute_dtype).

    One process: the model, loaded and moved to the device. Several ranks: every rank builds the model on the meta
    device and shards it; rank 0 alone reads the weights and sends each rank its shards (set_model_state_dict with
    broadcast_from_rank0), so no rank but rank 0 ever holds the whole model (106B parameters would not fit a GPU,
    nor 8 copies a node's memory). The non-persistent buffers (the rotary frequencies) are not in a state dict:
    rank 0's are broadcast as well. activation_checkpointing: each decoder layer recomputes its activations in
    the backward (transformers' gradient checkpointing, non-reentrant, which FSDP2 takes)."""
    compute = getattr(torch, dtype)
    master = "float32"
    if not world.distributed:
        model, tokenizer = load_pretrained(str(path), dtype=master, attn_implementation=attn_implementation)
        return _checkpointed(model.to(world.device), activation_checkpointing), tokenizer
    model, tokenizer = load_pretrained(str(path), dtype=master, attn_implementation=attn_implementation,
                                       weights=False)
    source = load_pretrained(str(path), dtype=master, attn_implementation=attn_implementation)[0] if world.main \
        else None
    shard_model(model, world, replicas, compute)
    model.to_empty(device=world.device)
    full = source.state_dict() if world.main else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # ~1.5 s to import
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    source_buffers = dict(source.named_buffers()) if world.main else {}
    for name, buf in model.named_buffers():
        value = source_buffers[name].to(world.device) if world.main else torch.empty_like(buf)
        dist.broadcast(value, src=0)
        buf.copy_(value)
    del source, full
    return _checkpointed(model, activation_checkpointing), tokenizer


def _checkpointed(model, on: bool):
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
