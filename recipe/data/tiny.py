"""The tiny suite: procedural tasks with short reasoning traces, split by a hash of the prompt.

Each task yields (question, answer, trace, entry). SFT completions are "<think>\ntrace\n</think>\nanswer"; the
pretraining corpus shows the same domain as plain text without the chat format, so the base model knows the
domain but not the format.
"""
from __future__ import annotations

import hashlib
import json
import random
import warnings

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipe.chat import OBSERVATION, tool_call, tool_response
from recipe.data.schema import message
from recipe.envs import ENVIRONMENTS
from recipe.envs.math import INSTRUCTION as MATH_INSTRUCTION
from recipe.envs.tools import INSTRUCTION as TOOLS_INSTRUCTION
from recipe.envs.tools import TOOL_SPECS
from recipe.envs.vf_adapter import VerifiersEnv, rows_from_params
from recipe.errors import ConfigError, DataError

SPLIT_BUCKETS = {"eval": range(0, 2), "rl": range(2, 6), "sft": range(6, 20)}  # of 20 buckets


def split_of(prompt_text: str) -> str:
    """Split from a hash of the prompt: the same prompt always lands in the same split, so splits never overlap."""
    bucket = int(hashlib.sha256(prompt_text.encode()).hexdigest(), 16) % 20
    return next(name for name, b in SPLIT_BUCKETS.items() if bucket in b)


def gen_add(rng: random.Random, min_digits: int = 2, max_digits: int = 4):
    """a + b with a column-by-column trace (units first, carries explicit)."""
    digits = rng.randint(min_digits, max_digits)
    a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
    sa, sb = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for i in range(digits):
        s = int(sa[i]) + int(sb[i]) + carry
        steps.append(f"{sa[i]}+{sb[i]}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    trace = " ".join(steps) + f" so {a + b}"
    entry = {"question": f"What is {a} + {b}?", "answer": str(a + b), "metadata": {"digits": digits}}
    return entry["question"], str(a + b), trace, entry, float(digits)


def gen_tool_mul(rng: random.Random, min_digits: int = 2, max_digits: int = 2):
    """a * b: too hard for the tiny model in its head, one calculator call away (env tools)."""
    da, db = rng.randint(min_digits, max_digits), rng.randint(min_digits, max_digits)
    a, b = rng.randint(10 ** (da - 1), 10**da - 1), rng.randint(10 ** (db - 1), 10**db - 1)
    entry = {"question": f"What is {a} * {b}?", "answer": str(a * b), "metadata": {"a": a, "b": b}}
    return entry["question"], str(a * b), f"{a}*{b}={a * b}", entry, float(da + db)


def tool_sft_completion(prompt: str, entry: dict, hasty_fraction: float) -> str:
    """A calculator call, the tool's reply, then the answer, as one transcript. The reply is the text
    ToolsEnv.tool_reply writes; SFT (recipe.sft.chat_dataset) finds it there and leaves it out of the loss, as
    RL does. For a hashed share of prompts a hasty demonstrator answers at once with a guess, often wrong, as
    the tiny model would: RL then finds that calling the tool pays."""
    a, b = entry["metadata"]["a"], entry["metadata"]["b"]
    h = int(hashlib.sha256(f"hasty:{prompt}".encode()).hexdigest(), 16)
    if h % 10_000 / 10_000 < hasty_fraction:
        guess = a * b + (0 if (h >> 20) % 4 == 0 else ((h >> 24) % 99 + 1) * (1 if (h >> 32) % 2 else -1))
        return f"<think>\n</think>\n{guess}"
    return (tool_call("calculator", expression=f"{a}*{b}") + OBSERVATION + tool_response(str(a * b))
            + f"<think>\n</think>\n{a * b}")


def _rg_entries(name: str, size: int, seed: int, params: dict):
    import reasoning_gym

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **params)


def trace_chain_sum(entry) -> str:
    tokens = entry["metadata"]["expression"].split()
    acc, steps = int(tokens[0]), []
    for op, num in zip(tokens[1::2], tokens[2::2]):
        new = acc + int(num) if op == "+" else acc - int(num)
        steps.append(f"{acc}{op}{num}={new}")
        acc = new
    return " ".join(steps)


def trace_spell_backward(entry) -> str:
    word = entry["metadata"]["word"]
    return " ".join(word) + " reversed: " + " ".join(reversed(word))


def trace_letter_counting(entry) -> str:
    letter = entry["metadata"]["target_letter"]
    parts = [f"{w}:{w.lower().count(letter)}" for w in entry["metadata"]["span"]]
    return " ".join(parts) + f" total {entry['answer']}"


def trace_leg_counting(entry) -> str:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    parts, total = [], 0
    for animal, count in entry["metadata"]["animals"].items():
        legs = ANIMALS[animal]
        parts.append(f"{count} {animal}: {count}*{legs}={count * legs}")
        total += count * legs
    return " ".join(parts) + f" total {total}"


RG_TRACES = {"chain_sum": trace_chain_sum, "spell_backward": trace_spell_backward,
             "letter_counting": trace_letter_counting, "leg_counting": trace_leg_counting}
RG_DIFFICULTY = {"chain_sum": lambda m: m["num_terms"] + m["num_digits"], "spell_backward": lambda m: m["word_len"],
                 "letter_counting": lambda m: m["span_length"], "leg_counting": lambda m: m["num_animals"]}


FN_NAMES = "fghk"


def gen_fn_fit(rng: random.Random, max_slope: int = 9, max_intercept: int = 99, names: str = FN_NAMES):
    """Code: write name(x) = a*x + b from its values at x = 0, 1, 2; reward 1 when the program passes every
    hidden test (x = 3, 4, 7, 10, -2), run in the sandbox, else 0. The trace reads b off f(0) and a off a
    difference, so the tiny model can learn it; the function's name varies so that there are enough distinct
    prompts."""
    a, b, name = rng.randint(1, max_slope), rng.randint(0, max_intercept), rng.choice(names)
    examples = ", ".join(f"{name}({x})={a * x + b}" for x in (0, 1, 2))
    question = f"Write a Python function {name}(x) with {examples}."
    code = f"def {name}(x):\n    return {a}*x+{b}" if b else f"def {name}(x):\n    return {a}*x"
    trace = f"b={name}(0)={b}; a={name}(1)-{name}(0)={a * 1 + b}-{b}={a}"
    hidden = [3, 4, 7, 10, -2]
    entry = {"question": question, "answer": code, "metadata": {"slope": a, "intercept": b, "name": name},
             "tests": {"fn_name": name, "inputs": [[x] for x in hidden], "outputs": [a * x + b for x in hidden]}}
    return question, code, trace, entry, float(a)


def task_items(spec, n: int, seed: int):
    """n items of one task, as (question, answer, trace, entry, difficulty)."""
    params, task = dict(spec.params), spec.task  # read once (see build_tiny)
    if task == "add":
        rng = random.Random(f"{seed}-add")
        return [gen_add(rng, **params) for _ in range(n)]
    if task == "fn_fit":
        rng = random.Random(f"{seed}-fn_fit")
        return [gen_fn_fit(rng, **params) for _ in range(n)]
    if task == "tool_mul":
        rng = random.Random(f"{seed}-tool_mul")
        return [gen_tool_mul(rng, **params) for _ in range(n)]
    if task not in RG_TRACES:
        raise DataError(f"tiny data: unknown task '{task}' (known: add, fn_fit, tool_mul, {', '.join(RG_TRACES)})")
    items = []
    for entry in _rg_entries(task, n, seed, params):
        entry = {"question": entry["question"], "answer": entry["answer"],
                 "metadata": json.loads(json.dumps(entry["metadata"], default=list))}
        diff = float(RG_DIFFICULTY[task](entry["metadata"]))
        items.append((entry["question"], entry["answer"], RG_TRACES[task](entry), entry, diff))
    return items


def prompt_text(env: str, question: str) -> str:
    if env == "tools":
        return f"{TOOLS_INSTRUCTION}\n{question}"
    return f"{MATH_INSTRUCTION}\n{question}" if env == "math" else question


def answer_text(env: str, answer: str) -> str:
    if env == "code":
        return f"```python\n{answer}\n```"
    return f"\\boxed{{{answer}}}" if env == "math" else answer


def sft_completion(prompt: str, trace: str, answer: str, no_think_fraction: float) -> str:
    """The demonstration: a short reasoning in <think>, then the answer; for a hashed share of prompts, the
    answer alone (a hasty demonstrator)."""
    draw = int(hashlib.sha256(f"no-think:{prompt}".encode()).hexdigest(), 16) % 10_000 / 10_000
    if draw < no_think_fraction:
        return f"<think>\n</think>\n{answer}"
    return f"<think>\n{trace}\n</think>\n{answer}"


def verifiers_rows(spec, key: str, want: dict) -> dict[str, list[dict]]:
    """The rows of a verifiers taskset (recipe/envs/vf_adapter.py), split by a hash of the prompt as the tiny
    tasks are: the held-out share goes to eval, the rest to rl (a taskset brings no demonstration to train SFT
    on); each split takes up to its rows per task, and the taskset is read no further than both need."""
    by_split = {"rl": [], "eval": []}
    try:
        # the params go into every row's info as JSON: plain values, not omegaconf's containers
        params = spec.params
        params = OmegaConf.to_container(params, resolve=True) if isinstance(params, (DictConfig, ListConfig)) \
            else dict(params)
        for row in rows_from_params(params, spec.task, key, spec.difficulty):
            split = "eval" if split_of("\n".join(m["content"] for m in row["prompt"])) == "eval" else "rl"
            if len(by_split[split]) < want[split]:
                by_split[split].append({**row, "split": split})
            if all(len(rows) >= want[name] for name, rows in by_split.items()):
                break
    except ConfigError as e:  # the task's params, or a taskset the adapter refuses
        raise type(e)(f"config error: {e}") from None
    return by_split


def build_tiny(data_cfg) -> dict[str, list[dict]]:
    """Rows for every split: sft, rl, eval (schema rows) and pretrain (plain text rows)."""
    want = {"sft": data_cfg.sft_rows_per_task, "rl": data_cfg.rl_rows_per_task, "eval": data_cfg.eval_rows_per_task}
    # read once: an omegaconf attribute costs tens of microseconds, and the loop below reads these per item
    pretrain_per_task, hasty, no_think = (data_cfg.pretrain_rows_per_task, data_cfg.tool_hasty_fraction,
                                          data_cfg.no_think_fraction)
    out = {"sft": [], "rl": [], "eval": [], "pretrain": []}
    # extra_tasks come after tasks, so enabling one leaves the seeds and rows of the others as they were
    for t_idx, spec in enumerate(list(data_cfg.tasks) + list(getattr(data_cfg, "extra_tasks", []))):
        # draw a pool large enough that the smallest split fills up (eval holds 2 of 20 buckets)
        pool_size = max(14 * want["eval"], 3 * (want["sft"] + want["rl"] + want["eval"]))
        n = len(data_cfg.tasks)
        key = f"data.tasks[{t_idx}]" if t_idx < n else f"data.extra_tasks[{t_idx - n}]"
        if spec.env not in ENVIRONMENTS:
            raise ConfigError(f"config error: {key}.env={spec.env!r} is not an environment "
                              f"(known: {', '.join(sorted(ENVIRONMENTS))})")
        if spec.env == VerifiersEnv.name:
            for split, rows in verifiers_rows(spec, key, want).items():
                out[split].extend(rows)
            continue
        try:
            pool = task_items(spec, pool_size, data_cfg.seed * 1000 + t_idx)
        except (TypeError, ValueError, AssertionError) as e:  # the generator refuses its arguments
            raise ConfigError(f"config error: {key}.params={dict(spec.params)}: task '{spec.task}' refuses them: "
                              f"{e}") from None
        seen, by_split = set(), {"sft": [], "rl": [], "eval": []}
        env, task, pretrain_cap = spec.env, spec.task, pretrain_per_task * (t_idx + 1)
        for question, answer, trace, entry, diff in pool:
            text = prompt_text(env, question)
            if text in seen:
                continue
            seen.add(text)
            split = split_of(text)
            if len(by_split[split]) >= want[split]:
                if split == "sft" and len(out["pretrain"]) < pretrain_cap:
                    out["pretrain"].append({"text": f"{question}\n{trace}\n{answer}"})
                continue
            if env == "tools":
                completion = tool_sft_completion(text, entry, hasty)
            else:
                completion = sft_completion(text, trace, answer_text(env, answer), no_think)
            row = {
                "id": f"{task}-{hashlib.sha256(text.encode()).hexdigest()[:12]}",
                "env": env, "task": task, "split": split,
                "prompt": [message("user", text)],
                "completion": [message("assistant", completion)] if split == "sft" else [],
                "answer": answer,
                "info": json.dumps({"task": task, "entry": entry}, sort_keys=True),
                "difficulty": diff, "tools": json.dumps(TOOL_SPECS) if env == "tools" else "[]",
            }
            by_split[split].append(row)
            if split == "sft" and len(out["pretrain"]) < pretrain_cap:
                out["pretrain"].append({"text": f"{question}\n{trace}\n{answer}"})
        for split, rows in by_split.items():
            if len(rows) < want[split]:
                raise DataError(f"tiny data: task '{spec.task}' has only {len(rows)} distinct {split} prompts "
                                 f"(asked for {want[split]}): widen its params or ask for fewer rows")
            out[split].extend(rows)
    return out
