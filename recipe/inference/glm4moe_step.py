"""A decode step of Glm4MoeForCausalLM written out in plain torch calls, for the hf engine on the CPU.

A decode step of the tiny model on the CPU costs mostly the calling of many small operations, and transformers'
forward adds its own Python around them: a 4-D mask built from the 2-D one, the rotary module, output capture, each
module's call, the routed experts' dispatch. `decode_logits` does the same arithmetic in the same order (its logits
and cache equal transformers' to the last bit on the CPU, tests/test_hf_engine.py), reading the model's own
parameters at each call, so weights loaded into the model (HFEngine.update_weights) count at once. Its fixed cost a
step is about two thirds of transformers' forward (`make bench-engine` times both side by side: RESULTS.md); the
tiny RL stage took 12% less wall time with it and the engine's joins together (docs/performance.md).

`prefill_logits` does the same for the prompts that join a batch (several tokens a row, left-padded): the RL engine
prefills a group or two at a time, several times a step, and transformers' forward costs several ms a call whatever
the prompts; this takes about a fifth less CPU for one to four prompts (docs/performance.md). Its last-position
logits and the cache equal transformers' to the last bit too (tests/test_hf_engine.py).

It covers the architecture this recipe trains and nothing else: `supported(model)` says when; the engine keeps
transformers' forward for any other model and on other devices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from recipe.model.attention import decode_attention, decode_bias, sdpa_gqa_attention


def supported(model) -> bool:
    """A glm4_moe model on the CPU with the layout and settings this step implements."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    return (cfg.model_type == "glm4_moe" and next(model.parameters()).device.type == "cpu"
            and rope.get("rope_type", "default") == "default" and cfg.hidden_act == "silu"
            and all(_layout_ok(layer.mlp) for layer in model.model.layers))


def _layout_ok(mlp) -> bool:
    experts = getattr(mlp, "experts", None)
    if experts is None:  # a dense layer
        return hasattr(mlp, "gate_proj")
    # transformers' stacked experts: gate and up concatenated, (experts, out, in), no bias
    return (getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_bias", False) and getattr(experts, "has_gate", True))


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    # Glm4MoeRMSNorm: the variance in float32, the weight applied in the input's dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims (GLM's partial rotary), the rest passed through."""
    n = cos.shape[-1]
    rot, rest = x[..., :n], x[..., n:]
    half = n // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + turned * sin, rest), dim=-1)


def _swiglu(x: torch.Tensor, mlp) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)


def _routed(x: torch.Tensor, moe) -> torch.Tensor:
    """The routed experts of a Glm4MoeMoE block for the rows x: sigmoid scores with the correction bias for the
    choice (groups first when n_group > 1), the chosen scores as weights (normalised, scaled), each expert's rows
    through one grouped product."""
    gate, experts = moe.gate, moe.experts
    scores = F.linear(x.to(torch.float32), gate.weight.to(torch.float32)).sigmoid()
    choice = scores + gate.e_score_correction_bias
    n_experts = gate.num_experts
    if gate.num_group > 1:
        per_group = n_experts // gate.num_group
        group_scores = choice.view(-1, gate.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(gate.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    top_k = gate.top_k
    chosen = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * gate.routed_scaling_factor
    expert_of, order = torch.sort(chosen.reshape(-1))  # each expert's (row, choice) pairs together
    ends = torch.bincount(expert_of, minlength=n_experts).cumsum(0).to(torch.int32)
    dtype = experts.gate_up_proj.dtype
    up = torch._grouped_mm(x[order // top_k].to(dtype), experts.gate_up_proj.transpose(-2, -1), offs=ends)
    g, u = up.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(g) * u, experts.down_proj.transpose(-2, -1), offs=ends)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    # back in (row, choice) order, each row's choices summed in that order, as transformers does
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(x.shape[0], top_k, -1).sum(dim=1).to(x.dtype)


def _rotary(rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `positions` (any shape) for the rotary dims, in `dtype`, with a last axis of rotary dims."""
    freqs = positions.unsqueeze(-1).float() * rotary.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * rotary.attention_scaling).to(dtype), (angles.sin() * rotary.attention_scaling).to(dtype)


def _qkv(h: torch.Tensor, attn, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries, keys and values of the rows h, each viewed as `shape` (heads on its next-to-last axis),
    queries and keys normed where the model norms them (GLM's qk norm)."""
    q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(shape)
    k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(shape)
    v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(shape)
    if attn.use_qk_norm:
        q, k = _rms(q, attn.q_norm), _rms(k, attn.k_norm)
    return q, k, v


def _mlp(h: torch.Tensor, mlp) -> torch.Tensor:
    """A layer's MLP on the rows h (tokens, hidden): the routed and shared experts, or the dense one."""
    if hasattr(mlp, "experts"):
        return _routed(h, mlp) + _swiglu(h, mlp.shared_experts)
    return _swiglu(h, mlp)


@torch.no_grad()
def prefill_logits(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """The next-token logits after each prompt of `ids` (prompts, width), left-padded (`mask` 1 on real tokens,
    `positions` from 0 at each prompt's first), their keys and values written into `cache` (columns [0, width) of
    the engine's buffer layers). Returns (prompts, vocab) in the model's dtype: the last position's only."""
    inner = model.model
    n, width = ids.shape
    x = inner.embed_tokens(ids)  # (prompts, width, hidden)
    cos, sin = _rotary(inner.rotary_emb, positions, x.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (prompts, 1, width, rotary dims): every head
    # transformers' mask for left padding: causal, real keys only (a padding query sees nothing; sdpa gives it 0)
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    allowed = (causal[None] & mask.bool()[:, None, :])[:, None]  # (prompts, 1, width, width)
    for layer, kv in zip(inner.layers, cache.layers):
        attn = layer.self_attn
        h = _rms(x, layer.input_layernorm)
        q, k, v = _qkv(h, attn, (n, width, -1, attn.head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (prompts, heads, width, head dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = kv.update(k, v, attn.layer_idx)
        out, _ = sdpa_gqa_attention(attn, q, keys, values, allowed, scaling=attn.scaling)  # transformers' own call
        x = x + F.linear(out.reshape(n, width, -1), attn.o_proj.weight)
        h = _rms(x, layer.post_attention_layernorm)
        x = x + _mlp(h.view(n * width, -1), layer.mlp).view(n, width, -1)
    return model.lm_head(_rms(x, inner.norm))[:, -1]  # every position, as transformers: fewer rows round apart


@torch.no_grad()
def decode_logits(model, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """Next-token logits of every row after feeding `tokens` (rows,) at `positions` (rows,), their keys and values
    appended to `cache` (the engine's buffer layers: update() writes the next column and returns the views);
    `mask` (rows, 1, 1, columns) bool, True where a row may attend. Returns (rows, vocab) in the model's dtype."""
    inner = model.model
    rows = tokens.shape[0]
    x = inner.embed_tokens(tokens)
    cos, sin = _rotary(inner.rotary_emb, positions, x.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (rows, 1, rotary dims): every head
    bias = decode_bias(mask, x.dtype)  # every layer's
    for layer, kv in zip(inner.layers, cache.layers):
        attn = layer.self_attn
        h = _rms(x, layer.input_layernorm)
        q, k, v = _qkv(h, attn, (rows, -1, attn.head_dim))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = kv.update(k.unsqueeze(2), v.unsqueeze(2), attn.layer_idx)
        out = decode_attention(q.unsqueeze(2), keys, values, bias, attn.scaling)
        x = x + F.linear(out.reshape(rows, -1), attn.o_proj.weight)
        h = _rms(x, layer.post_attention_layernorm)
        x = x + _mlp(h, layer.mlp)
    return model.lm_head(_rms(x, inner.norm))
