"""Test doubles: a character tokenizer and a scripted engine that answers at once."""
import time

from recipe.inference.engine import Done
from recipe.rollout import Completion


class CharTokenizer:
    pad_token_id = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers every request with answer_fn(prompt_text, sample_index), tagged with the current version
    (the Engine contract of recipe.inference.engine)."""

    def __init__(self, answer_fn, batch: int = 1000):
        self.answer_fn = answer_fn
        self.policy_version = 0
        self.pending = []
        self.events = []
        self.batch = batch
        self.submitted = 0
        self.sent = []  # every request submitted, in order
        self.cancels = []  # the request ids of each cancel() call

    def submit(self, requests):
        self.pending.extend(requests)
        self.sent.extend(requests)
        self.submitted += len(requests)

    def cancel(self, request_ids):
        self.cancels.append(list(request_ids))
        drop = set(request_ids)
        self.pending = [r for r in self.pending if r.id not in drop]

    def update_weights(self, path, version):
        self.policy_version = version

    def poll(self, timeout=None):
        if self.events:
            return self.events.pop(0)
        if not self.pending:
            if timeout:  # a real engine blocks for up to `timeout`; do so briefly, so a poller does not spin
                time.sleep(min(timeout, 0.01))
            return None
        batch, self.pending = self.pending[:self.batch], self.pending[self.batch:]
        out = []
        for r in batch:
            text = self.answer_fn("".join(chr(i) for i in r.prompt_ids), r.id)
            ids = [ord(c) for c in text]
            out.append((r.id, Completion(ids, [-1.0] * len(ids), "stop", self.policy_version)))
        return Done(out, 0.01)

    def close(self):
        pass


class TokenEngine:
    """The Engine contract on a real tokenizer's ids, answering at once: prompt `Q<n>` gets `<think>t</think><n>`
    from the first sample of its group and a wrong answer from the others, so every group carries signal.
    `delay` seconds a poll that answers slow the caller down (a step takes about that long); `on_close` runs at
    close()."""

    def __init__(self, tokenizer, version: int = 0, delay: float = 0.0, on_close=None):
        import threading

        self.tok = tokenizer
        self.policy_version = version
        self.pending = []
        self.lock = threading.Lock()
        self.delay, self.on_close = delay, on_close
        self.stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def submit(self, requests):
        with self.lock:
            self.pending.extend(requests)

    def update_weights(self, path, version):
        self.policy_version = version

    def cancel(self, request_ids):
        drop = set(request_ids)
        with self.lock:
            self.pending = [r for r in self.pending if r.id not in drop]

    def poll(self, timeout=None):
        import math

        with self.lock:
            batch, self.pending = self.pending, []
        if not batch:
            time.sleep(min(timeout or 0, 0.01))
            return None
        time.sleep(self.delay)
        out = []
        for r in batch:
            n = self.answer(self.tok.decode(r.prompt_ids))
            # sample 0 of its group: the orchestrator seeds sample s of group g rl.seed * 1_000_003 + g * 1000 + s
            right = r.params.seed % 1000 == 0  # (so: run with rl.seed=0)
            ids = self.tok.encode(f"<think>t</think>{n if right else -1}", add_special_tokens=False)
            ids = (ids + [self.stop_id])[:r.params.max_new_tokens]
            out.append((r.id, Completion(ids, [-math.log(len(self.tok))] * len(ids), "stop", self.policy_version)))
        return Done(out, 0.01)

    def answer(self, prompt: str) -> str:
        """The right answer to `prompt` (`Q<n>` asks for n)."""
        import re

        return re.search(r"Q(\d+)", prompt).group(1)

    def close(self):
        if self.on_close is not None:
            self.on_close()


def save_tiny_qa_model(folder, texts=None):
    """A tiny random Glm4MoeForCausalLM and a tokenizer trained on `texts` (default: `Q<n>` prompts and
    `<think>t</think><n>` answers), saved to `folder` (the start model of the RL loop's tests)."""
    from recipe.config import TinyArch
    from recipe.model import build_tiny_model, build_tokenizer

    texts = texts or [f"Q{i} <think>t</think>{i}" for i in range(100)]
    tok = build_tokenizer(texts, vocab_size=160)
    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                    max_position_embeddings=128)
    build_tiny_model(arch, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def write_math_rl_data(cfg, n=40):
    """A finished data stage of `n` math RL rows `Q<i>` -> `<i>` under cfg's run root (manifest and DONE.json
    as `make data` writes them), for RL runs from save_tiny_qa_model."""
    import json

    from recipe.data.schema import message, write_rows
    from recipe.runs import Stage, stage_dir, write_atomic

    data = stage_dir(cfg, "data")
    rows = [{"id": f"q{i}", "env": "math", "task": "add", "split": "rl", "prompt": [message("user", f"Q{i}")],
             "completion": [], "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(n)]
    sha = write_rows(rows, data / "rl.parquet")
    write_atomic(data / "data_manifest.json", json.dumps({"files": {"rl.parquet": {"rows": n, "sha256": sha}}}))
    write_atomic(data / "DONE.json", json.dumps({"config_hash": Stage(cfg, "data").hash}))
