"""sdpa attention with grouped key/value heads passed as they are (enable_gqa), on the CPU too.

transformers' sdpa copies every key/value head num_key_value_groups times before the call whenever there is a
mask and the device is not one it trusts with masked GQA (CPU included). A decode step then re-copies the whole KV
cache, which costs about ten times the attention itself on the tiny model (128 rows, 4 query heads on 2 key/value
heads); padded and packed training batches pay it too. torch's CPU sdpa takes the grouped heads with a mask:
the forward is the same to the last bit, gradients agree to float rounding (tests/test_hf_engine.py,
tests/test_trainer.py). Other devices go to transformers' own sdpa unchanged.

Models load with it wherever the config says sdpa (recipe.model.load_pretrained, build_tiny_model); the name is not
saved with the model, so a saved folder loads anywhere with the stock sdpa.

sdpa_rows (below): the attention of packed SFT batches, each row within itself; sdpa_prefix: an RL step's completions
in one pass, each row against its prompt's keys and its own; sdpa_tree: SFT rows in one pass with the prompt
prefixes they share computed once.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_GQA = "sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    if query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if query.shape[2] == 1 and (attention_mask is None or attention_mask.shape[1] == 1) and not dropout:
        return decode_attention(query, key, value, attention_mask, scaling), None
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True,
                                         is_causal=query.shape[2] > 1 and attention_mask is None and causal)
    return out.transpose(1, 2).contiguous(), None


def decode_attention(query, key, value, attention_mask, scaling):
    """One new token a row against its KV cache, as two batched matrix products and a softmax: torch's CPU sdpa
    kernel, built for long queries, cost more for a single masked query (a 128-row decode step of the tiny model
    about 9% less this way, docs/performance.md). The query heads that share a key/value head go in one product,
    so the cache is read as it lies (a strided view of the engine's buffers), never copied."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # head h reads key/value head h // groups
    # the scale and the mask in place, on scores no one else holds: a new tensor for each cost about what the op did
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(dim ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:  # (rows or 1, 1, 1, kv): broadcast over the heads
        if attention_mask.dtype == torch.bool:  # the finite minimum, not -inf: an all-masked row stays finite
            scores.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)
        else:  # additive (decode_bias): the same scores, as a score plus the minimum rounds to the minimum
            scores.add_(attention_mask)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(weights, value)  # (rows, kv_heads, groups, dim)
    return out.reshape(rows, 1, heads, dim)  # (rows, query, heads, dim), as the callers take it


def decode_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean decode mask (True: may attend) as decode_attention's additive one: 0 where a row may attend, the
    dtype's finite minimum where not. Made once a decode step for every layer, instead of a layer's inverting and
    filling of the mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)


def implementation(name: str) -> str:
    """The attention a model is loaded with for the config's `name`: sdpa_gqa for sdpa, others as they are."""
    return SDPA_GQA if name == "sdpa" else name


# Packed training rows (recipe.sft.PackedBatchCollator: several rows end to end in a sequence, positions restarting
# at each row, no attention mask). Through sdpa they need a block-diagonal mask, and a masked sdpa computes every
# block of the whole sequence; here each row attends within itself only, causal and unmasked, the rows batched
# by length (ROWS_PER_CALL to a call, padded at the right to the longest: a causal row never sees the padding
# after it). Same loss and gradients up to float rounding (tests/test_trainer.py); about 10% off a packed tiny SFT
# step on 2 CPU threads (docs/performance.md). Training forwards only: with a mask or a KV cache it is sdpa_gqa.
SDPA_ROWS = "sdpa_rows"
ROWS_PER_CALL = 8


class RowPlan:
    """Where the rows of a packed (batch, length) position-id tensor lie, and how they are batched: the rows and
    longest length of each call, and the gather and pick of _one_gather."""

    def __init__(self, position_ids: torch.Tensor, rows_per_call: int = ROWS_PER_CALL):
        batch, width = position_ids.shape
        first = (position_ids == 0).reshape(-1).cpu()
        first[::width] = True  # a sequence's first token starts a row whatever its position
        starts = first.nonzero().flatten()  # a row ends where the next starts (every sequence start is one)
        lengths = torch.cat([starts[1:], torch.tensor([batch * width])]) - starts
        calls, inverse = _row_calls(starts, lengths, rows_per_call)
        self.calls = [(len(rows), longest) for rows, longest, _, _ in calls]
        self.gather, self.sizes, self.pick = _one_gather(calls, inverse, position_ids.device)


def _row_calls(starts: torch.Tensor, lengths: torch.Tensor, rows_per_call: int) -> tuple[list, torch.Tensor]:
    """Rows of a flat token order (each from `starts`, `lengths` long, at least 1) batched by length, longest first,
    rows_per_call to an sdpa call: for each call its rows, its longest length, the flat index of every (row,
    column) slot (a padding slot repeats its row's last token) and which slots are real; and `inverse`, which puts
    the calls' real tokens back in the flat order."""
    order = torch.argsort(lengths, descending=True, stable=True)
    calls, real = [], []
    for at in range(0, len(order), rows_per_call):
        rows = order[at:at + rows_per_call]
        longest = int(lengths[rows].max())
        column = torch.arange(longest)
        slots = (starts[rows, None] + torch.minimum(column, lengths[rows, None] - 1)).flatten()
        is_real = (column < lengths[rows, None]).flatten()
        calls.append((rows, longest, slots, is_real))
        real.append(slots[is_real])
    flat = torch.cat(real)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(len(flat))
    return calls, inverse


def _one_gather(calls: list, inverse: torch.Tensor, device) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Every call's slots in one gather (`gather`, split into the calls by `sizes`), and the one `pick` that takes
    the real tokens of the calls' outputs, laid end to end, back to the flat order. One index_select a tensor
    instead of one a call: the backward of each allocates and zeroes a gradient of the whole tensor, and autograd
    then sums them (3% of a tiny RL trainer step: docs/performance.md, "RL: a step"). The same gradients to the
    last bit: a padding slot's is exactly 0."""
    sizes = [len(slots) for _, _, slots, _ in calls]
    offsets = torch.cumsum(torch.tensor([0] + sizes[:-1]), 0)
    real = torch.cat([is_real.nonzero().flatten() + at for (_, _, _, is_real), at in zip(calls, offsets)])
    return torch.cat([slots for _, _, slots, _ in calls]).to(device), sizes, real[inverse].to(device)


def _row_plan(position_ids: torch.Tensor) -> RowPlan:
    # every layer of one forward gets the same position-id tensor: the plan is made once, and lives with it
    plan = getattr(position_ids, "_row_plan", None)
    if plan is None:
        plan = RowPlan(position_ids)
        position_ids._row_plan = plan
    return plan


def sdpa_rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        position_ids=None, **kwargs):
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    batch, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    if position_ids.shape[0] != batch:  # the model's own positions, one row for the whole batch
        position_ids = position_ids.expand(batch, -1)
    plan = _row_plan(position_ids)
    q = query.transpose(1, 2).reshape(batch * width, heads, dim)
    k = key.transpose(1, 2).reshape(batch * width, kv_heads, dim)
    v = value.transpose(1, 2).reshape(batch * width, kv_heads, dim)
    outs = []
    for (rows, longest), qc, kc, vc in zip(plan.calls, *(t.index_select(0, plan.gather).split(plan.sizes)
                                                          for t in (q, k, v))):
        # (rows, heads, longest, dim) of each: the call's rows, padded at the right
        qc, kc, vc = (t.view(rows, longest, t.shape[1], dim).transpose(1, 2) for t in (qc, kc, vc))
        out = F.scaled_dot_product_attention(qc, kc, vc, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=kv_heads != heads)
        outs.append(out.transpose(1, 2).reshape(rows * longest, heads, dim))
    return torch.cat(outs).index_select(0, plan.pick).view(batch, width, heads, dim), None


def rows_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """No mask for a training forward without one (the rows come from the position ids); sdpa's otherwise."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SDPA_ROWS, sdpa_rows_attention)
AttentionMaskInterface.register(SDPA_ROWS, rows_mask)


# The completions of an RL step laid end to end in one sequence (recipe.rl.trainer.SharedPrompts): each attends to
# its prompt's keys and values, made once in the prompts' pass and read here from that pass's leaves, then causally
# to its own tokens, never to another completion. The projections, experts and norms see the real tokens only, one
# pass for many completions instead of a padded micro-batch of 16 each: 11 to 18% off a tiny RL trainer step on one
# thread (docs/performance.md, "RL: a step"). Only attention pads: ROWS_PER_CALL completions of similar length to
# an sdpa call, each row's prompt keys then its own, masked where a prompt is shorter or a key is later.
SDPA_PREFIX = "sdpa_prefix"


class PrefixRows:
    """The layout of a flat pass: for each sdpa call its rows, longest length, the rows' prompts, their width and the
    call's mask, and the gather and pick of _one_gather (a padding slot repeats its row's last token).
    lengths: [rows] completion tokens (at least 1 each), laid end to end in this order; prompt_rows: [rows] each
    row's prompt; prompt_kv: keys, values, keys, ... of every layer, each [prompts, kv heads, prompt width, head
    dim]; prompt_mask: [prompts, prompt width], 1 on real prompt tokens."""

    def __init__(self, lengths: torch.Tensor, prompt_rows: torch.Tensor, prompt_kv: list[torch.Tensor],
                 prompt_mask: torch.Tensor, rows_per_call: int = ROWS_PER_CALL):
        device = prompt_mask.device
        lengths, prompt_rows = lengths.cpu(), prompt_rows.cpu()
        self.prompt_kv = prompt_kv
        prompt_lengths = prompt_mask.sum(1).cpu()
        calls, inverse = _row_calls(torch.cumsum(lengths, 0) - lengths, lengths, rows_per_call)
        self.calls = []
        for rows, longest, _, _ in calls:
            prompt_width = int(prompt_lengths[prompt_rows[rows]].max())
            prompts = prompt_rows[rows].to(device)
            # (rows, 1, longest, prompt width + longest): the prompt's real keys, then the row's own up to the query
            sees_prompt = prompt_mask[prompts, :prompt_width].bool()[:, None, None, :].expand(-1, 1, longest, -1)
            sees_own = torch.ones(longest, longest, dtype=torch.bool, device=device).tril().expand(len(rows), 1, -1, -1)
            self.calls.append((len(rows), longest, prompts, prompt_width, torch.cat([sees_prompt, sees_own], -1)))
        self.gather, self.sizes, self.pick = _one_gather(calls, inverse, device)


def sdpa_prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                          prefix_rows: PrefixRows | None = None, **kwargs):
    if prefix_rows is None:
        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    _, heads, width, dim = query.shape  # one sequence: the completions end to end
    kv_heads = key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    prompt_keys = prefix_rows.prompt_kv[2 * module.layer_idx]
    prompt_values = prefix_rows.prompt_kv[2 * module.layer_idx + 1]
    layout = prefix_rows
    outs = []
    for (rows, longest, prompts, prompt_width, mask), qc, kc, vc in zip(
            layout.calls, *(t.index_select(0, layout.gather).split(layout.sizes) for t in (q, k, v))):
        qc, kc, vc = (t.view(rows, longest, t.shape[1], dim).transpose(1, 2) for t in (qc, kc, vc))
        kc = torch.cat([prompt_keys.index_select(0, prompts)[:, :, :prompt_width].to(kc.dtype), kc], 2)
        vc = torch.cat([prompt_values.index_select(0, prompts)[:, :, :prompt_width].to(vc.dtype), vc], 2)
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=kv_heads != heads)
        outs.append(out.transpose(1, 2).reshape(rows * longest, heads, dim))
    return torch.cat(outs).index_select(0, layout.pick).view(1, width, heads, dim), None


AttentionInterface.register(SDPA_PREFIX, sdpa_prefix_attention)
AttentionMaskInterface.register(SDPA_PREFIX, rows_mask)  # the flat pass has no mask; others get sdpa's


# A batch of SFT rows whose prompts share their first tokens (a task's instructions, the chat template's start) as
# one flat sequence with each shared prefix in it once (recipe.sft.SharedPrefixCollator): a prefix's tokens attend
# causally within it, a row's own tokens to its prefix and then causally to themselves. One pass, one graph: the
# gradient of a prefix token sums over the rows that read it, as if each row had its own copy (float rounding).
SDPA_TREE = "sdpa_tree"


class TreeRows:
    """The layout of a flat pass of segments laid end to end: `lengths` [segments] tokens each (at least 1),
    `parents` [segments] the segment whose keys come before a segment's own (a prefix), or -1. A parent has no
    parent itself. For each sdpa call its rows, longest query, key width and mask (None: causal within the row),
    and one gather each for queries and keys (a padding slot repeats its row's last token) with the pick that puts
    the calls' real outputs back in the flat order."""

    def __init__(self, lengths: list[int], parents: list[int], rows_per_call: int = ROWS_PER_CALL):
        n = torch.tensor(lengths)
        starts = torch.cumsum(n, 0) - n
        parent = torch.tensor(parents)
        if bool((n < 1).any()) or bool(((parent >= 0) & (parent[parent.clamp(min=0)] >= 0)).any()):
            raise ValueError("TreeRows: every segment needs a token, and a parent has no parent")
        roots, children = (parent < 0).nonzero().flatten(), (parent >= 0).nonzero().flatten()
        # (rows, longest query, key width, mask, query slots, key slots, real query slots) of each call
        calls = []
        for is_root, kind in ((True, roots), (False, children)):
            width = n[kind] + n[parent[kind]] * (parent[kind] >= 0)  # what each row's query reads
            order = kind[torch.argsort(width, descending=True, stable=True)]
            for at in range(0, len(order), rows_per_call):
                rows = order[at:at + rows_per_call]
                longest = int(n[rows].max())
                column = torch.arange(longest)
                own = starts[rows, None] + torch.minimum(column, n[rows, None] - 1)
                real = (column < n[rows, None]).flatten()
                if is_root:  # causal and unmasked: a row padded at its right never sees the padding
                    calls.append((len(rows), longest, longest, None, own.flatten(), own.flatten(), real))
                    continue
                up = parent[rows]
                up_width = int(n[up].max())
                up_column = torch.arange(up_width)
                keys = torch.cat([starts[up, None] + torch.minimum(up_column, n[up, None] - 1), own], 1)
                sees_up = (up_column < n[up, None])[:, None, None, :].expand(-1, 1, longest, -1)
                sees_own = torch.ones(longest, longest, dtype=torch.bool).tril().expand(len(rows), 1, -1, -1)
                calls.append((len(rows), longest, up_width + longest, torch.cat([sees_up, sees_own], -1),
                              own.flatten(), keys.flatten(), real))
        self.calls = [(rows, longest, width, mask) for rows, longest, width, mask, _, _, _ in calls]
        self.queries = torch.cat([c[4] for c in calls])
        self.keys = torch.cat([c[5] for c in calls])
        self.query_sizes = [len(c[4]) for c in calls]
        self.key_sizes = [len(c[5]) for c in calls]
        real = torch.cat([c[6] for c in calls])
        inverse = torch.empty(int(n.sum()), dtype=torch.long)
        inverse[self.queries[real]] = torch.arange(int(real.sum()))
        self.pick = real.nonzero().flatten()[inverse]

    def to(self, device, **kwargs) -> TreeRows:  # (accelerate moves a batch's objects with .to)
        for name in ("queries", "keys", "pick"):
            setattr(self, name, getattr(self, name).to(device))
        self.calls = [(r, q, k, m if m is None else m.to(device)) for r, q, k, m in self.calls]
        return self


def sdpa_tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        tree_rows: TreeRows | None = None, **kwargs):
    if tree_rows is None:
        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    _, heads, width, dim = query.shape  # one sequence: the segments end to end
    kv_heads = key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    outs = []
    for (rows, longest, keys, mask), qc, kc, vc in zip(
            tree_rows.calls, q.index_select(0, tree_rows.queries).split(tree_rows.query_sizes),
            *(t.index_select(0, tree_rows.keys).split(tree_rows.key_sizes) for t in (k, v))):
        qc = qc.view(rows, longest, heads, dim).transpose(1, 2)
        kc, vc = (t.view(rows, keys, kv_heads, dim).transpose(1, 2) for t in (kc, vc))
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             is_causal=mask is None, enable_gqa=kv_heads != heads)
        outs.append(out.transpose(1, 2).reshape(rows * longest, heads, dim))
    return torch.cat(outs).index_select(0, tree_rows.pick).view(1, width, heads, dim), None


AttentionInterface.register(SDPA_TREE, sdpa_tree_attention)
AttentionMaskInterface.register(SDPA_TREE, rows_mask)


@contextmanager
def attention_implementation(model, name: str):
    """The model's attention set to `name` for the block, then back to what it was (a switch costs about 0.1 ms)."""
    before = model.config._attn_implementation
    if before != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if before != name:
            model.set_attn_implementation(before)
