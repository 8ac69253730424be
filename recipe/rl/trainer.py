"""The RL trainer: optimizer, one training step on a batch of samples, checkpoints that resume exactly.

Runs under accelerate (one process on CPU; FSDP2 through an accelerate config on GPUs). Muon follows
prime-rl: torch.optim.Muon on the 2-D weight matrices of the hidden layers, AdamW on everything else
(embeddings, output head, norms, biases, router, and the 3-D stacked expert weights Muon does not take).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from recipe.config import OptimizerKind
from recipe.rl.loss import completion_logprobs, masked_is_loss
from recipe.runs import safetensors_problem, torch_save_problem, write_atomic


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


def build_optimizer(model, rl_cfg):
    if rl_cfg.optimizer == OptimizerKind.adamw:
        return CombinedOptimizer([torch.optim.AdamW(model.parameters(), lr=rl_cfg.lr,
                                                    weight_decay=rl_cfg.weight_decay)])
    muon, adamw = [], []
    for name, p in model.named_parameters():
        hidden_matrix = p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name and ".gate." not in name
        (muon if hidden_matrix else adamw).append(p)
    return CombinedOptimizer([
        torch.optim.Muon(muon, lr=rl_cfg.lr, weight_decay=rl_cfg.weight_decay, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(adamw, lr=rl_cfg.lr, weight_decay=rl_cfg.weight_decay),
    ])


def build_scheduler(optimizer: CombinedOptimizer, warmup_steps: int):
    """Linear warmup to the configured LR, then constant; one LambdaLR per inner optimizer."""
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizer.optimizers]


def _pad(seqs: list[list], value) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs])


def train_step(model, optimizer, schedulers, accelerator, samples, rl_cfg, pad_id: int) -> dict:
    """One optimizer step on the batch; the loss is normalised by the loss tokens of the whole step."""
    model.train()
    total_tokens = sum(sum(s.loss_mask) for s in samples)
    # micro-batches of similar lengths pad less (a tool transcript is twice a one-line answer); the loss is a
    # sum normalised by the step's tokens, so the grouping does not change it
    samples = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
    totals: dict = {}
    for start in range(0, len(samples), rl_cfg.micro_batch_size):
        mb = samples[start:start + rl_cfg.micro_batch_size]
        input_ids = _pad([s.prompt_ids + s.completion_ids for s in mb], pad_id)
        attention = _pad([[1] * (len(s.prompt_ids) + len(s.completion_ids)) for s in mb], 0)
        logits = model(input_ids=input_ids.to(accelerator.device),
                       attention_mask=attention.to(accelerator.device)).logits
        # logits at position t predict token t+1: gather each completion's positions into [mb, T_c]
        width = max(len(s.completion_ids) for s in mb)
        index = _pad([list(range(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.completion_ids)))
                      for s in mb], 0).to(logits.device)
        comp_logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        targets = _pad([s.completion_ids for s in mb], pad_id).to(logits.device)
        logp_train = completion_logprobs(comp_logits, targets, rl_cfg.temperature)
        logp_infer = _pad([s.logprobs for s in mb], 0.0).to(logits.device).float()
        loss_mask = _pad([s.loss_mask for s in mb], 0).to(logits.device)
        assert logp_train.shape == (len(mb), width)
        advantages = torch.tensor([s.advantage for s in mb], device=logits.device, dtype=torch.float32)
        loss, stats = masked_is_loss(logp_train, logp_infer, advantages, loss_mask, total_tokens,
                                     rl_cfg.mask_ratio_low, rl_cfg.mask_ratio_high, rl_cfg.sequence_mask_low)
        accelerator.backward(loss)
        stats["loss"] = float(loss.detach())
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), rl_cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    for sch in schedulers:
        sch.step()
    n = max(totals.get("loss_tokens", 0), 1)
    return {
        "loss": totals.get("loss", 0.0),
        "grad_norm": float(grad_norm),
        "loss_tokens": totals.get("loss_tokens", 0),
        "masked_share_low": totals.get("masked_low", 0) / n,
        "masked_share_high": totals.get("masked_high", 0) / n,
        "masked_share_sequence": totals.get("masked_sequence_tokens", 0) / n,
        "masked_share": 1.0 - totals.get("kept_tokens", 0) / n,
        "mean_ratio": totals.get("ratio_sum", 0.0) / n,
        "lr": optimizer.optimizers[0].param_groups[0]["lr"],
    }


# -- checkpoints -------------------------------------------------------------------------------------------
def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, schedulers, orchestrator_state: dict,
                    keep: int) -> Path:
    """Write everything needed to resume at `step` into a temporary folder, then rename it into place."""
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
                  tmp / "model.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save([sch.state_dict() for sch in schedulers], tmp / "scheduler.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "orchestrator.json").write_text(json.dumps(orchestrator_state))
        (tmp / "meta.json").write_text(json.dumps({"step": step}))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:  # a full disk: the checkpoints before stay; the half-written one gives its space back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "orchestrator.json", "meta.json")


def checkpoint_problem(path: Path) -> str | None:
    """Why an RL checkpoint folder cannot be resumed from, or None when it is intact: every file save_checkpoint
    writes is there, the JSON files parse, and the weights and torch.save files are whole (the same size and
    header checks as SFT's, recipe.runs.safetensors_problem and torch_save_problem)."""
    for name in CHECKPOINT_FILES:
        if not (path / name).exists():
            return f"{name} is missing"
    for name in ("orchestrator.json", "meta.json"):
        try:
            json.loads((path / name).read_text())
        except ValueError as e:
            return f"{name} does not parse ({e})"
    return safetensors_problem(path / "model.safetensors") or next(
        filter(None, (torch_save_problem(path / n) for n in ("optimizer.pt", "scheduler.pt", "rng.pt"))), None)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """Newest intact step_N (see checkpoint_problem). A newer one that is not intact (a kill, a full disk) is
    removed, with one line on stderr saying why, so that the run resumes from the one before it; with none left,
    one line says the run starts over."""
    ckpts = sorted(ckpt_root.glob("step_*"), reverse=True)
    for p in ckpts:
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        print(f"rl: skipping checkpoint {p.name}: {problem}; removed it, resuming from the checkpoint before it",
              file=sys.stderr)
        shutil.rmtree(p, ignore_errors=True)
    if ckpts:
        print(f"rl: no intact checkpoint left in {ckpt_root}; starting over from step 0", file=sys.stderr)
    return None


def load_checkpoint(path: Path, model, optimizer, schedulers) -> tuple[int, dict]:
    model.load_state_dict(load_file(path / "model.safetensors"))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    for sch, state in zip(schedulers, torch.load(path / "scheduler.pt", weights_only=False)):
        sch.load_state_dict(state)
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return json.loads((path / "meta.json").read_text())["step"], json.loads((path / "orchestrator.json").read_text())


def publish_weights(model, weights_dir: Path, version: int, keep: int = 3) -> Path:
    """Filesystem weight broadcast (as prime-rl's): one safetensors file a policy version, written atomically."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weights_dir / f"policy_{version:06d}.safetensors"
    tmp = weights_dir / f".policy_{version:06d}.tmp"
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp)
    except BaseException:  # a full disk: the versions published before stay
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    for old in sorted(weights_dir.glob("policy_*.safetensors"))[:-keep]:
        old.unlink(missing_ok=True)
    write_atomic(weights_dir / "LATEST", str(version))
    return path
