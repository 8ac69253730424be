"""The chat format, in one place: special tokens, the template, think and tool markers, encode and decode.

GLM-4.5's layout: `[gMASK]<sop>`, then `<|role|>\\ncontent` per message. The model reasons in
`<think>...</think>` and answers after it. A tool call sits in `<tool_call>...</tool_call>` (JSON, or the
qwen3_coder form `<function=NAME><parameter=KEY>VALUE</parameter></function>` that INTELLECT-3 is served with)
and the model stops at `<|observation|>`; the environment's reply is
`\\n<tool_response>RESULT</tool_response><|assistant|>\\n`, after which the model goes on.

Tool use in the template (CHAT_TEMPLATE, the tiny model's; a hub model brings its own): `tools`, a list of JSON
schemas, is rendered as a system block before the messages; an assistant message's `tool_calls` as qwen3_coder
calls after its content, the turn closed by <|observation|> (the stop token a tool-calling turn ends at) instead
of <|endoftext|>; a `tool` message as the environment's reply, `\\n<tool_response>RESULT</tool_response>`, the next
assistant turn opening with <|assistant|>\\n, exactly what tool_response() writes in RL. Messages without
tool_calls and no tools render as they always did.

Data (SFT demonstrations), the environments, the rollout and eval all read these names from here.
"""
from __future__ import annotations

import json
import re

ENDOFTEXT = "<|endoftext|>"
OBSERVATION = "<|observation|>"
ASSISTANT = "<|assistant|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"

# GLM-4.5's chat tokens; a turn ends where the next role token (or end of text) begins.
SPECIAL_TOKENS = [ENDOFTEXT, "<|pad|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", ASSISTANT, OBSERVATION,
                  THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END]
STOP_TOKENS = [ENDOFTEXT, "<|user|>", OBSERVATION]
# Same shape as GLM-4.5's template. The assistant turn is closed by <|endoftext|> so that a model trained on
# single-turn data learns where to stop. Tool definitions, tool calls and tool replies: see the module docstring;
# trim_blocks/lstrip_blocks (transformers' settings) never touch these lines, whose newlines are all in strings.
TOOLS_HEADER = ("# Tools\nYou may call the functions below. To call one, reply with\n"
                "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>\n"
                "<tools>")
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}"
    "{{ '<|system|>\\n" + TOOLS_HEADER.replace("\n", "\\n") + "' }}"
    "{%- for t in tools -%}{{ '\\n' + (t | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{ '\\n<tool_response>' + m['content'] + '</tool_response>' }}"
    "{%- else -%}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] -%}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{{ '<tool_call>\\n<function=' + f['name'] + '>\\n' }}"
    "{%- for k, v in f['arguments'].items() -%}"
    "{{ '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor -%}"
    "{{ '</function>\\n</tool_call>' }}"
    "{%- endfor -%}"
    "<|observation|>"
    "{%- elif m['role'] == 'assistant' -%}<|endoftext|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif -%}"
)

# The environment's reply inside a transcript: from just after the model's <|observation|> stop token through
# the <|assistant|>\n that hands the turn back (group 1), as tool_response() writes it.
ENV_REPLY = re.compile(re.escape(OBSERVATION) + "(\n" + re.escape(TOOL_RESPONSE_START) + ".*?"
                       + re.escape(TOOL_RESPONSE_END) + re.escape(ASSISTANT) + "\n)", re.DOTALL)
_CALL = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_XML_FN = re.compile(r"<function=([\w.-]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([\w.-]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ToolCallError(Exception):
    """A tool call the environment cannot parse; its message goes back to the model in the tool response."""


def stop_token_ids(tokenizer) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


def messages(raw: list[dict]) -> list[dict]:
    """Schema messages as the template takes them: role and content, and the tool calls of a message that has
    some (template_tool_calls); a message without any has no `tool_calls` key, so it renders as it always did."""
    out = []
    for m in raw:
        msg = {"role": m["role"], "content": m["content"]}
        calls = template_tool_calls(m.get("tool_calls"))
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def template_tool_calls(tool_calls) -> list[dict] | None:
    """A message's tool calls (the schema's JSON string, or the list itself) as chat templates take them:
    OpenAI-style {"type": "function", "function": {"name", "arguments"}} with the arguments an object, which
    GLM-4.5's, qwen3_coder's and this project's templates iterate key by key (the hub rows give them as a JSON
    string). None when there are none; ValueError for calls that are not of that shape."""
    if tool_calls is None or tool_calls == "" or tool_calls == []:
        return None
    calls = json.loads(tool_calls) if isinstance(tool_calls, str) else tool_calls
    if not isinstance(calls, list):
        raise ValueError(f"tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"a tool call without a function name: {str(call)[:120]}")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of tool call {fn['name']!r} are not an object: {str(args)[:120]}")
        out.append({**(call if "function" in call else {"type": "function"}),
                    "function": {**fn, "arguments": args}})
    return out


def template_tools(row: dict) -> list[dict] | None:
    """The tool definitions (JSON schemas, the row's `tools`) the chat template renders for a row, or None.

    Only a demonstration row (env `sft`: INTELLECT-3-SFT) hands its tools to the template: its tools belong to
    the conversation. An environment's rows are rendered as RL and eval render their prompts (encode_prompt,
    which passes no tools), so that SFT trains on the prompt tokens the policy later sees; the tiny tools
    environment names its tools in its instruction, and its `tools` column records what the environment offers."""
    if row.get("env") != "sft":
        return None
    tools = json.loads(row.get("tools") or "[]")
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of JSON schemas, got {type(tools).__name__}")
    return tools or None


def encode_prompt(tokenizer, prompt: list[dict]) -> list[int]:
    """Chat-template the messages with the generation prompt and return token ids."""
    text = tokenizer.apply_chat_template(messages(prompt), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def completion_text(tokenizer, token_ids: list[int]) -> str:
    """The completion as the environments see it: decoded, cut at the end-of-text stop token."""
    return tokenizer.decode(token_ids, skip_special_tokens=False).split(ENDOFTEXT)[0]


def parse_final_answer(completion: str) -> str | None:
    """The answer is what follows the last </think>. No </think>: the model did not follow the format."""
    if THINK_END not in completion:
        return None
    return completion.rsplit(THINK_END, 1)[1].strip()


def final_turn(transcript: str) -> str:
    """The last model turn of a multi-turn transcript: what follows the last environment reply."""
    return transcript.rsplit(ASSISTANT, 1)[-1]


def ends_with_tool_call(turn: str) -> bool:
    """A model turn that stopped at <|observation|> asks for a tool; any other turn is final."""
    return turn.rstrip().endswith(OBSERVATION)


def tool_call(name: str, **arguments) -> str:
    """A tool call in the JSON form, as the tiny SFT demonstrations write it."""
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def tool_response(result: str) -> str:
    """The environment's reply to a tool call (tokenized on its own; loss_mask 0 in SFT and RL)."""
    return f"\n{TOOL_RESPONSE_START}{result}{TOOL_RESPONSE_END}{ASSISTANT}\n"


def parse_tool_call(turn: str) -> tuple[str, dict]:
    """(name, arguments) of the first call in the turn; ToolCallError says what is wrong with it."""
    m = _CALL.search(turn)
    if m is None:
        raise ToolCallError(f"no {TOOL_CALL_START} found")
    body = m.group(1).strip()
    fn = _XML_FN.search(body)
    if fn is not None:  # qwen3_coder form
        return fn.group(1), {k: v for k, v in _XML_PARAM.findall(fn.group(2))}
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"invalid JSON in tool call ({e.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('tool call must be {"name": ..., "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):  # OpenAI-style arguments given as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError("arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolCallError("arguments must be an object")
    return call["name"], args
