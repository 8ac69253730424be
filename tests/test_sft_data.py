"""SFT data: a tool-use demonstration is tokenized as RL sees it, the environment's reply out of the loss; any
other row gets exactly the ids and loss mask of TRL's own prompt/completion processing."""
import json

import pytest

from recipe.chat import ASSISTANT, OBSERVATION


def _calls_tool(row) -> bool:
    return OBSERVATION in row["completion"][0]["content"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A few rows of a math, a logic and the tools task, and a tokenizer trained as `make base` trains it."""
    from recipe.config import load_config
    from recipe.data.tiny import build_tiny
    from recipe.model import build_tokenizer

    root = tmp_path_factory.mktemp("runs")
    cfg = load_config([f"run_root={root}", "data.sft_rows_per_task=12", "data.rl_rows_per_task=2",
                       "data.eval_rows_per_task=2", "data.pretrain_rows_per_task=50",
                       "data.tasks=[{env: math, task: add, params: {}}, {env: logic, task: letter_counting, "
                       "params: {min_words: 3, max_words: 4}}]",
                       "data.extra_tasks=[{env: tools, task: tool_mul, params: {min_digits: 2, max_digits: 2}}]"])
    data = build_tiny(cfg.data)
    rows = data["sft"]
    texts = [r["text"] for r in data["pretrain"]] + [r["prompt"][0]["content"] + r["completion"][0]["content"]
                                                      for r in rows]
    tokenizer = build_tokenizer(texts, cfg.model.tiny.vocab_size)
    calls = [r for r in rows if _calls_tool(r)]
    assert calls and len(calls) < len(rows), "the rows must hold tool calls and rows without one"
    return cfg, tokenizer, rows


def test_tool_reply_is_out_of_the_loss_and_ids_are_those_rl_sees(tiny):
    """Replay the demonstration through RL's own bookkeeping (Transcript, next_reply): the SFT row must have the
    same ids and the same loss mask, the prompt masked too."""
    from recipe.envs.tools import ToolsEnv
    from recipe.rollout import Transcript, next_reply
    from recipe.inference import Completion
    from recipe.chat import encode_prompt
    from recipe.sft import tokenize_chat_row

    _, tok, rows = tiny
    row = next(r for r in rows if _calls_tool(r))
    demo = row["completion"][0]["content"]
    first_turn = demo[:demo.index(OBSERVATION) + len(OBSERVATION)]  # the model stops at <|observation|>
    final_turn = demo[demo.index(f"{ASSISTANT}\n") + len(ASSISTANT) + 1:] + tok.eos_token

    transcript = Transcript()
    ids = tok.encode(first_turn, add_special_tokens=False)
    transcript.add_model(Completion(ids, [0.0] * len(ids)))
    reply_ids = next_reply(ToolsEnv(), tok, transcript, row)
    transcript.add_env(reply_ids)
    ids = tok.encode(final_turn, add_special_tokens=False)
    transcript.add_model(Completion(ids, [0.0] * len(ids)))
    prompt_ids = encode_prompt(tok, row["prompt"])

    got = tokenize_chat_row(tok, row["prompt"], row["completion"])
    assert got["input_ids"] == prompt_ids + transcript.ids
    assert got["assistant_masks"] == [0] * len(prompt_ids) + transcript.loss_mask

    # the boundaries, spelled out: the model's <|observation|> is trained, the reply is not, the answer is
    mask, observation = got["assistant_masks"], got["input_ids"].index(tok.convert_tokens_to_ids(OBSERVATION))
    reply_end = observation + 1 + len(reply_ids)
    assert mask[observation] == 1 and set(mask[observation + 1:reply_end]) == {0} and set(mask[reply_end:]) == {1}
    assert tok.decode(got["input_ids"][observation + 1:reply_end]) == ToolsEnv().tool_reply(first_turn, row)
    assert tok.decode(got["input_ids"][reply_end:]) == final_turn


def test_every_reply_of_a_two_call_demonstration_is_out_of_the_loss(tiny):
    from recipe.envs.tools import ToolsEnv
    from recipe.chat import encode_prompt
    from recipe.sft import tokenize_chat_row

    _, tok, rows = tiny
    row = next(r for r in rows if _calls_tool(r))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' + OBSERVATION
    turns = [call % "12*3", call % "36+1", "<think>\n</think>\n37"]
    replies = [ToolsEnv().tool_reply(t, row) for t in turns[:2]]
    demo = turns[0] + replies[0] + turns[1] + replies[1] + turns[2]
    got = tokenize_chat_row(tok, row["prompt"], [{"role": "assistant", "content": demo}])
    masked = [i for i, m in zip(got["input_ids"], got["assistant_masks"]) if m == 0]
    n_prompt = len(encode_prompt(tok, row["prompt"]))
    assert tok.decode(masked[n_prompt:]) == "".join(replies)


def _prepared(dataset, model, tok, out_dir):
    """The train dataset as SFTTrainer prepares it: input_ids and labels (-100 = out of the loss)."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(out_dir), max_length=1024, use_cpu=True, report_to="none",
                     dataloader_num_workers=0)
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok).train_dataset


def test_rows_without_a_tool_reply_are_what_trl_makes_of_the_conversational_row(tiny, tmp_path):
    """TRL's processing of the old dataset (conversational prompt/completion rows) against its processing of
    chat_dataset: same ids everywhere, same labels except the tool replies, which only the new one masks."""
    from datasets import Dataset

    from recipe.model import build_tiny_model
    from recipe.sft import chat_dataset

    cfg, tok, rows = tiny
    model = build_tiny_model(cfg.model.tiny, tok)

    def msgs(ms):
        return [{"role": m["role"], "content": m["content"]} for m in ms]

    conversational = Dataset.from_list([{"prompt": msgs(r["prompt"]), "completion": msgs(r["completion"])}
                                        for r in rows])
    old = _prepared(conversational, model, tok, tmp_path / "old")
    new = _prepared(chat_dataset(rows, tok), model, tok, tmp_path / "new")
    assert len(old) == len(new) == len(rows)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for row, a, b in zip(rows, old, new):
        assert b["input_ids"] == a["input_ids"]
        # TRL adds no EOS to a conversational row: the template's <|endoftext|> ends it, and it is trained
        assert a["input_ids"][-1] == eos and a["labels"][-1] == b["labels"][-1] == eos
        assert a["input_ids"].count(eos) == 1
        if not _calls_tool(row):
            assert b["labels"] == a["labels"]
            continue
        changed = [i for i, (x, y) in enumerate(zip(a["labels"], b["labels"])) if x != y]
        assert changed and all(b["labels"][i] == -100 for i in changed)
        masked_text = tok.decode([a["input_ids"][i] for i in changed])
        assert changed == list(range(changed[0], changed[-1] + 1))  # one span
        assert masked_text.startswith("\n<tool_response>") and masked_text.endswith(f"</tool_response>{ASSISTANT}\n")


def test_a_short_sft_run_trains_on_the_masked_dataset(tiny, tmp_path):
    from recipe.config import load_config
    from recipe.model import build_tiny_model
    from recipe.sft import chat_dataset, train_supervised

    cfg, tok, rows = tiny
    sft = load_config(["sft.max_steps=2", "sft.batch_size=4", "sft.logging_steps=1", "sft.save_steps=100",
                       "sft.threads=1"]).sft
    assert sft.shared_prefixes  # the tiny preset's batches: the rows' shared prompt prefixes computed once
    model = build_tiny_model(cfg.model.tiny, tok)
    out = train_supervised(model, tok, chat_dataset(rows, tok), sft, tmp_path / "sft", use_cpu=True)
    assert (out / "model.safetensors").exists()
    assert model.config._attn_implementation == "sdpa_gqa"  # sdpa_tree is for the training batches only
    spared = [json.loads(x)["prefix_spared"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
              if "prefix_spared" in json.loads(x)]
    assert len(spared) == 2 and all(0 <= x < 1 for x in spared) and max(spared) > 0
    losses = [json.loads(x)["loss"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
    padding = [json.loads(x)["padding"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
               if "padding" in json.loads(x)]
    assert len(padding) == 2 and all(0 <= x < 1 for x in padding)  # each step's share, logged with the loss


def test_shared_prefix_plan_computes_the_fewest_tokens():
    """Rows in sorted order, grouped in runs that share a prefix: the grouping that leaves the fewest tokens, every
    row in one group, no prefix longer than what each of its rows may share."""
    from recipe.sft import shared_prefix_plan

    rows = [[6, 6, 6], [1, 2, 3, 4, 9], [1, 2, 3, 5, 7], [1, 2, 3, 4, 8]]
    # three rows share 3 tokens (6 spared) where two share 4 (4 spared)
    assert shared_prefix_plan(rows, [9] * 4) == [(3, [3, 1, 2]), (0, [0])]
    # a row may share only its tokens before the one before its first label: here the second row, 2 of them
    assert shared_prefix_plan(rows, [9, 2, 9, 9]) == [(2, [3, 1, 2]), (0, [0])]
    assert shared_prefix_plan(rows, [0] * 4) == [(0, [3]), (0, [1]), (0, [2]), (0, [0])]
    assert shared_prefix_plan([[5, 5], [5, 5]], [1, 1]) == [(1, [0, 1])]  # the same rows: all they may share
    many = [[1, 2, 3, i % 3, i] for i in range(20)] + [[9, i] for i in range(5)]
    groups = shared_prefix_plan(many, [4] * 25)
    assert sorted(i for _, members in groups for i in members) == list(range(25))  # every row once
    # three groups of 4 shared tokens (i % 3 after 1, 2, 3) spare more than one group of 3, and [9, i] share 1
    assert sum((len(m) - 1) * p for p, m in groups) == (6 + 6 + 5) * 4 + 4 * 1


def test_shared_prefix_batches_train_what_packed_ones_train(tiny, tmp_path):
    """SharedPrefixCollator: the batch as one flat sequence with each prompt prefix its rows share computed once.
    The same label tokens are trained, fewer tokens are computed, each row sees its prefix and itself only under
    sdpa_tree, and the trainer's loss, every gradient and the logged metrics are the packed batch's, to float
    rounding. Without the layout the flat sequence would be one long row, and the loss another."""
    import copy

    import torch
    from trl import SFTConfig

    from recipe.model import build_tiny_model
    from recipe.model.attention import SDPA_ROWS, SDPA_TREE
    from recipe.sft import PackedBatchCollator, ResumingSFTTrainer, SharedPrefixCollator, chat_dataset

    cfg, tok, rows = tiny
    data = chat_dataset(rows, tok)
    examples = [{"input_ids": r["input_ids"],
                 "labels": [t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"])]}
                for r in data][:32]
    packed = PackedBatchCollator(tok.pad_token_id, 4)(examples)
    shared = SharedPrefixCollator()(examples)
    assert shared["input_ids"].shape == (1, shared["real_tokens"]) and "attention_mask" not in shared
    assert shared["row_tokens"] == packed["real_tokens"] == sum(len(e["input_ids"]) for e in examples)
    assert shared["real_tokens"] < 0.85 * shared["row_tokens"]  # a task's rows share its instructions

    def trained(batch):
        keep = batch["labels"] != -100
        return sorted(batch["labels"][keep].tolist())
    assert trained(shared) == trained(packed)
    # every row's tokens, at their own positions, are in the flat sequence: a shared prefix once, then the row's own
    flat, positions = shared["input_ids"][0].tolist(), shared["position_ids"][0].tolist()
    at = {(p, t) for p, t in zip(positions, flat)}
    assert all((p, t) in at for e in examples for p, t in enumerate(e["input_ids"]))

    model = build_tiny_model(cfg.model.tiny, tok)
    args = SFTConfig(output_dir=str(tmp_path), max_length=1024, use_cpu=True, report_to="none", bf16=False,
                     dataloader_num_workers=0)
    runs = {}
    for name, batch, attention in (("packed", packed, SDPA_ROWS), ("shared", shared, SDPA_TREE)):
        trainer = ResumingSFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                                     processing_class=tok, fused_lm_head=False)
        trainer.model.set_attn_implementation(attention)
        trainer.model.train()
        batch = {k: v for k, v in batch.items() if k not in ("real_tokens", "row_tokens")}
        n = int((batch["labels"][:, 1:] != -100).sum())
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=n)
        loss.backward()
        metrics = trainer._metrics["train"]
        runs[name] = (loss.detach(), {k: p.grad for k, p in trainer.model.named_parameters()},
                      metrics["entropy"][-1], metrics["mean_token_accuracy"][-1])
        if name == "shared":  # the flat sequence without its layout: every row would see the rows before it
            with torch.no_grad():
                flat = trainer.compute_loss(trainer.model, {k: v for k, v in batch.items() if k != "tree_rows"},
                                            num_items_in_batch=n)
            assert abs(float(flat) - float(loss.detach())) > 1e-3
    (loss_a, grads_a, *logged_a), (loss_b, grads_b, *logged_b) = runs["packed"], runs["shared"]
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=1e-5, rtol=1e-4, msg=k)
    assert logged_b == pytest.approx(logged_a, abs=1e-5)


# ---------------------------------------------------------------- tools and tool calls through the template

# recipe.chat.CHAT_TEMPLATE as it was before tools were rendered: a row without tool calls or tools must render
# byte for byte as it did (the tiny pipeline's learning depends on its ids)
TEMPLATE_BEFORE_TOOLS = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' -%}<|endoftext|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif -%}"
)


def _hub_rows():
    from pathlib import Path

    from recipe.data.hub import sft_row

    path = Path(__file__).resolve().parent.parent / "data" / "fixtures" / "intellect3_sft.jsonl"
    raws = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [sft_row(raw, "fixture", i) for i, raw in enumerate(raws)]


def _spans(tok, got) -> list[tuple[int, str]]:
    """(mask, decoded text) of each run of equal mask values."""
    spans, ids, value = [], [], got["assistant_masks"][0]
    for i, m in zip(got["input_ids"], got["assistant_masks"]):
        if m != value:
            spans.append((value, tok.decode(ids)))
            ids, value = [], m
        ids.append(i)
    return spans + [(value, tok.decode(ids))]


def test_a_hub_tool_row_renders_its_tools_and_qwen3_coder_calls_and_masks_the_tool_result(tiny):
    from recipe.chat import TOOLS_HEADER, messages, parse_tool_call, template_tools, tool_response
    from recipe.sft import chat_dataset

    _, tok, _ = tiny
    rows = _hub_rows()
    row = next(r for r in rows if json.loads(r["tools"]))
    assert json.loads(row["completion"][0]["tool_calls"])[0]["function"]["name"] == "get_current_time"
    tools = template_tools(row)
    text = tok.apply_chat_template(messages(row["prompt"]) + messages(row["completion"]), tools=tools,
                                   tokenize=False)
    call = ("<tool_call>\n<function=get_current_time>\n<parameter=timezone>\nEurope/Lisbon\n</parameter>\n"
            "</function>\n</tool_call>")
    definition = json.dumps(json.loads(row["tools"])[0], ensure_ascii=False)
    assert text.startswith(f"[gMASK]<sop><|system|>\n{TOOLS_HEADER}\n{definition}\n</tools><|system|>\n")
    assert f"</think>\n\n{call}{OBSERVATION}\n<tool_response>" in text
    result = row["completion"][1]["content"]
    assert f"{OBSERVATION}{tool_response(result)}<think>The tool says 14:05." in text

    got = chat_dataset([row], tok)[0]
    assert tok.decode(got["input_ids"]) == text
    spans = _spans(tok, got)
    # prompt (tools block, system, user) out; the call and its stop token in; the tool's result out; answer in
    assert [m for m, _ in spans] == [0, 1, 0, 1]
    assert spans[0][1].startswith("[gMASK]<sop><|system|>\n# Tools") and spans[0][1].endswith(f"{ASSISTANT}\n")
    assert spans[1][1].endswith(call + OBSERVATION) and parse_tool_call(spans[1][1]) == \
        ("get_current_time", {"timezone": "Europe/Lisbon"})
    assert spans[2][1] == tool_response(result)
    assert spans[3][1] == "<think>The tool says 14:05.\n</think>\n\nIt is 14:05 in Lisbon right now.<|endoftext|>"


def test_rows_without_tools_render_byte_for_byte_as_before(tiny):
    """The hub fixture's plain rows and every tiny row (the tools task's included: its tools stay in its
    instruction, as in RL) give the same text and the same ids and mask as the template before tools."""
    from recipe.chat import messages, template_tools
    from recipe.sft import chat_dataset, chat_row_pieces, tokenize_chat_row

    _, tok, rows = tiny
    hub_plain = [r for r in _hub_rows() if not json.loads(r["tools"])]
    assert len(hub_plain) == 3 and any(r["env"] == "tools" and json.loads(r["tools"]) for r in rows)
    for row in hub_plain + rows:
        assert template_tools(row) is None
        conversation = messages(row["prompt"]) + messages(row["completion"])
        for add_generation_prompt, msgs in ((False, conversation), (True, messages(row["prompt"]))):
            new = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
            old = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          chat_template=TEMPLATE_BEFORE_TOOLS)
            assert new == old
    dataset = chat_dataset(hub_plain + rows, tok, chunk_rows=5)  # several batches of texts
    for row, got in zip(hub_plain + rows, dataset):
        assert got == tokenize_chat_row(tok, row["prompt"], row["completion"])
        # the batched encoding gives the ids of one tokenizer.encode a piece
        pieces, _ = chat_row_pieces(tok, messages(row["prompt"]), messages(row["completion"]))
        assert got["input_ids"] == [i for text, _ in pieces for i in tok.encode(text, add_special_tokens=False)]


class _RecordingTokenizer:
    """Stands in for a hub tokenizer: records what apply_chat_template is given; renders nothing of its own."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append((conversation, kwargs))
        return "".join(m["content"] for m in conversation)

    def __call__(self, texts, add_special_tokens=False):  # chat_dataset encodes its texts in batches
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_a_hub_tokenizer_is_handed_the_tools_and_the_tool_calls():
    """For the real model the hub tokenizer's own template renders: it gets tools= and messages whose tool calls
    have their arguments as an object (what GLM-4.5's and qwen3_coder's templates iterate)."""
    from recipe.sft import chat_dataset

    rows = _hub_rows()
    tok = _RecordingTokenizer()
    chat_dataset(rows, tok)
    with_tools = [(c, kw) for c, kw in tok.calls if "tools" in kw]
    assert len(with_tools) == 2  # the tool row's prompt and its whole conversation; no other row passes tools
    conversation, kwargs = with_tools[-1]
    assert kwargs["tools"][0]["function"]["name"] == "get_current_time"
    assert conversation[2]["tool_calls"] == [{"id": "call_lisbon_0", "type": "function", "function": {
        "name": "get_current_time", "arguments": {"timezone": "Europe/Lisbon"}}}]
    assert conversation[3] == {"role": "tool", "content": '{"timezone": "Europe/Lisbon", "time": "14:05"}'}
    called = [m for c, _ in tok.calls for m in c if "tool_calls" in m]
    assert called and all(m["role"] == "assistant" and m["tool_calls"] == conversation[2]["tool_calls"]
                          for m in called)


def test_a_tool_call_that_does_not_parse_names_its_row():
    from recipe.errors import DataError
    from recipe.sft import chat_dataset

    row = next(r for r in _hub_rows() if json.loads(r["tools"]))
    bad = {**row, "completion": [{**row["completion"][0], "tool_calls": '[{"function": {"name": "f", '
                                                                         '"arguments": "{not json"}}]'}]}
    with pytest.raises(DataError, match=row["id"]):
        chat_dataset([bad], _RecordingTokenizer())


# ---------------------------------------------------------------- length-grouped batches

def _padding(lengths, order, batch_size):
    batches = [[lengths[i] for i in order[b:b + batch_size]] for b in range(0, len(order), batch_size)]
    return 1 - sum(map(sum, batches)) / sum(max(b) * len(b) for b in batches)


def test_length_grouped_batches_cut_padding_and_train_every_row_equally_often():
    import random

    from recipe.sft import length_grouped_order

    rng = random.Random(0)
    lengths = [rng.choice([20, 40, 60, 110]) + rng.randrange(8) for _ in range(3000)]
    order = length_grouped_order(lengths, batch_size=32, steps=300, seed=0)
    assert len(order) == 300 * 32
    counts = [order.count(i) for i in range(len(lengths))]
    # 9600 rows from 3000: three passes and a part of a fourth (a pass's few left-over rows go into the next)
    assert min(counts) >= 2 and max(counts) <= 4 and sum(c >= 3 for c in counts) > 0.99 * len(counts)
    shuffled = rng.sample(range(len(lengths)), len(lengths)) * 4
    assert _padding(lengths, order, 32) < 0.05 < 0.3 < _padding(lengths, shuffled[:len(order)], 32)
    # the same order for the same arguments (a resumed run, every rank); another seed, another order
    assert length_grouped_order(lengths, 32, 300, 0) == order != length_grouped_order(lengths, 32, 300, 1)
    assert length_grouped_order(lengths, 32, 120, 0) == order[:120 * 32]  # fewer steps: the same start
    # a batch's length says nothing about when it comes: long batches are spread over the pass
    firsts = [max(lengths[i] for i in order[b:b + 32]) for b in range(0, 93 * 32, 32)]
    assert 0.1 < sum(x > 100 for x in firsts) / len(firsts) < 0.4  # a quarter of the rows are long


def test_too_few_rows_for_a_batch_is_an_error():
    from recipe.errors import DataError
    from recipe.sft import length_grouped_order

    with pytest.raises(DataError, match="3 rows cannot fill one batch of 4"):
        length_grouped_order([5, 6, 7], 4, 10, 0)


def test_group_by_length_and_packing_exclude_each_other():
    from recipe.config import load_config
    from recipe.errors import ConfigError

    with pytest.raises(ConfigError, match="sft.group_by_length and sft.packing exclude each other"):
        load_config(["sft.packing=true", "sft.group_by_length=true"])


def test_packed_rows_keep_apart_under_sdpa(tiny):
    """Rows packed into one sequence with their own position ids (TRL's padding-free packing) see only themselves
    under sdpa on CPU: transformers builds a block-diagonal mask from the position ids (masking_utils) when no KV
    cache is made, as in training (use_cache off), so packing is an option for the tiny SFT too. Without the
    position ids the second row would attend to the first."""
    import torch

    from recipe.model import build_tiny_model

    cfg, tok, _ = tiny
    model = build_tiny_model(cfg.model.tiny, tok).eval()
    a, b = torch.randint(5, len(tok), (1, 30)), torch.randint(5, len(tok), (1, 50))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=a, use_cache=False).logits, model(input_ids=b, use_cache=False).logits],
                          dim=1)
        ids = torch.cat([a, b], dim=1)
        positions = torch.cat([torch.arange(30), torch.arange(50)])[None]
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        unpacked = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)
    assert (unpacked[:, 30:] - alone[:, 30:]).abs().max() > 1e-2


def test_packed_batches_train_the_same_tokens_as_padded_ones(tiny):
    """PackedBatchCollator: a batch of chat rows as a quarter as many sequences. The same label tokens are trained,
    each row sees only itself (the loss of the packed batch is the padded batch's), and the padding share falls
    from about a third to a few percent."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from recipe.model import build_tiny_model
    from recipe.sft import PackedBatchCollator, chat_dataset

    cfg, tok, rows = tiny
    data = chat_dataset(rows, tok)
    examples = []
    for r in data:  # labels as TRL builds them from the assistant mask
        examples.append({"input_ids": r["input_ids"],
                         "labels": [t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"])]})
    examples = examples[:32]
    packed = PackedBatchCollator(tok.pad_token_id, 4)(examples)
    padded = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)(examples)
    assert packed["input_ids"].shape[0] == 8 and "attention_mask" not in packed
    assert packed["real_tokens"] == int(padded["attention_mask"].sum())
    # the same multiset of (token, label) pairs is trained
    def trained(batch):
        keep = batch["labels"] != -100
        return sorted(batch["labels"][keep].tolist())
    assert trained(packed) == trained(padded)
    packed_padding = 1 - packed["real_tokens"] / packed["input_ids"].numel()
    padded_padding = 1 - int(padded["attention_mask"].sum()) / padded["attention_mask"].numel()
    assert packed_padding < 0.05 < 0.2 < padded_padding
    model = build_tiny_model(cfg.model.tiny, tok).eval()
    with torch.no_grad():
        a = model(**{k: packed[k] for k in ("input_ids", "labels", "position_ids")}, use_cache=False).loss
        b = model(**padded, use_cache=False).loss
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # without its position ids a packed sequence is one long row: its rows would see each other
    with torch.no_grad():
        c = model(input_ids=packed["input_ids"], labels=packed["labels"], use_cache=False).loss
    assert abs(float(c) - float(b)) > 1e-3


@pytest.mark.parametrize("packed", [False, True])
def test_the_plain_head_trains_with_trls_loss_gradient_and_metrics(tiny, tmp_path, monkeypatch, packed):
    """sft.fused_lm_head=false (ResumingSFTTrainer.compute_loss): the loss, every gradient and the logged entropy,
    token accuracy and token count of TRL's fused head, to float rounding, from the plain logits; TRL's tiled
    kernel is not called (it is what made the step slower)."""
    import copy

    import torch
    import trl.trainer.utils as trl_utils
    from trl import SFTConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from recipe.model import build_tiny_model
    from recipe.sft import PackedBatchCollator, ResumingSFTTrainer, chat_dataset

    cfg, tok, rows = tiny
    data = chat_dataset(rows, tok)
    model = build_tiny_model(cfg.model.tiny, tok)
    args = SFTConfig(output_dir=str(tmp_path), max_length=1024, use_cpu=True, report_to="none", bf16=False,
                     dataloader_num_workers=0)
    runs = {}
    for fused in (True, False):
        trainer = ResumingSFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                                     processing_class=tok, fused_lm_head=fused)
        examples = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset][:16]
        batch = PackedBatchCollator(tok.pad_token_id, 4)(examples) if packed else \
            DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)(examples)
        batch.pop("real_tokens", None)
        tiles = []
        real_apply = trl_utils._ChunkedLogProbFunction.apply
        monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                            lambda *a, _f=real_apply: tiles.append(1) or _f(*a))
        trainer.model.train()
        n = int((batch["labels"][:, 1:] != -100).sum())
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=n)
        loss.backward()
        monkeypatch.undo()
        assert bool(tiles) == fused
        metrics = trainer._metrics["train"]
        runs[fused] = (loss.detach(), {k: p.grad for k, p in trainer.model.named_parameters()},
                       metrics["entropy"][-1], metrics["mean_token_accuracy"][-1], metrics["num_tokens"][-1])
    (loss_f, grads_f, *logged_f), (loss_p, grads_p, *logged_p) = runs[True], runs[False]
    torch.testing.assert_close(loss_p, loss_f, atol=1e-5, rtol=1e-5)
    for k in grads_f:
        torch.testing.assert_close(grads_p[k], grads_f[k], atol=1e-5, rtol=1e-4, msg=k)
    assert logged_p == pytest.approx(logged_f, abs=1e-5)
    assert 0 <= logged_p[1] <= 1 and logged_p[0] > 0 and logged_p[2] > 0  # accuracy, entropy, tokens


def test_rows_per_sequence_is_checked():
    from recipe.config import TrainConfig, load_config
    from recipe.errors import ConfigError
    from recipe.sft import per_device_batch

    with pytest.raises(ConfigError, match="sft.rows_per_sequence must be an integer"):
        load_config(["sft.rows_per_sequence=0"])
    with pytest.raises(ConfigError, match="sft.rows_per_sequence=4 packs each batch itself: it excludes sft.packing"):
        load_config(["sft.rows_per_sequence=4", "sft.packing=true", "sft.shared_prefixes=false"])
    for bad in (["sft.packing=true"], ["sft.fused_lm_head=true"]):
        with pytest.raises(ConfigError, match=r"sft.shared_prefixes lays each batch out itself .* excludes sft.packing "
                                              r"and needs sft.fused_lm_head=false"):
            load_config(["sft.shared_prefixes=true", *bad])
    with pytest.raises(ConfigError, match=r"sft.rows_per_sequence=3 must divide each rank's 16 rows"):
        per_device_batch(TrainConfig(batch_size=32, rows_per_sequence=3), "sft", 2)
    assert per_device_batch(TrainConfig(batch_size=32, rows_per_sequence=4), "sft", 2) == 16
    # a flat batch of shared prefixes has no sequences for rows_per_sequence to fill
    assert per_device_batch(TrainConfig(batch_size=30, rows_per_sequence=4, shared_prefixes=True), "sft", 2) == 15
