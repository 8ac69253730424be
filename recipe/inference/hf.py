"""The hf engine: batched sampling with transformers' generate, returning the sampled tokens' logprobs.

Every row samples from a generator of its own, seeded with its own request's SamplingParams.seed: a row's tokens
do not depend on which other rows share its batch, its position or the batch size, up to the numerics of
batched forward passes (on CPU a row's logits move by ~1e-7 with the batch's composition, which can flip a
sampled token only when its uniform lies within that distance of a CDF boundary; logprobs move by as much).

Logprobs are taken from the raw logits divided by the temperature over the full vocabulary (before top-k and
top-p), the same distribution the RL trainer recomputes, so the importance ratio starts at 1 up to numerics.
Top-k (eval only: SamplingParams.top_k from the eval config or generation_config.json) keeps each row's k most
likely tokens, then top-p filters those, as vLLM orders them.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from recipe.chat import stop_token_ids
from recipe.model import load_pretrained
from recipe.model.attention import SDPA_GQA
from recipe.rollout import Completion, SamplingParams
from recipe.weights import read_weights


class _PreallocatedLayer(DynamicLayer):
    """A layer's KV cache written in place into buffers sized for the whole decode (prompt + max_new_tokens): the
    dynamic cache's torch.cat re-copies the cache at every step. update() returns views of the filled part."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buf = key_states.new_empty(b, h, self.capacity, d)
        self.value_buf = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.key_buf[:, :, self.length:end] = key_states
        self.value_buf[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices) -> None:
        if self.is_initialized:  # the rows kept, filled part only: the rest of the buffers is not yet written
            self.key_buf, self.value_buf = (_select_rows(b, indices, self.length) for b in (self.key_buf, self.value_buf))
            self.keys, self.values = self.key_buf[:, :, :self.length], self.value_buf[:, :, :self.length]


def _select_rows(buf, rows, length):
    out = buf.new_empty(len(rows), *buf.shape[1:])
    torch.index_select(buf[:, :, :length], 0, rows, out=out[:, :, :length])
    return out


def _preallocated_cache(config, capacity: int) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [_PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


class HFEngine:
    def __init__(self, model, tokenizer, stop_ids: list[int], batch_size: int = 64):
        self.model = model.eval()
        if model.config._attn_implementation == "sdpa":  # a model built elsewhere (load_pretrained gives it already)
            model.set_attn_implementation(SDPA_GQA)
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id
        self.batch_size = batch_size
        self.policy_version = 0

    @classmethod
    def from_pretrained(cls, path: str, batch_size: int = 64):
        model, tokenizer = load_pretrained(path)
        return cls(model, tokenizer, stop_token_ids(tokenizer), batch_size)

    def update_weights(self, path, version: int) -> None:
        """Load the state dict the trainer published at `path` (a safetensors file, or a folder of shards with
        its index) as policy `version`."""
        self.model.load_state_dict(read_weights(path))
        self.policy_version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt; prompt i is seeded params.seed + i, as the vLLM client does."""
        return self.generate_each(prompts, [replace(params, seed=params.seed + i) for i in range(len(prompts))])

    @torch.no_grad()
    def generate_each(self, prompts: list[list[int]], params: list[SamplingParams],
                      cancelled=None) -> list[Completion | None]:
        """One completion per prompt, each with its own SamplingParams (the engine process's requests).

        Prompts whose settings other than the seed agree are batched together, those of similar length in one
        batch; each row samples from its own generator, seeded with its own seed.
        `cancelled`: called between decode steps, returns the indexes of prompts to stop (a set); those rows
        leave the batch at once and get None.
        """
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.max_new_tokens, p.temperature, p.top_p, p.top_k), []).append(i)
        out: list[Completion | None] = [None] * len(prompts)
        for members in groups.values():
            order = sorted(members, key=lambda i: len(prompts[i]))
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                stop_rows = None if cancelled is None else _rows_of(idx, cancelled)
                done = self._generate_batch([prompts[i] for i in idx], params[idx[0]], [params[i].seed for i in idx],
                                            stop_rows)
                for i, c in zip(idx, done):
                    out[i] = c
        return out

    def _generate_batch(self, prompts, params: SamplingParams, seeds: list[int],
                        stop_rows=None) -> list[Completion | None]:
        """A KV-cached decode loop that drops finished rows at every step.

        transformers' generate() keeps every row until the longest is done, so one rambling sample makes the
        whole batch pay for max_new_tokens; here a step costs only the rows still running. `stop_rows()`, asked
        at every step, names rows cancelled meanwhile: they are dropped like finished ones and come back None.
        """
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt starts at position 0, as in training
        # the batch goes where the model is (a GPU: scripts/gpu_check.sh); on CPU every .to() below is a no-op
        device = next(self.model.parameters()).device
        input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
        greedy = params.temperature <= 0
        # every row's uniforms for every step, from its own generator, drawn up front: one call per row a batch
        # (on the CPU whatever the device, so a seed draws the same uniforms on a GPU)
        uniforms = None if greedy else torch.stack(
            [torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        cache = _preallocated_cache(self.model.config, width + params.max_new_tokens)
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1].float()
        live = torch.arange(len(prompts), device=device)  # original row of each row still running
        next_pos = positions[:, -1] + 1
        steps = []  # (rows, tokens, logprobs) of every decode step
        dropped: set[int] = set()  # rows cancelled while they ran
        for t in range(params.max_new_tokens):
            logp = torch.log_softmax(logits / (1.0 if greedy else params.temperature), dim=-1)
            if greedy:
                tok = logp.argmax(-1)
            else:
                tok = _inverse_cdf(_top_p(_top_k(logp, params.top_k), params.top_p).exp(), uniforms[live, t])
            steps.append((live, tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)))
            running = ~torch.isin(tok, stops)
            gone = stop_rows() if stop_rows is not None else None
            if gone:
                dropped |= gone
                running &= torch.tensor([r not in dropped for r in live.tolist()], device=device)
            if t == params.max_new_tokens - 1 or not running.any():
                break
            if not running.all():
                keep = running.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, tok, mask, next_pos = live[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype, device=device)], dim=1)
            logits = self.model(input_ids=tok.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                                past_key_values=cache, use_cache=True).logits[:, -1].float()
            next_pos = next_pos + 1
        ids: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        for rows, toks, lp in steps:
            for r, tk, l in zip(rows.tolist(), toks.tolist(), lp.tolist()):
                ids[r].append(tk)
                lps[r].append(l)
        stop_set = set(self.stop_ids)
        return [None if r in dropped else
                Completion(token_ids=ids[r], logprobs=lps[r],
                           finish_reason="stop" if ids[r] and ids[r][-1] in stop_set else "length",
                           policy_version=self.policy_version) for r in range(len(prompts))]


def _top_k(logp: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k most likely tokens of each row, renormalised (-1 or 0: all of them): vLLM applies top-k first and
    top-p to what is left."""
    if top_k <= 0 or top_k >= logp.shape[-1]:
        return logp
    kth = logp.topk(top_k, dim=-1).values[..., -1:]
    kept = logp.masked_fill(logp < kth, float("-inf"))
    return kept - kept.logsumexp(-1, keepdim=True)


def _rows_of(idx: list[int], cancelled):
    """stop_rows for the batch of prompts idx: the rows of those that cancelled() names (asked once a step)."""
    def stop_rows() -> set[int]:
        gone = cancelled()
        return {row for row, i in enumerate(idx) if i in gone} if gone else set()
    return stop_rows


def _top_p(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter on log-probabilities: keep the smallest set of tokens whose mass reaches top_p."""
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(-1)
    drop_sorted = cum - sorted_lp.exp() >= top_p  # tokens after the mass is already reached
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logp.masked_fill(drop, float("-inf"))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the token whose CDF interval holds u * (row total), u in [0, 1): a sample from each row's own
    uniform, vectorised over rows. A token of probability 0 has an empty interval and is never drawn."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    tok = torch.searchsorted(cdf, u.unsqueeze(-1).to(cdf.dtype) * total, right=True)
    # u * total may round up to total: then the token that brings the CDF to its total (probability > 0)
    return torch.minimum(tok, torch.searchsorted(cdf, total.contiguous())).squeeze(-1)
