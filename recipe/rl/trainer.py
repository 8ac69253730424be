"""The RL trainer: optimizer, one training step on a batch of samples, checkpoints that resume exactly.

One process, or FSDP2 over several ranks (recipe.rl.dist): the same step, loss and checkpoints either way. Muon
follows prime-rl's production run: dion's Muon (recipe.rl.muon) on every weight with ndim >= 2 but the
embeddings and the output head (attention, dense MLP, shared experts, router and the 3-D routed experts, each
expert matrix on its own), AdamW on the rest (embeddings, head, norms, biases). On FSDP2 shards each rank
orthogonalises its own experts and gathers the 2-D matrices whole (recipe.rl.muon; docs/architecture.md,
"Ranks").

Checkpoints are torch.distributed.checkpoint (DCP) folders at any world size, so a run saved by N ranks resumes
on M: model and optimizer state are keyed by parameter name and DCP reshards them on load.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from recipe.config import OptimizerKind
from recipe.errors import StageError
from recipe.model.attention import SDPA_PREFIX, PrefixRows, attention_implementation
from recipe.rl.dist import World
from recipe.rl.loss import completion_logprobs, masked_is_loss
from recipe.rl.muon import Muon
from recipe.rollout import distinct_prompts
from recipe.runs import torch_save_problem, write_atomic
from recipe.weights import remove_weights, write_weights


class CombinedOptimizer:
    """Several torch optimizers stepped together (Muon + AdamW), with one state dict."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def takes_muon(name: str, param) -> bool:
    """Whether Muon updates this parameter (rl.optimizer=muon): every weight with ndim >= 2 but the embeddings and
    the output head, as prime-rl's muon_enabled (trainer/optim.py:28-35 at PR 1272): attention, dense MLP, shared
    experts, the router (mlp.gate.weight) and the routed experts' 3-D tensors."""
    return param.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name


def row_blocks(name: str) -> int:
    """How many matrices a Muon parameter stacks along its rows: 2 for transformers' fused expert gate_up_proj
    ([experts, 2 x intermediate, hidden], gate rows then up rows), which prime-rl's model holds as two tensors
    (w1 and w3, trainer/models/layers/moe.py:153-155), so Muon orthogonalises gate and up apart; 1 otherwise."""
    return 2 if name.endswith("mlp.experts.gate_up_proj") else 1


def optimizer_split(named_parameters, optimizer: OptimizerKind) -> tuple[list, list]:
    """(muon, adamw): the (name, parameter) pairs each of build_optimizer's optimizers updates. The launcher's
    plan counts its memory from this same split, on the model built on the meta device."""
    muon, adamw = [], []
    for name, p in named_parameters:
        (muon if optimizer == OptimizerKind.muon and takes_muon(name, p) else adamw).append((name, p))
    return muon, adamw


def build_optimizer(model, rl_cfg):
    """rl.optimizer=muon: recipe.rl.muon.Muon on optimizer_split's Muon share (momentum rl.muon_momentum,
    nesterov rl.muon_nesterov), torch AdamW on the rest; rl.optimizer=adamw: AdamW on everything. Both with
    rl.lr and rl.weight_decay (decoupled); AdamW with betas (rl.adam_beta1, rl.adam_beta2) and eps rl.adam_eps."""
    muon, adamw = optimizer_split(model.named_parameters(), rl_cfg.optimizer)
    optimizers = []
    if muon:
        groups = [{"params": [p for n, p in muon if row_blocks(n) == k], "row_blocks": k} for k in (1, 2)]
        optimizers.append(Muon([g for g in groups if g["params"]], lr=rl_cfg.lr, momentum=rl_cfg.muon_momentum,
                               nesterov=rl_cfg.muon_nesterov, weight_decay=rl_cfg.weight_decay))
    optimizers.append(torch.optim.AdamW([p for _, p in adamw], lr=rl_cfg.lr, weight_decay=rl_cfg.weight_decay,
                                        betas=(rl_cfg.adam_beta1, rl_cfg.adam_beta2), eps=rl_cfg.adam_eps))
    return CombinedOptimizer(optimizers)


def build_scheduler(optimizer: CombinedOptimizer, warmup_steps: int, decay_steps: int = 0, max_steps: int = 0,
                    min_lr_share: float = 0.0):
    """Linear warmup to the configured LR, constant, then (decay_steps > 0) a linear decay over the run's last
    decay_steps steps to min_lr_share of it, reached at its last step (prime-rl's linear scheduler,
    trainer/scheduler.py); one LambdaLR per inner optimizer. Its step count is checkpointed with it."""
    decay_start = max_steps - decay_steps

    def factor(step: int) -> float:
        if decay_steps > 0 and step >= decay_start:
            done = min(1.0, (step - decay_start) / max(1, decay_steps - 1))
            return 1.0 - (1.0 - min_lr_share) * done
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizer.optimizers]


def scheduler_for(optimizer: CombinedOptimizer, rl_cfg):
    """The schedule an RL config asks for (rl.warmup_steps, rl.decay_steps, rl.max_steps, rl.min_lr_share)."""
    return build_scheduler(optimizer, rl_cfg.warmup_steps, rl_cfg.decay_steps, rl_cfg.max_steps, rl_cfg.min_lr_share)


def _pad(seqs: list[list], value) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs])


class SharedPrompts:
    """The forward pass of a step's prompts, made once for all the samples that share them (a group's samples share
    its prompt): each distinct prompt runs once, its keys and values (every layer) and the logits of its last token
    become leaves that the completions' passes read (completion_logprobs), and backward() sends the gradient those
    leaves gathered back through the prompts' pass. The gradient is the unshared one up to float rounding:
    the same attention, positions and tokens, each prompt token computed once instead of once a sample."""

    def __init__(self, model, samples, pad_id: int, device, compute_dtype: torch.dtype | None):
        self.model, self.device, self.compute_dtype = model, device, compute_dtype
        prompts, rows = distinct_prompts(s.prompt_ids for s in samples)
        self.row = {id(s): r for s, r in zip(samples, rows)}  # sample -> its prompt's row
        self.lengths = torch.tensor([len(p) for p in prompts], device=device)
        # right-padded: every pad query still sees its prompt's real tokens (no row of the mask is all masked)
        ids = _pad(prompts, pad_id).to(device)
        self.mask = _pad([[1] * len(p) for p in prompts], 0).to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        with self._autocast():
            out = model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True)
        last = out.logits.gather(1, (self.lengths - 1).view(-1, 1, 1).expand(-1, 1, out.logits.shape[-1]))
        kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        self.outputs = [last.squeeze(1)] + kv
        self.leaves = [t.detach().requires_grad_() for t in self.outputs]

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None)

    def completion_logprobs(self, mb, temperature: float) -> torch.Tensor:
        """[len(mb), longest completion]: log p of each completion token (0 past a row's end), from one pass over
        the micro-batch's completions laid end to end (recipe.model.attention.PrefixRows: each reads its prompt's
        keys and values, then its own tokens), so that no layer but attention runs on padding."""
        lengths = torch.tensor([len(s.completion_ids) for s in mb], device=self.device)
        rows = torch.tensor([self.row[id(s)] for s in mb], device=self.device)
        ids = torch.tensor([t for s in mb for t in s.completion_ids], device=self.device)
        starts = torch.cumsum(lengths, 0) - lengths
        owner = torch.repeat_interleave(torch.arange(len(mb), device=self.device), lengths)  # each token's row
        column = torch.arange(len(ids), device=self.device) - starts[owner]
        positions = self.lengths[rows][owner] + column
        layout = PrefixRows(lengths, rows, self.leaves[1:], self.mask)
        with self._autocast(), attention_implementation(self.model, SDPA_PREFIX):
            logits = self.model(input_ids=ids[None], position_ids=positions[None], prefix_rows=layout).logits[0]
        # a completion's first token is predicted by its prompt's last position, the others by the token before
        before = torch.cat([logits[:1], logits[:-1]]).index_copy(0, starts, self.leaves[0][rows].to(logits.dtype))
        logp = completion_logprobs(before, ids, temperature)
        return logp.new_zeros(len(mb), int(lengths.max())).index_put((owner, column), logp)

    def backward(self) -> None:
        pairs = [(t, leaf.grad) for t, leaf in zip(self.outputs, self.leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


STAT_KEYS = ("loss", "loss_tokens", "masked_low", "masked_high", "masked_sequence_tokens", "masked_sequences",
             "kept_tokens", "ratio_sum")  # masked_is_loss's stats, summed over micro-batches and ranks


def train_step(model, optimizer, schedulers, device, samples, rl_cfg, pad_id: int, world: World = World(),
               compute_dtype: torch.dtype | None = None) -> dict:
    """One optimizer step on the batch (this rank's share of it); the loss is normalised by the loss tokens of
    the whole step, over every rank, so that any number of ranks computes the one-process gradient.
    compute_dtype (bf16 for the real presets): one process runs the forward under autocast in it, the float32
    parameters staying the master weights (on ranks FSDP2's mixed precision does it: recipe.rl.dist.shard_model)."""
    model.train()
    autocast = compute_dtype not in (None, torch.float32) and not world.distributed
    total_tokens = world.sum([sum(sum(s.loss_mask) for s in samples)])[0]
    # a sample with advantage 0 (a group without signal where the online filter is off, as in prime-rl's
    # production run) has loss terms r * 0: its gradient is exactly zero and only its tokens count, in the
    # normaliser above. Neither its forward nor its backward is run (nor a sample without completion tokens)
    skipped_tokens = sum(sum(s.loss_mask) for s in samples if s.advantage == 0)
    samples = [s for s in samples if s.advantage != 0 and s.completion_ids]
    # micro-batches of similar lengths pad less (a tool transcript is twice a one-line answer); the loss is a
    # sum normalised by the step's tokens, so the grouping does not change it. Shared prompts (one process):
    # the prompts run once before the micro-batches, which hold the completions only, end to end
    shared = (rl_cfg.share_prompts and not world.distributed and bool(samples)
              and not getattr(model, "is_gradient_checkpointing", False))  # (a checkpointed forward keeps no cache)
    samples = sorted(samples, key=lambda s: len(s.completion_ids) + (0 if shared else len(s.prompt_ids)))
    batches = [samples[i:i + rl_cfg.micro_batch_size] for i in range(0, len(samples), rl_cfg.micro_batch_size)]
    # under FSDP2 each forward and backward gathers the layers' shards from every rank, so every rank makes as
    # many passes as the busiest one; the extra ones add nothing to the gradient
    # (at least one pass: a step whose every sample was skipped still hands the optimizer a zero gradient, as running
    # them would; a parameter without a gradient would be left out of AdamW's and Muon's momentum and decay)
    idle_passes = max(world.max(len(batches)), 1) - len(batches)
    prefix = SharedPrompts(model, samples, pad_id, device, compute_dtype if autocast else None) if shared else None
    totals: dict = {}
    for mb in batches:
        width = max(len(s.completion_ids) for s in mb)
        if prefix is not None:
            logp_train = prefix.completion_logprobs(mb, rl_cfg.temperature)
        else:
            input_ids = _pad([s.prompt_ids + s.completion_ids for s in mb], pad_id)
            attention = _pad([[1] * (len(s.prompt_ids) + len(s.completion_ids)) for s in mb], 0)
            with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
                logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
            # logits at position t predict token t+1: gather each completion's positions into [mb, T_c]
            index = _pad([list(range(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.completion_ids)))
                          for s in mb], 0).to(logits.device)
            comp_logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            targets = _pad([s.completion_ids for s in mb], pad_id).to(comp_logits.device)
            logp_train = completion_logprobs(comp_logits, targets, rl_cfg.temperature)
        logp_infer = _pad([s.logprobs for s in mb], 0.0).to(logp_train.device).float()
        loss_mask = _pad([s.loss_mask for s in mb], 0).to(logp_train.device)
        assert logp_train.shape == (len(mb), width)
        advantages = torch.tensor([s.advantage for s in mb], device=logp_train.device, dtype=torch.float32)
        loss, stats = masked_is_loss(logp_train, logp_infer, advantages, loss_mask, total_tokens,
                                     rl_cfg.mask_ratio_low, rl_cfg.mask_ratio_high, rl_cfg.sequence_mask_low)
        loss.backward()
        stats["loss"] = float(loss.detach())
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
    if prefix is not None:
        prefix.backward()
    for _ in range(idle_passes):
        (model(input_ids=torch.full((1, 1), pad_id, device=device)).logits.sum() * 0.0).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), rl_cfg.max_grad_norm)  # global under FSDP2
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad()
    for sch in schedulers:
        sch.step()
    if world.distributed:  # the step's stats over every rank's share
        totals = {k: v for k, v in zip(STAT_KEYS, world.sum([totals.get(k, 0) for k in STAT_KEYS]))}
        totals = {k: v if k in ("loss", "ratio_sum") else int(v) for k, v in totals.items()}
        skipped_tokens = world.sum([skipped_tokens])[0]
    n = max(totals.get("loss_tokens", 0), 1)  # the shares and the mean ratio: over the tokens run
    return {
        "loss": totals.get("loss", 0.0),
        "grad_norm": float(grad_norm),
        "loss_tokens": totals.get("loss_tokens", 0) + int(skipped_tokens),
        "skipped_tokens": int(skipped_tokens),
        "masked_share_low": totals.get("masked_low", 0) / n,
        "masked_share_high": totals.get("masked_high", 0) / n,
        "masked_share_sequence": totals.get("masked_sequence_tokens", 0) / n,
        "masked_share": 1.0 - totals.get("kept_tokens", 0) / n,
        "mean_ratio": totals.get("ratio_sum", 0.0) / n,
        "lr": optimizer.optimizers[0].param_groups[0]["lr"],
    }


# -- weights -------------------------------------------------------------------------------------------------
def full_state_dict(model, world: World = World(), dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, on rank 0 (FSDP2: gathered from every rank's shards, a collective;
    the other ranks get {}); floating tensors cast to `dtype` if given (the float32 master weights to the model's
    compute dtype, as the engines and the final model folder hold them)."""
    if not world.distributed:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def _version_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def publish_weights(model, weights_dir: Path, version: int, keep: int = 3, world: World = World(),
                    dtype: torch.dtype | None = None) -> Path | None:
    """Filesystem weight broadcast (as prime-rl's): every rank's shards gathered, written once by rank 0 as
    safetensors (one file, or a folder of shards with its index for a large model: recipe.weights), atomically.
    Returns the path on rank 0, None on the others (which have nothing to wait for: rank 0 tells the engines).
    `dtype`: the engines' (the model's compute dtype), not the float32 master weights'."""
    state = full_state_dict(model, world, dtype)
    if not world.main:
        return None
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = write_weights(state, weights_dir / f"policy_{version:06d}.safetensors")  # a full disk: older ones stay
    for old in sorted(weights_dir.glob("policy_*"), key=_version_of)[:-keep]:
        remove_weights(old)
    write_atomic(weights_dir / "LATEST", str(version))
    return path


# -- checkpoints -------------------------------------------------------------------------------------------
STATE_DIR = "state"  # DCP: model and optimizer, one file of shards a rank plus .metadata
CHECKPOINT_FILES = ("meta.json", "orchestrator.json", "scheduler.pt", f"{STATE_DIR}/.metadata")


def _rng_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _dcp(fn, state: dict, folder: Path, world: World) -> None:
    """dcp.save or dcp.load, over every rank or (one process) without a process group. DCP reports a failure as
    CheckpointException, a BaseException that holds each rank's error: this rank's (or the first) is raised
    instead, so a full disk stays an OSError naming its file (recipe.runs.stage_main)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn(state, checkpoint_id=str(folder), no_dist=not world.distributed)
    except CheckpointException as e:
        failures = e.failures
        exc, _ = failures.get(world.rank) or next(iter(failures.values()))
        raise exc from None


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, schedulers, orchestrator_state: dict,
                    keep: int, world: World = World()) -> Path:
    """Write everything needed to resume at `step` into a temporary folder, then rename it into place: model and
    optimizer through DCP (each rank writes its shards), the RNG of every rank, and from rank 0 the schedulers,
    the orchestrator's state and meta.json, last. A collective: every rank calls it."""
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()  # the folder exists before any rank writes into it
    try:
        model_state, optim_state = get_state_dict(model, optimizer.optimizers)
        _dcp(dcp.save, {"model": model_state, "optimizer": optim_state}, tmp / STATE_DIR, world)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / _rng_name(world.rank))
        world.barrier()  # every rank's files are in
        if world.main:
            torch.save([sch.state_dict() for sch in schedulers], tmp / "scheduler.pt")
            (tmp / "orchestrator.json").write_text(json.dumps(orchestrator_state))
            _fsync_tree(tmp)
            write_atomic(tmp / "meta.json", json.dumps({"step": step, "world_size": world.size}))
    except BaseException:  # a full disk: the checkpoints before stay; the half-written one gives its space back
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world.main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _dcp_problem(folder: Path) -> str | None:
    """Why a DCP folder is not whole, or None: its .metadata loads, and every shard file it points into exists
    and is at least as long as the last byte it is said to hold (so a truncated or missing file is caught)."""
    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 (a torn pickle raises several kinds)
        return f"{STATE_DIR}/.metadata does not load ({e.__class__.__name__})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = folder / name
        if not f.exists():
            return f"{STATE_DIR}/{name} is missing"
        if f.stat().st_size < end:
            return f"{STATE_DIR}/{name} is {f.stat().st_size} bytes, the checkpoint's index needs {end}"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why an RL checkpoint folder cannot be resumed from, or None when it is intact: every file save_checkpoint
    writes is there (the RNG file of each rank that saved it included), the JSON files parse, the torch.save
    files are whole (recipe.runs.torch_save_problem) and so are the DCP shards (_dcp_problem)."""
    for name in CHECKPOINT_FILES:
        if not (path / name).exists():
            return f"{name} is missing"
    for name in ("orchestrator.json", "meta.json"):
        try:
            json.loads((path / name).read_text())
        except ValueError as e:
            return f"{name} does not parse ({e})"
    ranks = json.loads((path / "meta.json").read_text()).get("world_size", 1)
    for name in ["scheduler.pt"] + [_rng_name(r) for r in range(ranks)]:
        problem = torch_save_problem(path / name)
        if problem:
            return problem
    return _dcp_problem(path / STATE_DIR)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """Newest intact step_N (see checkpoint_problem). A newer one that is not intact (a kill, a full disk) is
    removed, with one line on stderr saying why, so that the run resumes from the one before it; with none left,
    one line says the run starts over. Rank 0 alone calls it (it removes folders), and tells the others."""
    ckpts = sorted(ckpt_root.glob("step_*"), reverse=True)
    for p in ckpts:
        if (p / "model.safetensors").exists() and not (p / STATE_DIR).exists():  # not damaged: of another version
            raise StageError(f"rl: checkpoint {p} is in the one-process format of an earlier version of the recipe "
                             f"(model.safetensors, optimizer.pt), which this one does not read: finish that run "
                             f"with the version that wrote it, or remove {ckpt_root} to start the stage over")
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        print(f"rl: skipping checkpoint {p.name}: {problem}; removed it, resuming from the checkpoint before it",
              file=sys.stderr)
        shutil.rmtree(p, ignore_errors=True)
    if ckpts:
        print(f"rl: no intact checkpoint left in {ckpt_root}; starting over from step 0", file=sys.stderr)
    return None


def load_checkpoint(path: Path, model, optimizer, schedulers, world: World = World()) -> tuple[int, dict]:
    """Restore model, optimizer, schedulers and this rank's RNG from `path`, saved at any world size (DCP
    reshards); a rank the saving run did not have keeps the RNG it has. Returns (step, orchestrator state)."""
    model_state, optim_state = get_state_dict(model, optimizer.optimizers)
    state = {"model": model_state, "optimizer": optim_state}
    _dcp(dcp.load, state, path / STATE_DIR, world)
    set_state_dict(model, optimizer.optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for sch, sch_state in zip(schedulers, torch.load(path / "scheduler.pt", weights_only=False)):
        sch.load_state_dict(sch_state)
    if (path / _rng_name(world.rank)).exists():
        rng = torch.load(path / _rng_name(world.rank), weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return json.loads((path / "meta.json").read_text())["step"], json.loads((path / "orchestrator.json").read_text())


def checkpoint_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict in a checkpoint, read in this one process (no process group, no model):
    for tests and for exporting a checkpoint's weights."""
    meta = FileSystemReader(str(path / STATE_DIR)).read_metadata().state_dict_metadata
    prefix = "model."
    model = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    state = {"model": model}
    _dcp(dcp.load, state, path / STATE_DIR, World())
    return state["model"]
