"""INTELLECT-3's RL loss: token-level masked importance sampling (IcePop-style), no KL, no reference model.

    r    = exp(logp_train - logp_infer)          per completion token; not clipped, not detached
    drop = r < low or r > high                   token masked out of the loss (double-sided)
    seq  = min(r over the sequence) < seq_low    whole sequence masked
    loss = - sum(r * A over kept tokens) / (loss tokens in the step)

The denominator counts every loss token of the step (model-written completion tokens), masked or not, so a
step's scale does not depend on how many tokens the band dropped.
"""
from __future__ import annotations

import torch


def completion_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under softmax(logits / T): the trainer scores tokens with the sampler's temperature."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_is_loss(logp_train: torch.Tensor, logp_infer: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, total_loss_tokens: int, low: float = 0.5, high: float = 5.0,
                   seq_low: float = 1e-5) -> tuple[torch.Tensor, dict]:
    """
    logp_train, logp_infer, loss_mask: [batch, tokens]; advantages: [batch].
    loss_mask is 1 on model-written completion tokens, 0 on prompt, padding and environment tokens.
    Returns the loss contribution of this micro-batch and counts for the step's metrics.
    """
    mask = loss_mask.bool()
    ratio = torch.exp(logp_train - logp_infer)
    r = ratio.detach()
    token_low = (r < low) & mask
    token_high = (r > high) & mask
    seq_min = torch.where(mask, r, torch.full_like(r, float("inf"))).min(dim=1).values
    seq_drop = seq_min < seq_low
    keep = mask & ~token_low & ~token_high & ~seq_drop.unsqueeze(1)
    per_token = ratio * advantages.unsqueeze(1)
    loss = -(per_token * keep).sum() / max(total_loss_tokens, 1)
    stats = {
        "loss_tokens": int(mask.sum()),
        "masked_low": int(token_low.sum()),
        "masked_high": int(token_high.sum()),
        "masked_sequence_tokens": int((mask & seq_drop.unsqueeze(1)).sum()),
        "masked_sequences": int(seq_drop.sum()),
        "kept_tokens": int(keep.sum()),
        "ratio_sum": float((r * mask).sum()),
    }
    return loss, stats
