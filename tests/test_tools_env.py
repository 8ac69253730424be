"""The multi-turn tools environment: tool calls, a safe calculator, Python in the sandbox, and multi-turn
rollouts in eval and RL whose environment tokens stay out of the loss."""
import json

import pytest

from recipe.config import EvalConfig, RLConfig
from recipe.inference.engine import Cancelled
from recipe.envs import get_env
from recipe.chat import parse_tool_call
from recipe.envs.tools import calculate, run_tool_call
from recipe.eval.runner import evaluate
from recipe.inference import Completion
from recipe.rl.orchestrator import Orchestrator
from tests.fakes import CharTokenizer, ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call><|observation|>'
REPLY = "\n<tool_response>1776</tool_response><|assistant|>\n"
FINAL = "<think></think>1776"


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call><|observation|>"


def tool_rows(n=8):
    return [{"id": f"t{i}", "env": "tools", "task": "tool_mul", "prompt": [{"role": "user", "content": f"Q{i}"}],
             "answer": "1776", "info": "{}", "difficulty": 4.0} for i in range(n)]


# -- tool calls ---------------------------------------------------------------------------------------------

def test_tool_calls_parse_as_json_or_qwen3_coder_and_bad_calls_get_an_error_reply():
    assert parse_tool_call(CALL) == ("calculator", {"expression": "37*48"})
    xml = "<tool_call>\n<function=calculator>\n<parameter=expression>\n37*48\n</parameter>\n</function>\n</tool_call>"
    assert parse_tool_call(xml) == ("calculator", {"expression": "37*48"})
    assert run_tool_call(CALL) == "1776"
    assert run_tool_call(xml) == "1776"
    assert run_tool_call("<tool_call>{not json</tool_call>").startswith("error: invalid JSON")
    assert run_tool_call(call("shell", cmd="ls")).startswith("error: unknown tool 'shell'")
    assert run_tool_call(call("calculator", expr="1")).startswith("error: calculator needs")
    env = get_env("tools")
    assert env.tool_reply(CALL, {}) == REPLY
    assert env.tool_reply("<tool_call>{oops</tool_call><|observation|>", {}).startswith("\n<tool_response>error:")
    assert env.tool_reply(FINAL, {}) is None  # no stop at <|observation|>: the turn is final
    assert env.tool_reply(CALL.replace("<|observation|>", ""), {}) is None


@pytest.mark.parametrize("expr", ["__import__('os')", "(1).real", "abs(-1)", "x", "[1]", "'a'*3", "9**9**9",
                                  "10**1000", "2**-99999", "1/0", "(" * 300, "True+1"])
def test_calculator_refuses_everything_but_bounded_arithmetic(expr):
    assert calculate(expr).startswith("error")


def test_calculator_arithmetic():
    assert [calculate(e) for e in ["37*48", "(2+3)*4", "7/2", "7//2", "-7%3", "2**10", "1.5*2"]] == \
        ["1776", "20", "3.5", "3", "2", "1024", "3"]


def test_python_tool_runs_in_the_sandbox():
    assert run_tool_call(call("python", code="print(37*48)")) == "1776"
    assert "ZeroDivisionError" in run_tool_call(call("python", code="1/0"))
    assert run_tool_call(call("python", code="while True: pass")).startswith("error (timeout")
    long = run_tool_call(call("python", code="print('x' * 5000)"))
    assert long.endswith("...[cut]") and len(long) < 500


def test_score_reads_the_last_turn_only():
    env = get_env("tools")
    assert env.score("<think></think>5" + CALL + REPLY + FINAL, {"answer": "1776"}).reward == 1
    assert env.score("<think></think>1776" + REPLY + "no answer", {"answer": "1776"}).reward == 0
    assert env.score("<think></think>\\boxed{1,776}", {"answer": "1776"}).reward == 1


# -- eval ---------------------------------------------------------------------------------------------------

class ToolEvalEngine:
    """A first turn calls the calculator (or always calls it), a turn after a tool response answers."""

    def __init__(self, always_call=False):
        self.always_call, self.prompts = always_call, []

    def generate(self, prompts, params):
        self.prompts.append(["".join(chr(c) for c in p) for p in prompts])
        out = []
        for p in self.prompts[-1]:
            if "<tool_response>" in p and not self.always_call:
                text = FINAL
            elif "Q" in p and p.split("Q")[1][0] == "1" and not self.always_call:
                text = "<think></think>12"  # problem 1 answers at once, wrongly
            else:
                text = CALL
            out.append(Completion([ord(c) for c in text], [-0.5] * len(text), "stop", 0))
        return out


def test_eval_runs_tool_turns_and_records_the_whole_transcript(tmp_path):
    eng = ToolEvalEngine()
    res = evaluate(eng, CharTokenizer(), tool_rows(2), EvalConfig(samples=2, pass_k=[1], batch_size=4), tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    by_id = {ln["id"]: ln for ln in lines}
    assert by_id["t0"]["completion"] == CALL + REPLY + FINAL and by_id["t0"]["score"] == 1
    assert by_id["t0"]["tokens"] == len(CALL + REPLY + FINAL)
    assert by_id["t1"]["completion"] == "<think></think>12" and by_id["t1"]["score"] == 0
    assert len(eng.prompts) == 2 and len(eng.prompts[1]) == 2  # only the samples that called a tool go on
    assert eng.prompts[1][0].endswith(CALL + REPLY)
    assert res["env"]["tools"]["avg@2"] == 0.5


def test_eval_stops_at_max_turns(tmp_path):
    eng = ToolEvalEngine(always_call=True)
    evaluate(eng, CharTokenizer(), tool_rows(1), EvalConfig(samples=1, pass_k=[1], batch_size=4), tmp_path)
    line = json.loads((tmp_path / "samples.jsonl").read_text())
    max_turns = get_env("tools").max_turns
    assert len(eng.prompts) == max_turns and line["completion"].count("<tool_response>") == max_turns - 1
    assert line["score"] == 0


def test_single_turn_rows_in_the_same_chunk_keep_their_completion(tmp_path):
    rows = tool_rows(1) + [{"id": "m0", "env": "math", "task": "add", "prompt": [{"role": "user", "content": "Q5"}],
                            "answer": "1776", "info": "{}"}]
    evaluate(ToolEvalEngine(), CharTokenizer(), rows, EvalConfig(samples=1, pass_k=[1], batch_size=4), tmp_path)
    by_id = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()}
    assert by_id["m0"]["completion"] == CALL  # math rows are single-turn: no tool reply appended
    assert by_id["t0"]["completion"] == CALL + REPLY + FINAL


PROMPT_LEN = len("<user>Q0<assistant>")  # a tool row's prompt, in CharTokenizer tokens


@pytest.mark.parametrize("turns", [1, 2])
def test_eval_ends_a_transcript_whose_next_turn_would_not_fit_the_context(tmp_path, turns):
    # room for `turns` calls and the replies before them, the reply after the last one is one token too many
    room = turns * len(CALL) + turns * len(REPLY) - 1
    eng = ToolEvalEngine(always_call=True)
    cfg = EvalConfig(samples=1, pass_k=[1], batch_size=4, max_new_tokens=len(CALL))
    evaluate(eng, CharTokenizer(), tool_rows(1), cfg, tmp_path, context=PROMPT_LEN + len(CALL) + room)
    line = json.loads((tmp_path / "samples.jsonl").read_text())
    assert len(eng.prompts) == turns  # max_turns (3) would have allowed one more
    assert line["completion"] == (CALL + REPLY) * (turns - 1) + CALL  # as it stands: scored, not masked
    assert line["reason"] == "no </think>: truncated" and line["score"] == 0 and not line["masked"]
    assert all(len(p) + len(CALL) <= PROMPT_LEN + len(CALL) + room for call_ in eng.prompts for p in call_)


# -- RL -----------------------------------------------------------------------------------------------------

def rl_cfg(**kw):
    return RLConfig(**{"batch_size": 2, "rollouts_per_example": 4, "env_mix": {"tools": 1.0}, **kw})


def tool_answers(prompt, rid):
    """Even first-turn requests answer at once (wrong), odd ones call the calculator and then answer."""
    if "<tool_response>" in prompt:
        return FINAL
    return "<think></think>12" if rid % 2 == 0 else CALL


def check_tool_sample(s):
    n_call, n_reply = len(CALL), len(REPLY)
    assert "".join(chr(c) for c in s.completion_ids) == CALL + REPLY + FINAL
    assert s.loss_mask == [1] * n_call + [0] * n_reply + [1] * len(FINAL)
    assert s.logprobs == [-1.0] * n_call + [0.0] * n_reply + [-1.0] * len(FINAL)
    assert s.reward == 1


def test_orchestrator_multi_turn_samples_mask_environment_tokens():
    eng = ScriptedEngine(tool_answers)
    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert len(samples) == 8 and stats["tool_calls"] >= 4
    tool, direct = [s for s in samples if s.reward == 1], [s for s in samples if s.reward == 0]
    assert len(tool) == 4 and len(direct) == 4
    for s in tool:
        check_tool_sample(s)
        assert s.advantage == 0.5
    for s in direct:
        assert s.loss_mask == [1] * len(s.completion_ids) and s.advantage == -0.5


class NewPolicyEachPoll(ScriptedEngine):
    """Each round of generation is written by a newer policy: first turns by version 0, continuations by 1."""

    def poll(self, timeout=None):
        event = super().poll(timeout)
        if event is not None:
            self.policy_version += 1
        return event


def test_orchestrator_policy_version_is_the_oldest_turn():
    eng = NewPolicyEachPoll(tool_answers)
    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=0), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert eng.policy_version == 2  # two rounds: the first turns (version 0), then the continuations (version 1)
    tool = [s for s in samples if s.reward == 1]
    assert len(tool) == 4
    for s in tool:
        check_tool_sample(s)
        assert s.policy_version == 0  # its second turn was written by version 1
    assert stats["staleness"] == {0: 8}


class CancelEachContinuationOnce(ScriptedEngine):
    """Hands every tool continuation back as Cancelled the first time it is submitted."""

    def __init__(self, answer_fn):
        super().__init__(answer_fn)
        self.cancelled, self.resubmitted = [], []

    def submit(self, requests):
        for r in requests:
            if "<tool_response>" not in "".join(map(chr, r.prompt_ids)):
                super().submit([r])
            elif r.params.seed in {c.params.seed for c in self.cancelled}:
                self.resubmitted.append(r)
                super().submit([r])
            else:
                self.cancelled.append(r)
                self.events.append(Cancelled([r.id]))


def test_a_cancelled_later_turn_resubmits_its_continuation():
    eng = CancelEachContinuationOnce(tool_answers)
    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=0), eng, seed=0)
    samples, stats = orch.next_batch(0)
    assert len(eng.cancelled) == 4 and stats["cancelled_requests"] == 4
    # each continuation went back with its transcript so far (first turn and tool reply), not the bare prompt
    assert sorted((r.params.seed, r.prompt_ids) for r in eng.resubmitted) == \
        sorted((r.params.seed, r.prompt_ids) for r in eng.cancelled)
    assert all("".join(map(chr, r.prompt_ids)).endswith(CALL + REPLY) for r in eng.resubmitted)
    for s in samples:
        text = "".join(map(chr, s.completion_ids))
        assert text in (CALL + REPLY + FINAL, "<think></think>12")
        if s.reward == 1:
            check_tool_sample(s)


LOOP = call("calculator", expression="1+1")


def test_orchestrator_enforces_max_turns():
    def answers(prompt, rid):
        if LOOP in prompt:  # sample 0 calls the calculator at every turn, never answering
            return LOOP
        if "<tool_response>" in prompt:
            return FINAL
        return {0: LOOP, 1: CALL, 2: "<think></think>12", 3: "<think></think>12"}[rid % 4]

    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=0), ScriptedEngine(answers), seed=0)
    samples, stats = orch.next_batch(0)
    max_turns = get_env("tools").max_turns
    looping = [s for s in samples if "".join(map(chr, s.completion_ids)).startswith(LOOP)]
    assert len(looping) == 2
    for s in looping:  # ended after max_turns model turns: the last call gets no reply
        text = "".join(map(chr, s.completion_ids))
        assert text.count(LOOP) == max_turns and text.count("<tool_response>") == max_turns - 1
        assert text.endswith(LOOP) and s.reward == 0
        assert s.loss_mask.count(0) == (max_turns - 1) * len(get_env("tools").tool_reply(LOOP, {}))
    assert stats["tool_calls"] == 2 * (max_turns - 1) + 2  # the loops' calls, and one call by each sample 1


def test_environment_tokens_do_not_change_the_trainer_loss():
    import torch

    from recipe.rl.orchestrator import Sample
    from recipe.rl.trainer import build_optimizer, build_scheduler, train_step
    from tests.test_trainer import tiny_model

    g = torch.Generator().manual_seed(0)
    comp = torch.randint(2, 64, (9,), generator=g).tolist()
    mask = [1, 1, 1, 0, 0, 0, 1, 1, 1]  # tokens 3-5 came from the environment

    def loss_with(env_logprob, env_mask):
        lp = [-4.0 if m else env_logprob for m in mask]
        lm = [1 if m else env_mask for m in mask]
        samples = [Sample([2, 3, 4], comp, lp, lm, a, 0.0, 0, "tools") for a in (1.0, -1.0)]
        cfg = RLConfig(lr=0.0, micro_batch_size=2)
        model = tiny_model()
        opt = build_optimizer(model, cfg)
        return train_step(model, opt, build_scheduler(opt, 0), torch.device("cpu"), samples, cfg, pad_id=1)

    a, b = loss_with(0.0, 0), loss_with(-30.0, 0)
    assert a["loss"] == b["loss"] and a["loss_tokens"] == b["loss_tokens"] == 12
    assert loss_with(-30.0, 1)["loss_tokens"] == 18  # the same tokens with loss_mask 1 would count


# -- tiny data ----------------------------------------------------------------------------------------------

def test_tool_mul_sft_rows_render_and_call_the_calculator():
    from omegaconf import OmegaConf

    from recipe.config import DataConfig, TaskSpec
    from recipe.data.tiny import build_tiny

    cfg = OmegaConf.structured(DataConfig(sft_rows_per_task=60, rl_rows_per_task=20, eval_rows_per_task=10,
                                          pretrain_rows_per_task=10, tool_hasty_fraction=0.35,
                                          extra_tasks=[TaskSpec(env="tools", task="tool_mul")]))
    out = build_tiny(cfg)
    sft = out["sft"]
    assert len(sft) == 60 and {r["env"] for r in sft} == {"tools"}
    assert {t["name"] for t in json.loads(sft[0]["tools"])} == {"calculator", "python"}
    env = get_env("tools")
    called = [r for r in sft if "<tool_call>" in r["completion"][0]["content"]]
    assert 0.4 < len(called) / len(sft) < 0.9  # the rest are hasty direct answers
    for r in called:
        text = r["completion"][0]["content"]
        turn = text.split("<|observation|>")[0] + "<|observation|>"
        reply = env.tool_reply(turn, r)
        assert text == turn + reply + text.split("<|assistant|>\n", 1)[1]  # the demonstrated reply is the real one
        assert env.score(text, r).reward == 1
    hasty = [r for r in sft if r not in called]
    assert any(env.score(r["completion"][0]["content"], r).reward == 0 for r in hasty)
    # renders through a chat template with the GLM-4.5 tokens kept as written
    from jinja2 import Template

    from recipe.chat import CHAT_TEMPLATE
    rendered = Template(CHAT_TEMPLATE).render(messages=called[0]["prompt"] + called[0]["completion"],
                                              add_generation_prompt=False)
    assert "<tool_call>" in rendered and rendered.endswith("<|endoftext|>")
    assert {r["env"] for r in out["rl"]} == {"tools"} and out["rl"][0]["completion"] == []


def test_tiny_preset_trains_every_environment_and_extra_tasks_compose():
    from recipe.config import load_config

    cfg = load_config([])
    assert [(t.env, t.task) for t in cfg.data.tasks] == [
        ("math", "add"), ("math", "chain_sum"), ("logic", "letter_counting"), ("logic", "leg_counting"),
        ("code", "fn_fit"), ("tools", "tool_mul")]
    assert set(cfg.rl.env_mix) == {"math", "logic", "code", "tools"}
    assert sum(cfg.rl.env_mix.values()) == pytest.approx(1.0)
    cfg = load_config(["data.extra_tasks=[{env: math, task: add, params: {min_digits: 3, max_digits: 3}}]",
                       "rl.env_mix.tools=0.3"])
    assert cfg.data.extra_tasks[0].params == {"min_digits": 3, "max_digits": 3} and cfg.rl.env_mix["tools"] == 0.3


# -- a tool that fails (not the model) masks the sample -----------------------------------------------------

PY_CALL = call("python", code="print(37*48)")


@pytest.fixture
def broken_sandbox(monkeypatch):
    import recipe.envs.tools as tools
    from recipe.sandbox import RunResult

    def down(code, stdin, limits):
        return RunResult("sandbox_error", None, "", "", False, 0.0, "bwrap: cannot create namespace")

    monkeypatch.setattr(tools, "run_python", down)


def test_a_broken_sandbox_in_the_python_tool_masks_the_sample_in_eval(tmp_path, broken_sandbox):
    class PythonCaller(ToolEvalEngine):
        def generate(self, prompts, params):
            self.prompts.append(prompts)
            return [Completion([ord(c) for c in PY_CALL], [-0.5] * len(PY_CALL), "stop", 0) for _ in prompts]

    res = evaluate(PythonCaller(), CharTokenizer(), tool_rows(1), EvalConfig(samples=2, pass_k=[1], batch_size=4),
                   tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(ln["masked"] and "sandbox unavailable" in ln["reason"] for ln in lines)
    assert lines[0]["completion"] == PY_CALL  # ended at the failed call: no error reply for the model to read
    assert res["masked_problems"] == 1


def test_a_broken_sandbox_in_the_python_tool_masks_the_sample_in_rl(broken_sandbox):
    def answers(prompt, rid):  # sample 3 of each group calls python; 0 answers right; 1 and 2 wrongly
        return {0: FINAL, 1: "<think></think>12", 2: "<think></think>12", 3: PY_CALL}[rid % 4]

    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(), ScriptedEngine(answers), seed=0)
    samples, stats = orch.next_batch(0)
    masked = [s for s in samples if not any(s.loss_mask)]
    assert len(masked) == 2 and all(s.advantage == 0 for s in masked)
    assert stats["masked_samples"] >= 2 and stats["tool_calls"] == 0
    assert sorted(round(s.advantage, 6) for s in samples if any(s.loss_mask)) == \
        [round(-1 / 3, 6)] * 4 + [round(2 / 3, 6)] * 2


# -- the background event loop ------------------------------------------------------------------------------

def test_background_loop_runs_tool_turns_and_scores_while_the_trainer_works():
    import time

    eng = ScriptedEngine(tool_answers, batch=4)
    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=1), eng, seed=0)
    orch.start()
    try:
        samples, _ = orch.next_batch(0)
        assert len(samples) == 8
        # the trainer now works on step 0; nobody calls next_batch, yet the next batch's groups finish both
        # of their turns and are scored
        deadline = time.monotonic() + 10
        while orch.ready_groups < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orch.ready_groups == 2 and orch.in_flight_groups == 0  # ready: both turns done, and scored
        assert orch.running
        eng.update_weights(None, 1)
        samples, stats = orch.next_batch(1)
        assert len(samples) == 8 and stats["tool_calls"] >= 4
        for s in samples:
            if s.reward == 1:
                check_tool_sample(s)
    finally:
        orch.close()
    assert not orch.running


def test_background_loop_at_sync_level_submits_nothing_ahead():
    import time

    eng = ScriptedEngine(tool_answers, batch=4)
    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=0), eng, seed=0)
    orch.start()
    try:
        orch.next_batch(0)
        time.sleep(0.3)
        assert eng.submitted == 2 * (4 + 2)  # two groups: 4 first turns and 2 tool continuations each
        assert orch.in_flight_groups == 0 and orch.ready_groups == 0
    finally:
        orch.close()


def test_an_engine_failure_in_the_background_loop_reaches_next_batch():
    class Dying(ScriptedEngine):
        def poll(self, timeout=None):
            raise RuntimeError("hf engine process died (exit code -9)")

    orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(), Dying(tool_answers), seed=0)
    orch.start()
    try:
        with pytest.raises(RuntimeError, match="exit code -9"):
            orch.next_batch(0)
    finally:
        orch.close()


def test_rl_ends_a_sample_whose_next_turn_would_not_fit_the_context():
    def answers(prompt, rid):  # per group: sample 0 right at once, 1 wrong at once, 2 and 3 call the calculator
        if "<tool_response>" in prompt:
            return FINAL
        return {0: FINAL, 1: "<think></think>12"}.get(rid % 4, CALL)

    class Recording(ScriptedEngine):
        def __init__(self, answer_fn):
            super().__init__(answer_fn)
            self.longest = 0  # prompt + the tokens asked for, at most
            self.second = set()  # what the second turns asked for

        def submit(self, requests):
            self.longest = max([self.longest] + [len(r.prompt_ids) + r.params.max_new_tokens for r in requests])
            self.second |= {r.params.max_new_tokens for r in requests if len(r.prompt_ids) > PROMPT_LEN}
            super().submit(requests)

    m = len(CALL)
    fits = PROMPT_LEN + len(CALL) + len(REPLY) + 1  # exactly room for the reply and one token of a second turn
    for context, calls in ((fits - 1, 0), (fits, 4), (fits + m, 4)):
        eng = Recording(answers)
        orch = Orchestrator(tool_rows(), CharTokenizer(), rl_cfg(max_async_level=0, max_new_tokens=m), eng, seed=0,
                            context=context)
        samples, stats = orch.next_batch(0)
        assert stats["tool_calls"] == calls and eng.longest <= context
        assert eng.second == ({min(m, context - fits + 1)} if calls else set())  # capped to what the context leaves
        assert stats["out_of_context_samples"] == 4 - calls
        cut = [s for s in samples if "".join(map(chr, s.completion_ids)) == CALL]
        # ended at the first call, truncated, and trained on as it stands: reward 0, not masked
        assert len(cut) == 4 - calls
        assert all(s.reward == 0 and s.loss_mask == [1] * len(CALL) and s.advantage == -0.25 for s in cut)
