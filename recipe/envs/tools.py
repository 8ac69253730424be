"""Tools: a multi-turn environment where the model may call a calculator or Python before it answers.

A tool-calling turn holds one call in <tool_call>...</tool_call>, as JSON
    <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>
or in the qwen3_coder form INTELLECT-3 serves with
    <tool_call><function=calculator><parameter=expression>37*48</parameter></function></tool_call>
and ends where generation stops at <|observation|> (a stop token). The environment then appends
    \\n<tool_response>RESULT</tool_response><|assistant|>\\n
as environment tokens (loss_mask 0 in RL) and the model goes on, for at most max_turns model turns. A turn that
does not end at <|observation|> is final. A bad call (invalid JSON, unknown tool, bad expression) gets an error
in the tool response, never an exception. A tool that itself fails (the python tool's sandbox is down) ends the
sample as masked: neither right nor wrong, like a broken verifier. The answer is read from the last model turn,
after its </think>.

Rollout helpers shared by eval and RL: Transcript accumulates a sample's turns, next_reply decides on the next one.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass, field

from recipe.envs.base import Environment, MaskSample, RewardResult

OBSERVATION = "<|observation|>"
ASSISTANT = "<|assistant|>"
INSTRUCTION = ('Tools: calculator(expression), python(code). Call one as <tool_call>{"name": "calculator", '
               '"arguments": {"expression": "2*3"}}</tool_call>. Answer with the number.')
TOOL_SPECS = [
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "python", "description": "Run a Python program in a sandbox; returns its stdout.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
]
MAX_RESPONSE_CHARS = 400  # tool output is cut here: long outputs would swamp a small context

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FN = re.compile(r"<function=([\w.-]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([\w.-]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ToolError(Exception):
    pass


# ------------------------------------------------------------------------------------------------ calculator

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_ABS = 10 ** 100  # bounds every intermediate value: no expression can take long or much memory
MAX_EXPR_CHARS = 200


def _check(v):
    if isinstance(v, complex) or abs(v) > MAX_ABS:
        raise ToolError("result too large")
    return v


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # refuse before computing: 9**9**9 would otherwise hang
            if abs(b) > 1000 or (abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > 100):
                raise ToolError("exponent too large")
        try:
            return _check(_BIN[type(node.op)](a, b))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(f"unsupported expression element: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Arithmetic only (numbers, + - * / // % **, parentheses); an error string instead of any exception."""
    if not isinstance(expression, str):
        return "error: expression must be a string"
    if len(expression) > MAX_EXPR_CHARS:
        return "error: expression too long"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except ToolError as e:
        return f"error: {e}"
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        return f"error: {type(e).__name__}"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".12g")
    return str(value)


# ------------------------------------------------------------------------------------------------ python

def run_python_tool(code: str) -> str:
    """Model-written code runs in recipe.sandbox only, with small limits."""
    if not isinstance(code, str):
        return "error: code must be a string"
    from recipe.sandbox import Limits, run_python  # imported here: the calculator does not need it

    res = run_python(code, "", Limits(cpu_s=2.0, wall_s=5.0, memory_mb=256, output_bytes=4096))
    if res.sandbox_failed:  # the tool, not the model, failed: the sample cannot be judged fairly
        raise MaskSample(f"python tool: sandbox unavailable ({res.reason})")
    if res.status != "ok":
        tail = res.stderr.strip().splitlines()[-1:] or [res.reason]
        return f"error ({res.status}): {tail[0]}"
    return res.stdout.rstrip("\n")


TOOLS = {"calculator": ("expression", calculate), "python": ("code", run_python_tool)}


# ------------------------------------------------------------------------------------------------ parsing

def parse_tool_call(turn: str) -> tuple[str, dict]:
    """(name, arguments) of the first call in the turn; ToolError says what is wrong with it."""
    m = _CALL.search(turn)
    if m is None:
        raise ToolError("no <tool_call> found")
    body = m.group(1).strip()
    fn = _XML_FN.search(body)
    if fn is not None:  # qwen3_coder form
        return fn.group(1), {k: v for k, v in _XML_PARAM.findall(fn.group(2))}
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolError(f"invalid JSON in tool call ({e.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError('tool call must be {"name": ..., "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):  # OpenAI-style arguments given as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolError("arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be an object")
    return call["name"], args


def run_tool_call(turn: str) -> str:
    try:
        name, args = parse_tool_call(turn)
    except ToolError as e:
        return f"error: {e}"
    if name not in TOOLS:
        return f"error: unknown tool '{name}' (known: {', '.join(sorted(TOOLS))})"
    key, fn = TOOLS[name]
    if key not in args:
        return f"error: {name} needs argument '{key}'"
    out = fn(args[key])
    return out if len(out) <= MAX_RESPONSE_CHARS else out[:MAX_RESPONSE_CHARS] + "...[cut]"


def final_turn(transcript: str) -> str:
    """The last model turn: what follows the last environment reply."""
    return transcript.rsplit(ASSISTANT, 1)[-1]


def _normalise(s: str) -> str:
    m = re.search(r"\\boxed\{([^{}]*)\}", s)
    s = m.group(1) if m else s
    return s.strip().replace(",", "").replace(" ", "").rstrip(".")


def answer_correct(answer: str, row: dict) -> float:
    pred, gold = _normalise(answer), _normalise(row["answer"])
    if pred == gold:
        return 1.0
    try:
        return float(math.isclose(float(pred), float(gold), rel_tol=1e-9, abs_tol=1e-9))
    except ValueError:
        return 0.0


class ToolsEnv(Environment):
    name = "tools"
    multi_turn = True
    max_turns = 3  # model turns per sample, the final answer included
    rubric = [("correct", answer_correct, 1.0)]

    def tool_reply(self, turn: str, row: dict) -> str | None:
        """The environment's reply to one model turn, or None when the turn is final (it did not stop at
        <|observation|>)."""
        if not turn.rstrip().endswith(OBSERVATION):
            return None
        return f"\n<tool_response>{run_tool_call(turn)}</tool_response>{ASSISTANT}\n"

    def score(self, completion: str, row: dict):
        # only the last turn answers: a </think> in an earlier turn must not be read as the answer
        return super().score(final_turn(completion), row)


# ------------------------------------------------------------------------------------------------ rollouts

@dataclass
class Transcript:
    """One sample's turns so far: model tokens (loss_mask 1) and environment tokens (loss_mask 0, logprob 0)."""

    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    turns: int = 0
    last_turn: list = field(default_factory=list)
    finish_reason: str = "stop"
    policy_version: int | None = None
    mask_reason: str | None = None  # set when a tool failed (not the model): the sample is masked

    def add_model(self, completion) -> None:
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.loss_mask += [1] * len(completion.token_ids)
        self.last_turn = list(completion.token_ids)
        self.turns += 1
        self.finish_reason = completion.finish_reason
        v = completion.policy_version
        self.policy_version = v if self.policy_version is None else min(self.policy_version, v)

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def completion(self):
        from recipe.inference import Completion

        extra = {"loss_mask": list(self.loss_mask), "turns": self.turns}
        if self.mask_reason:
            extra["mask_reason"] = self.mask_reason
        return Completion(list(self.ids), list(self.logprobs), self.finish_reason, self.policy_version or 0,
                          extra=extra)


def next_reply(env, tokenizer, transcript: Transcript, row: dict) -> list[int] | None:
    """Token ids of the environment's reply to the last model turn, or None when the sample is final."""
    from recipe.model import completion_text

    if transcript.turns >= env.max_turns or transcript.finish_reason != "stop":
        return None
    try:
        reply = env.tool_reply(completion_text(tokenizer, transcript.last_turn), row)
    except MaskSample as e:  # the sample ends here, masked
        transcript.mask_reason = str(e)
        return None
    return None if reply is None else tokenizer.encode(reply, add_special_tokens=False)


def score_sample(env, text: str, row: dict, completion) -> RewardResult:
    """env.score, except that a sample whose tool failed is masked whatever its text says."""
    reason = completion.extra.get("mask_reason") if completion.extra else None
    if reason:
        return RewardResult(reward=0.0, masked=True, mask_reason=reason)
    return env.score(text, row)
