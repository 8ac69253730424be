"""Muon as INTELLECT-3's RL run used it: dion's Muon (prime-rl's `optim.type = "muon"`), written out here for
plain tensors (one process) and FSDP2's DTensor shards (several ranks).

Sources (read, not copied): prime-rl at PR 1272, src/prime_rl/trainer/optim.py (which parameters, lr, weight
decay, adjust_lr="rms_norm"), and dion at 3c4bce5 (the commit prime-rl's uv.lock pins), dion/muon.py (the
update) and dion/scalar_opts.py (the AdamW group). What one step does to a Muon parameter W with gradient G:

    M <- mu * M + G                     dion muon.py:540-541 (no (1 - mu) factor, unlike torch.optim.Muon)
    U <- M  (nesterov off)              muon.py:543-547; with nesterov: mu * M + G
    U <- bf16(U)                        muon.py:550
    O <- Newton-Schulz(U)               muon.py:620-647, on the last two dims of each matrix: five steps, each
                                        with its own quintic coefficients (NS_COEFFICIENTS), X / (|X|_F + eps)
    W <- W * (1 - lr * weight_decay)    muon.py:569 (decoupled, with the unadjusted lr)
    W <- W - bf16(O * lr * 0.2 * sqrt(max(m, n)))   muon.py:572-573 and 596-602 ("rms_norm")

with dion's defaults (muon.py:59-66): mu 0.95, nesterov off, eps 1e-8, flatten off, which prime-rl leaves as they
are (optim.py:40-55 passes lr, weight_decay and adjust_lr only). m, n are the matrix's own two dims (dion reads
the last two of the whole tensor's shape, muon.py:471-473, 599). A 3-D tensor is a batch of matrices (flatten
off, muon.py:44-46, 585-593): the routed experts are orthogonalised each on its own. prime-rl's model (impl
"custom", trainer/models/layers/moe.py:153-155) holds each expert's gate (w1), up (w3) and down (w2) as three
matrices; transformers' Glm4Moe fuses gate and up into one [E, 2I, H] tensor (gate rows first). A group with
row_blocks=2 splits that tensor's rows back into its gate and up halves and orthogonalises each alone, as
production did: Newton-Schulz of the fused matrix would not be the same update.

Note the coefficients: dion's default iteration (use_triton off, prime-rl does not set it) is not torch's or
Keller Jordan's (3.4445, -4.7750, 2.0315) repeated five times, but five different tuples (muon.py:625-631).

Several ranks (FSDP2, each parameter a DTensor sharded on dim 0):
- a 3-D expert tensor is sharded on its expert dim, so every rank holds whole expert matrices: it
  orthogonalises its own experts, with no communication. This is 93% of GLM-4.5-Air's parameters.
- a 2-D matrix is sharded on its rows: each rank casts its part of the update direction to bf16, gathers the
  whole matrix (DTensor.full_tensor(), an all-gather), orthogonalises it as one process would and keeps its own
  rows. Every rank runs Newton-Schulz on every 2-D matrix.
Each matrix goes through the same bf16 operations as in one process, so the update is the one-process update
for the same gradient (tests/test_muon.py, tests/test_distributed.py). The cost, for GLM-4.5-Air on 64 shards
(one HSDP replica of the production layout): the 2-D matrices (5.95B parameters) are gathered in bf16, about
12 GB received by each rank a step, once (FSDP2 gathers all 106B parameters for every forward and backward),
and their Newton-Schulz, 4.9e14 FLOPs, runs on every rank; the experts' share of each rank is 5.1e13 FLOPs. So
each rank does about 5.4e14 FLOPs a step (an estimate, not measured: about 0.5 s at an H200's bf16 peak of
989 TFLOP/s), where splitting every matrix over the ranks, as dion does (an all-to-all that hands each rank
whole matrices of its own), would do 5.9e13. An RL step of the production run trains on 4096 rollouts. The
largest gathered matrix (q_proj, 12288 x 4096) is 100 MB in bf16, and one is gathered at a time.

Why not a package: torch.optim.Muon takes 2-D parameters only (it raises on the 3-D experts) and its momentum,
coefficients and eps differ from dion's. dion itself is not on the package index and brings Triton kernels and
an async runtime. On the index, muon-fsdp2 0.3.0 (Apache-2.0, one 12 kB file) supports a 1-D mesh only (the
production layout is HSDP, a 2-D mesh), scales the lr by the first two dims (the expert count, for a 3-D
tensor), uses torch's coefficients and nesterov on by default; dtensor-muon 0.1.0 (no licence in the
package) imports Triton, flattens 3-D tensors by default, scales the lr by sqrt(max(1, m/n)) and defaults to
cautious weight decay. Neither is dion's update, and either would need patching; the gather above is a few
lines.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# dion/muon.py:625-631 (zeropower_via_newtonschulz5): one (a, b, c) a step, five steps
NS_COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
MOMENTUM = 0.95  # dion/muon.py:60 (mu)
NESTEROV = False  # dion/muon.py:64
EPS = 1e-8  # dion/muon.py:63 (epsilon), the Newton-Schulz normalisation's


def orthogonalise(u: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """dion's Newton-Schulz iteration in bf16 on the last two dims of `u` (a matrix, or a batch of them): an
    approximately orthogonal matrix with the singular vectors of each, in bf16."""
    x = u.to(torch.bfloat16)
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the wide orientation: X X^T is then the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm at most 1
    for a, b, c in NS_COEFFICIENTS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.mT


def rms_matched_lr(lr: float, rows: int, cols: int) -> float:
    """dion's adjust_lr="rms_norm" (muon.py:596-602), the same as torch.optim.Muon's "match_rms_adamw": the
    update's element RMS made about AdamW's, so one lr serves both groups."""
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (in place updates reach the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole_matrices_here(p: DTensor) -> bool:
    """Whether every shard placement of `p` splits a batch dim (the expert dim), not a matrix's rows or columns."""
    return all(pl.dim % p.ndim < p.ndim - 2 for pl in p.placements if pl.is_shard())


def _orthogonalised_part(u: torch.Tensor, p: torch.Tensor, row_blocks: int, eps: float) -> torch.Tensor:
    """The orthogonalised update of parameter `p` (its local part on ranks), from `u`, this rank's part of the
    bf16 update direction."""
    def ortho(full: torch.Tensor) -> torch.Tensor:
        blocks = full.unflatten(-2, (row_blocks, full.size(-2) // row_blocks))  # [..., blocks, rows, cols]
        return orthogonalise(blocks, eps).flatten(-3, -2)

    if not isinstance(p, DTensor) or _whole_matrices_here(p):
        return ortho(u)
    full = DTensor.from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor()
    mine = distribute_tensor(ortho(full), p.device_mesh, p.placements, src_data_rank=None).to_local()
    assert mine.shape == u.shape, (mine.shape, u.shape)
    return mine


class Muon(torch.optim.Optimizer):
    """dion's Muon update (module docstring) for parameters with ndim >= 2, plain or FSDP2 DTensors; the AdamW
    group is torch.optim.AdamW beside it (recipe.rl.trainer.build_optimizer). State: one momentum buffer a
    parameter, in the parameter's dtype and sharding. row_blocks (a group option): the tensor's rows hold that
    many matrices stacked, each orthogonalised alone (2 for transformers' fused expert gate_up_proj)."""

    def __init__(self, params, lr: float, momentum: float = MOMENTUM, nesterov: bool = NESTEROV,
                 weight_decay: float = 0.01, eps: float = EPS, row_blocks: int = 1):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or eps < 0:
            raise ValueError(f"Muon: lr {lr}, momentum {momentum}, weight_decay {weight_decay}, eps {eps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, eps=eps,
                        row_blocks=row_blocks)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2 or p.shape[-2] % group["row_blocks"]:
                    raise ValueError(f"Muon takes matrices (ndim >= 2) whose rows split into "
                                     f"{group['row_blocks']} blocks, not a tensor of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu, lr, blocks = group["momentum"], group["lr"], group["row_blocks"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf, grad = _local(state["momentum_buffer"]), _local(p.grad).to(p.dtype)
                buf.mul_(mu).add_(grad)
                direction = buf * mu + grad if group["nesterov"] else buf
                update = _orthogonalised_part(direction.to(torch.bfloat16), p, blocks, group["eps"])
                scaled = update * rms_matched_lr(lr, p.shape[-2] // blocks, p.shape[-1])  # bf16, as dion's
                weight = _local(p)
                weight.mul_(1 - lr * group["weight_decay"])
                weight.sub_(scaled)
        return loss
