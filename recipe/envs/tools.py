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

The chat format of calls and replies is recipe.chat's; the turns are run by recipe.rollout, in eval and RL.
"""
from __future__ import annotations

import ast
import math
import operator

from recipe.chat import ToolCallError, ends_with_tool_call, final_turn, parse_tool_call, tool_response
from recipe.envs.answers import candidate, normalize_number
from recipe.envs.base import Environment, MaskSample
from recipe.sandbox import Limits, run_python

INSTRUCTION = ('Tools: calculator(expression), python(code). Call one as <tool_call>{"name": "calculator", '
               '"arguments": {"expression": "2*3"}}</tool_call>. Answer with the number.')
TOOL_SPECS = [
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "python", "description": "Run a Python program in a sandbox; returns its stdout.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
]
MAX_RESPONSE_CHARS = 400  # tool output is cut here: long outputs would swamp a small context


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
    res = run_python(code, "", Limits(cpu_s=2.0, wall_s=5.0, memory_mb=256, output_bytes=4096))
    if res.sandbox_failed:  # the tool, not the model, failed: the sample cannot be judged fairly
        raise MaskSample(f"python tool: sandbox unavailable ({res.reason})")
    if res.status != "ok":
        tail = res.stderr.strip().splitlines()[-1:] or [res.reason]
        return f"error ({res.status}): {tail[0]}"
    return res.stdout.rstrip("\n")


TOOLS = {"calculator": ("expression", calculate), "python": ("code", run_python_tool)}


# ------------------------------------------------------------------------------------------------ calls

def run_tool_call(turn: str) -> str:
    try:
        name, args = parse_tool_call(turn)
    except ToolCallError as e:
        return f"error: {e}"
    if name not in TOOLS:
        return f"error: unknown tool '{name}' (known: {', '.join(sorted(TOOLS))})"
    key, fn = TOOLS[name]
    if key not in args:
        return f"error: {name} needs argument '{key}'"
    out = fn(args[key])
    return out if len(out) <= MAX_RESPONSE_CHARS else out[:MAX_RESPONSE_CHARS] + "...[cut]"


def answer_correct(answer: str, row: dict) -> float:
    pred, gold = normalize_number(candidate(answer)), normalize_number(row["answer"])
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
        if not ends_with_tool_call(turn):
            return None
        return tool_response(run_tool_call(turn))

    def score(self, completion: str, row: dict):
        # only the last turn answers: a </think> in an earlier turn must not be read as the answer
        return super().score(final_turn(completion), row)
