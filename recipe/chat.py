"""The chat format, in one place: special tokens, the template, think and tool markers, encode and decode.

GLM-4.5's layout: `[gMASK]<sop>`, then `<|role|>\\ncontent` per message. The model reasons in
`<think>...</think>` and answers after it. A tool call sits in `<tool_call>...</tool_call>` (JSON, or the
qwen3_coder form `<function=NAME><parameter=KEY>VALUE</parameter></function>` that INTELLECT-3 is served with)
and the model stops at `<|observation|>`; the environment's reply is
`\\n<tool_response>RESULT</tool_response><|assistant|>\\n`, after which the model goes on.

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
# single-turn data learns where to stop.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' -%}<|endoftext|>{%- endif -%}"
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
    """Schema messages as the template takes them (role and content)."""
    return [{"role": m["role"], "content": m["content"]} for m in raw]


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
