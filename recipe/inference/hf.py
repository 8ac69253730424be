"""The hf engine: batched sampling with a transformers model, returning the sampled tokens' logprobs.

Continuous batching (recipe.inference.hf.DecodeBatch): rows join the running batch between decode steps and leave
it as they finish, as in vLLM, so a request never waits for the longest row of a batch it could have joined. The
KV cache is written in place into buffers every row sits right-aligned in; a row that joins is prefilled on its
own and copied in.

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
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from recipe.chat import stop_token_ids
from recipe.inference import glm4moe_step
from recipe.model import load_pretrained
from recipe.model.attention import SDPA_GQA
from recipe.rollout import Completion, SamplingParams, distinct_prompts
from recipe.weights import read_weights


class _BufferLayer(DynamicLayer):
    """A layer's KV cache in buffers written in place (transformers' dynamic cache re-copies the whole cache with
    torch.cat at every step). Rows [0, rows) and columns [start, length) are in view: update() writes the next
    columns of those rows and returns the views. Rows and columns past them are room for rows that join."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.key_buf, self.value_buf = keys, values
        self.rows, self.start, self.length = keys.shape[0], 0, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.view()

    def lazy_initialization(self, key_states, value_states):  # the buffers come with the layer
        pass

    def view(self) -> None:
        self.keys = self.key_buf[:self.rows, :, self.start:self.length]
        self.values = self.value_buf[:self.rows, :, self.start:self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buf[:self.rows, :, self.length:end] = key_states
        self.value_buf[:self.rows, :, self.length:end] = value_states
        self.length = end
        self.view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length - self.start


def _empty_cache(model, rows: int, capacity: int) -> DynamicCache:
    """A cache of unwritten buffers for `rows` rows and `capacity` columns."""
    cfg = model.config
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    cache = DynamicCache(config=cfg)
    shape = (rows, heads, capacity, dim)
    cache.layers = [_BufferLayer(param.new_empty(shape), param.new_empty(shape), 0) for _ in cache.layers]
    return cache


class DecodeBatch:
    """The rows an engine decodes together, one token a step; rows join (admit) and leave (finished or dropped)
    between steps.

    Every row's keys and values sit right-aligned in the buffers: a row of length n (prompt + tokens fed back)
    fills columns [width - n, width), the columns before it are masked, and a step writes column `width` for all
    rows. Attention reads columns from the start of the oldest running row (`start`) to `width`.
    A row that joins is prefilled (each distinct prompt once) and copied in place, into a spare row of the buffers
    after the running ones, when the buffers have the room (its prompt fits before `width`, its max_new_tokens
    after it): no other row moves. Otherwise every running row is copied into new buffers laid out for the longest
    row, with room for the engine's batch_size rows and the columns of `max_new_tokens` more steps than the rows
    need. A row that finishes (or is dropped) leaves the buffers in the same step: the running rows past the first
    `running` move into the finished rows' slots (their own keys and values, a few rows' copy), so that a decode
    step computes the running rows and no others (about 7% less of the engine's decode CPU over an RL arm than
    leaving finished rows in until half were: docs/performance.md).
    Rows share temperature, top_p and top_k (`settings`); each has its own seed and max_new_tokens, and the
    policy version of the weights when it joined (weights can change while it runs: HFEngine.update_weights).
    `key`: the caller's name for a row.
    """

    def __init__(self, engine: "HFEngine", settings: SamplingParams):
        self.engine, self.settings = engine, settings
        self.device = next(engine.model.parameters()).device
        self.stops = torch.tensor(engine.stop_ids, dtype=torch.long, device=self.device)
        self.relayouts = 0  # full copies of the cache (tests, benches)
        self._clear()

    def _clear(self) -> None:
        self.keys: list = []  # per buffer row; None for a row that left in this step (moved out at its end)
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.versions: list[int] = []  # the policy version each row joined under
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # keys+values held, per row
        self.budgets = torch.zeros(0, dtype=torch.long, device=self.device)  # max_new_tokens, per row
        self.generated = torch.zeros(0, dtype=torch.long, device=self.device)  # tokens sampled, per row
        self.uniforms = torch.zeros(0, 1, device=self.device)  # each row's own draws, one a token
        self.logits: torch.Tensor | None = None  # each row's next-token logits
        self.cache: DynamicCache | None = None
        self.width = 0
        self.start = 0
        self.running = 0

    def __len__(self) -> int:
        """The rows still running."""
        return self.running

    def accepts(self, params: SamplingParams) -> bool:
        s = self.settings
        return (params.temperature, params.top_p, params.top_k) == (s.temperature, s.top_p, s.top_k)

    @torch.no_grad()
    def admit(self, keys: list, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Prefill these prompts and add them as rows: in place when the buffers have the room, else with the
        running rows laid out again in new buffers."""
        if not keys:
            return
        model, device = self.engine.model, self.device
        # a group's samples share their prompt: each distinct prompt is prefilled once, its rows copy its cache
        prompts, row_of = distinct_prompts(prompts)
        rows = torch.tensor(row_of, device=device)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt starts at position 0, as in training
        # the batch goes where the model is (a GPU: scripts/gpu_check.sh); on CPU every .to() below is a no-op
        input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
        cache = _empty_cache(model, len(prompts), width)
        if self.engine.written_out_decode:
            logits = glm4moe_step.prefill_logits(model, input_ids, mask, positions, cache).float()[rows]
        else:
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).logits[:, -1].float()[rows]
        most = max(q.max_new_tokens for q in params)
        # every row's uniforms for every step, from its own generator, drawn when it joins (on the CPU whatever
        # the device, so a seed draws the same uniforms on a GPU)
        uniforms = torch.stack([F.pad(torch.rand(q.max_new_tokens, generator=torch.Generator().manual_seed(q.seed)),
                                      (0, most - q.max_new_tokens)) for q in params]).to(device)
        lengths = torch.tensor([len(prompts[r]) for r in row_of], device=device)
        budgets = torch.tensor([q.max_new_tokens for q in params], device=device)
        slots = self._slots(len(keys), width, most)
        if slots is None:  # no room: the running rows, then these, in new buffers
            keep = [r for r, k in enumerate(self.keys) if k is not None]
            self._select(keep)
            slots = list(range(len(keep), len(keep) + len(keys)))
        else:
            keep = None
        self._grow(max(slots) + 1, most)
        at = torch.tensor(slots, dtype=torch.long, device=device)
        for slot, key in zip(slots, keys):
            self.keys[slot], self.tokens[slot], self.logprobs[slot] = key, [], []
            self.versions[slot] = self.engine.policy_version
        self.lengths[at], self.budgets[at], self.generated[at] = lengths, budgets, 0
        self.uniforms[at] = F.pad(uniforms, (0, self.uniforms.shape[1] - most))
        self.logits[at] = logits
        self.running += len(keys)
        if keep is not None:
            self._relayout(torch.tensor(keep, dtype=torch.long, device=device))
        self._copy_in(at, cache, width, rows)

    def _slots(self, n: int, prompt_width: int, most: int) -> list[int] | None:
        """Where n rows of prompts up to prompt_width tokens and up to `most` new tokens go in place: the spare rows
        of the buffers after the running ones (a step moves the running rows together); None when the buffers have
        not the room."""
        if self.cache is None or not self.running:
            return None
        layer = self.cache.layers[0]
        if prompt_width > self.width or self.width + most > layer.key_buf.shape[2]:
            return None
        free = list(range(len(self.keys), len(self.keys) + n))
        return free if free[-1] < layer.key_buf.shape[0] else None

    def _grow(self, rows: int, cols: int) -> None:
        """Per-row state for `rows` rows and uniforms for `cols` steps (new rows dead until admit fills them)."""
        extra = rows - len(self.keys)
        if extra > 0:
            device = self.device
            self.keys += [None] * extra
            self.tokens += [[] for _ in range(extra)]
            self.logprobs += [[] for _ in range(extra)]
            self.versions += [0] * extra
            zeros = torch.zeros(extra, dtype=torch.long, device=device)
            self.lengths = torch.cat([self.lengths, zeros])
            self.budgets = torch.cat([self.budgets, zeros])
            self.generated = torch.cat([self.generated, zeros])
            self.uniforms = torch.cat([self.uniforms, self.uniforms.new_zeros(extra, self.uniforms.shape[1])])
            vocab = self.engine.model.config.vocab_size
            logits = torch.zeros(extra, vocab, device=device)
            self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        if cols > self.uniforms.shape[1]:
            self.uniforms = F.pad(self.uniforms, (0, cols - self.uniforms.shape[1]))

    def _select(self, rows: list[int]) -> None:
        """The per-row state of these rows only (the buffers: _relayout)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.keys = [self.keys[r] for r in rows]
        self.tokens = [self.tokens[r] for r in rows]
        self.logprobs = [self.logprobs[r] for r in rows]
        self.versions = [self.versions[r] for r in rows]
        self.lengths, self.budgets, self.generated = self.lengths[idx], self.budgets[idx], self.generated[idx]
        self.uniforms = self.uniforms[idx]
        if self.logits is not None:
            self.logits = self.logits[idx]

    def _copy_in(self, slots: torch.Tensor, joining: DynamicCache, joining_width: int,
                 joining_rows: torch.Tensor) -> None:
        """The rows `joining_rows` of `joining` (a row may come more than once: a prompt prefilled once for several
        samples) into the buffers' rows `slots`, ending at column `width`; the columns before them zeroed (a masked
        column must hold finite numbers: its weight 0 times NaN is NaN)."""
        lo = self.width - joining_width
        for layer, dst in zip(joining.layers, self.cache.layers):
            for name in ("key_buf", "value_buf"):
                out = getattr(dst, name)
                out[:, :, lo:self.width].index_copy_(0, slots, getattr(layer, name)[:, :, :joining_width][joining_rows])
                out[:, :, :lo].index_fill_(0, slots, 0)
        self._set_view()

    def _set_view(self) -> None:
        """The cache's views: every row of the batch (all running: rows that leave are moved out in their step),
        columns from the oldest row's start."""
        self.start = int((self.width - self.lengths).min()) if self.running else self.width
        for layer in self.cache.layers:
            layer.rows, layer.start, layer.length = len(self.keys), self.start, self.width
            layer.view()

    def _compact(self, tok: torch.Tensor) -> torch.Tensor:
        """The running rows as rows [0, running) of the buffers: each running row past them moves (its keys and
        values in the columns attention reads, and its state) into the slot of a row that left, and the rows past
        `running` go. Returns `tok` (the token each row feeds next) in the new order."""
        n = self.running
        holes = [r for r in range(n) if self.keys[r] is None]
        movers = [r for r in range(n, len(self.keys)) if self.keys[r] is not None]  # as many as the holes
        if movers:
            src = torch.tensor(movers, dtype=torch.long, device=self.device)
            dst = torch.tensor(holes, dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                for buf in (layer.key_buf, layer.value_buf):
                    buf[dst, :, self.start:self.width] = buf[src, :, self.start:self.width]
            for state in (self.keys, self.tokens, self.logprobs, self.versions):
                for a, b in zip(movers, holes):
                    state[b] = state[a]
            for t in (self.lengths, self.budgets, self.generated, self.uniforms, self.logits, tok):
                t[dst] = t[src]
        self._select(list(range(n)))
        self._set_view()  # a row that left may have been the oldest: attention starts later
        return tok[:n]

    def _relayout(self, keep: torch.Tensor) -> None:
        """New buffers holding the rows `keep` of the old ones (in that order) as rows [0, len(keep)), at the width
        of the longest row, with room for the engine's batch_size rows and every row's remaining tokens plus
        max_new_tokens more columns (rows that join later). The per-row state already says which rows there are
        (_select, and admit's rows, which _copy_in writes next). Only the masked columns in view are zeroed."""
        self.relayouts += 1
        width = int(self.lengths.max())
        most = int(self.budgets.max())
        capacity = width + int((self.budgets - self.generated).max()) + most
        new = _empty_cache(self.engine.model, max(len(self.keys), self.engine.batch_size), capacity)
        n_old, m = len(keep), min(self.width, width)
        if n_old:
            for old, dst in zip(self.cache.layers, new.layers):
                for name in ("key_buf", "value_buf"):
                    out = getattr(dst, name)
                    torch.index_select(getattr(old, name)[:, :, self.width - m:self.width], 0, keep,
                                       out=out[:n_old, :, width - m:width])
                    out[:n_old, :, :width - m].zero_()
        self.cache, self.width = new, width
        self._set_view()

    @torch.no_grad()
    def step(self, drop=frozenset()) -> list[tuple[object, Completion]]:
        """Sample every running row's next token; return the rows that finished (a stop token or their
        max_new_tokens) with their completions; the rows whose key is in `drop` stop with nothing back. Then the
        forward pass that gives every row its next logits."""
        s, device = self.settings, self.device
        n = len(self.keys)
        greedy = s.temperature <= 0
        logp = torch.log_softmax(self.logits / (1.0 if greedy else s.temperature), dim=-1)
        if greedy:
            tok = logp.argmax(-1)
        else:
            u = self.uniforms[torch.arange(n, device=device), self.generated.clamp(max=self.uniforms.shape[1] - 1)]
            tok = _inverse_cdf(_top_p(_top_k(logp, s.top_k), s.top_p).exp(), u)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        stopped = torch.isin(tok, self.stops)
        finished = stopped | (self.generated + 1 >= self.budgets)
        self.generated = self.generated + 1  # every row runs: rows that left were moved out at the last step
        out = []
        for r, (t, l, f, st) in enumerate(zip(tok.tolist(), lp.tolist(), finished.tolist(), stopped.tolist())):
            key = self.keys[r]
            if key in drop:
                self.keys[r] = None
                self.running -= 1
                continue
            self.tokens[r].append(t)
            self.logprobs[r].append(l)
            if f:
                out.append((key, Completion(token_ids=self.tokens[r], logprobs=self.logprobs[r],
                                            finish_reason="stop" if st else "length",
                                            policy_version=self.versions[r])))
                self.keys[r] = None
                self.running -= 1
        if not self.running:
            self._clear()
            return out
        if self.running < n:  # rows left: the last running rows move into their slots
            tok = self._compact(tok)
        positions = self.lengths.clone()  # the fed token's position: the tokens before it
        self.lengths = self.lengths + 1
        cols = torch.arange(self.start, self.width + 1, device=device)
        mask = cols >= self.width + 1 - self.lengths.unsqueeze(1)
        if self.engine.written_out_decode:
            self.logits = glm4moe_step.decode_logits(self.engine.model, tok, positions, mask[:, None, None, :],
                                                     self.cache).float()
        else:
            self.logits = self.engine.model(input_ids=tok.unsqueeze(1), attention_mask=mask.long(),
                                            position_ids=positions.unsqueeze(1), past_key_values=self.cache,
                                            use_cache=True).logits[:, -1].float()
        self.width += 1
        return out


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
        # decode steps and prefills through recipe.inference.glm4moe_step where it covers the model (the tiny model
        # on the CPU): the same logits, less CPU a step; any other model or device through transformers' forward
        self.written_out_decode = glm4moe_step.supported(model)

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

        Prompts whose settings other than the seed and max_new_tokens agree are decoded together, shortest
        prompts first, up to batch_size rows at a time, a waiting prompt joining as rows finish; each row samples
        from its own generator, seeded with its own seed.
        `cancelled`: called between decode steps, returns the indexes of prompts to stop (a set); those rows
        leave the batch at once and get None.
        """
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
        out: list[Completion | None] = [None] * len(prompts)
        for members in groups.values():
            waiting = sorted(members, key=lambda i: len(prompts[i]))
            batch = DecodeBatch(self, params[members[0]])
            gone: set[int] = set()
            while waiting or len(batch):
                if waiting and self.should_admit(len(batch), len(waiting)):
                    take, waiting = waiting[:self.batch_size - len(batch)], waiting[self.batch_size - len(batch):]
                    batch.admit(take, [prompts[i] for i in take], [params[i] for i in take])
                if cancelled is not None:
                    gone = cancelled() or gone
                    waiting = [i for i in waiting if i not in gone]
                for i, c in batch.step(drop=gone):
                    out[i] = c
        return out

    def should_admit(self, running: int, waiting: int) -> bool:
        """Whether waiting rows join now: a join costs a forward pass of its prompts (and a copy of the batch's
        cache when the buffers have no room), so rows join when the batch is empty, or when a quarter of it (or
        every row waiting) has room."""
        room = self.batch_size - running
        return room > 0 and (running == 0 or room >= min(waiting, max(1, self.batch_size // 4)))


def _top_k(logp: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k most likely tokens of each row, renormalised (-1 or 0: all of them): vLLM applies top-k first and
    top-p to what is left."""
    if top_k <= 0 or top_k >= logp.shape[-1]:
        return logp
    kth = logp.topk(top_k, dim=-1).values[..., -1:]
    kept = logp.masked_fill(logp < kth, float("-inf"))
    return kept - kept.logsumexp(-1, keepdim=True)


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
