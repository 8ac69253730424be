"""The hf engine: batched sampling with transformers' generate, returning the sampled tokens' logprobs.

Logprobs are taken from the raw logits divided by the temperature over the full vocabulary (no top-k), the
same distribution the RL trainer recomputes, so the importance ratio starts at 1 up to numerics.
"""
from __future__ import annotations

import torch

from recipe.inference import Completion, SamplingParams


class HFEngine:
    def __init__(self, model, tokenizer, stop_ids: list[int], batch_size: int = 64):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id
        self.batch_size = batch_size
        self.policy_version = 0

    @classmethod
    def from_pretrained(cls, path: str, batch_size: int = 64):
        from recipe.model import load_pretrained, stop_token_ids

        model, tokenizer = load_pretrained(path)
        return cls(model, tokenizer, stop_token_ids(tokenizer), batch_size)

    def update_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt; prompts of similar length are batched together."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Completion | None] = [None] * len(prompts)
        gen = torch.Generator().manual_seed(params.seed)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            for i, c in zip(idx, self._generate_batch([prompts[i] for i in idx], params, gen)):
                out[i] = c
        return out

    def _generate_batch(self, prompts, params: SamplingParams, gen: torch.Generator) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        greedy = params.temperature <= 0
        # seed the global RNG from our generator: generate() samples with torch.multinomial on it
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        res = self.model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=None if greedy else 0,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id, output_logits=True,
            return_dict_in_generate=True,
        )
        new = res.sequences[:, width:]
        logits = torch.stack(res.logits, dim=1).float()  # [batch, new, vocab], before any processing
        logp = torch.log_softmax(logits / (1.0 if greedy else params.temperature), dim=-1)
        token_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        out = []
        stops = set(self.stop_ids)
        for row in range(len(prompts)):
            ids = new[row].tolist()
            n = next((j + 1 for j, t in enumerate(ids) if t in stops), len(ids))
            out.append(Completion(token_ids=ids[:n], logprobs=token_logp[row, :n].tolist(),
                                  finish_reason="stop" if ids[n - 1] in stops else "length",
                                  policy_version=self.policy_version))
        return out
