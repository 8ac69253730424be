"""The verifiers adapter (recipe/envs/vf_adapter.py) on small tasksets defined here with verifiers' own classes:
rows into the schema and through `make data`, rewards equal to the taskset's own scoring, the eval runner over
them, and one-line refusals of what is not single-turn. Skipped where the optional extra is not installed."""
import json
import re
import sys
import textwrap

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the optional extra: pip install -e .[verifiers]")

from recipe.data.schema import read_rows, read_split, write_rows  # noqa: E402
from recipe.envs import ENVIRONMENTS, get_env  # noqa: E402
from recipe.envs.vf_adapter import (  # noqa: E402
    TasksetRefused,
    VerifiersEnv,
    load_taskset,
    reply_trace,
    task_rows,
    verifiers_api,
)
from recipe.errors import ConfigError, StageError  # noqa: E402

HERE = __name__  # the module:Class references below name the tasksets defined here


# --- a single-turn taskset: sums, a weighted correctness reward, a brevity reward and a metric ---------------

class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=0.8)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.2)
    async def brief(self, trace: vf.Trace) -> float:
        return float(0 < len(trace.last_reply) <= 6)

    @vf.metric
    async def reasoned(self, trace: vf.Trace) -> float:
        return float(bool(trace.assistant_messages[-1].reasoning_content))


class SumConfig(vf.TasksetConfig):
    n: int = 40
    system: str = "Reply with the number alone."


def sums(task_cls, config):
    for i in range(config.n):
        a, b = 3 * i + 11, 7 * i + 20
        yield task_cls(SumData(prompt=f"What is {a} + {b}?", system_prompt=config.system, answer=str(a + b)),
                       config.task)


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        return sums(SumTask, self.config)


def taskset_rows(ref=f"{HERE}:SumTaskset", config=None, task="sums", limit=None, split="rl"):
    return [{**r, "split": split} for r in task_rows(load_taskset(ref, config or {}), task, limit)]


def own_reward(task, completion_content, reasoning=None):
    """What the taskset itself gives a reply: its Task.score on a trace built by verifiers' own turn commit
    (verifiers.v1.graph.prepare_turn, as a rollout records a model turn), independent of the adapter."""
    import asyncio

    from verifiers.v1.graph import prepare_turn

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    prompt = [vf.SystemMessage(content=task.data.system_prompt), vf.UserMessage(content=task.data.prompt)]
    reply = vf.AssistantMessage(content=completion_content, reasoning_content=reasoning)
    prepare_turn(trace, prompt).commit(vf.Response(id="r", created=0, model="m", message=reply, finish_reason="stop"))
    asyncio.run(task.score(trace))
    return trace.reward, trace


def test_the_environment_is_registered():
    assert ENVIRONMENTS["verifiers"] is VerifiersEnv
    assert isinstance(get_env("verifiers"), VerifiersEnv)


def test_rows_follow_the_schema_and_carry_the_task(tmp_path):
    rows = taskset_rows(config={"n": 5})
    assert len(rows) == 5 and len({r["id"] for r in rows}) == 5
    sha = write_rows(rows, tmp_path / "rl.parquet")  # the project's schema check and writer
    back = read_rows(tmp_path / "rl.parquet", sha)
    first = back[0]
    assert first["env"] == "verifiers" and first["task"] == "sums" and first["completion"] == []
    assert [(m["role"], m["content"]) for m in first["prompt"]] == [
        ("system", "Reply with the number alone."), ("user", "What is 11 + 20?")]
    assert first["answer"] == "31" and first["tools"] == "[]"
    info = json.loads(first["info"])
    assert info["taskset"] == f"{HERE}:SumTaskset" and info["config"] == {"n": 5}
    assert info["data"]["answer"] == "31" and info["data"]["idx"] == 0
    assert first["id"] == f"sums-{info['key'][:12]}"


@pytest.mark.parametrize("completion,content,reasoning,expected", [
    ("<think>\n11+20\n</think>\n31", "31", "11+20", 1.0),  # right and brief
    ("<think>\n11+20\n</think>\n32", "32", "11+20", 0.2),  # wrong, brief
    ("<think>x</think>the sum is 32, I think", "the sum is 32, I think", "x", 0.0),  # wrong and long
    ("31", None, "31", 0.0),  # no </think>: the reply never left its reasoning
])
def test_rewards_equal_the_tasksets_own_scoring(completion, content, reasoning, expected):
    row = taskset_rows(config={"n": 3})[0]
    env = get_env("verifiers")
    res = env.score(completion, row)
    task = next(iter(SumTaskset(SumConfig(n=3))))
    own, trace = own_reward(task, content, reasoning)
    assert res.reward == pytest.approx(own) == pytest.approx(expected)
    assert res.metrics["correct"] == trace.rewards["correct"].score
    assert res.metrics["brief"] == trace.rewards["brief"].score
    assert res.metrics["metric.reasoned"] == float(reasoning is not None)
    assert res.metrics["formatted"] == float(content is not None) and not res.errors and not res.masked


def test_the_reply_trace_is_the_one_a_rollout_records():
    task = next(iter(SumTaskset(SumConfig(n=1))))
    ours = reply_trace(task, "<think>\nr\n</think>\n31")
    _, theirs = own_reward(task, "31", "r")
    assert ours.messages == theirs.messages
    assert [n.parent for n in ours.nodes] == [n.parent for n in theirs.nodes]
    assert [n.sampled for n in ours.nodes] == [n.sampled for n in theirs.nodes] == [False, False, True]
    assert ours.last_reply == "31" and ours.stop_condition == "agent_completed"


def test_make_data_writes_taskset_rows_beside_the_tiny_tasks(tmp_path):
    from recipe.data.__main__ import main

    args = [f"run_root={tmp_path}", "data.sft_rows_per_task=20", "data.rl_rows_per_task=20",
            "data.eval_rows_per_task=3", "data.pretrain_rows_per_task=10",
            "data.tasks=[{env:math,task:add},"
            f"{{env:verifiers,task:sums,params:{{taskset:'{HERE}:SumTaskset',config:{{n:60}}}}}}]"]
    main(args)
    d = tmp_path / "tiny" / "data"
    rl, held_out, sft = read_split(d, "rl"), read_split(d, "eval"), read_split(d, "sft")
    vf_rl = [r for r in rl if r["env"] == "verifiers"]
    vf_eval = [r for r in held_out if r["env"] == "verifiers"]
    assert len(vf_rl) == 20 and 1 <= len(vf_eval) <= 3
    assert not [r for r in sft if r["env"] == "verifiers"]  # no demonstrations to train SFT on
    assert not {r["id"] for r in vf_rl} & {r["id"] for r in vf_eval}
    assert {r["env"] for r in rl} == {"math", "verifiers"}
    assert all(r["split"] == "eval" for r in vf_eval)
    row = vf_rl[0]  # a row read back from parquet scores as the taskset does
    answer = json.loads(row["info"])["data"]["answer"]
    assert get_env("verifiers").score(f"<think>t</think>{answer}", row).reward == pytest.approx(1.0)


class SumEvalEngine:
    """Sample 0 of each problem answers the sum, sample 1 a wrong one (the Generator contract)."""

    def generate(self, prompts, params):
        from recipe.inference import Completion

        out = []
        for j, p in enumerate(prompts):
            a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", "".join(map(chr, p))).groups())
            text = f"<think>t</think>{a + b if j % 2 == 0 else a + b + 1}"
            out.append(Completion([ord(c) for c in text], [0.0] * len(text), "stop", 0))
        return out


def test_the_eval_runner_scores_taskset_rows_through_the_adapter(tmp_path):
    from recipe.config import EvalConfig
    from recipe.eval.runner import evaluate
    from tests.fakes import CharTokenizer

    rows = taskset_rows(config={"n": 4}, split="eval")
    cfg = EvalConfig(samples=2, pass_k=[1, 2], batch_size=4)
    res = evaluate(SumEvalEngine(), CharTokenizer(), rows, cfg, tmp_path)
    m = res["env"]["verifiers"]
    assert m["avg@2"] == pytest.approx((1.0 + 0.2) / 2)  # right and brief; wrong but brief
    assert res["task"]["verifiers/sums"]["avg@2"] == pytest.approx(0.6)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted({(ln["sample"], ln["reason"]) for ln in lines}) == [(0, "correct"), (1, "wrong answer")]


def test_the_rl_orchestrator_trains_on_the_tasksets_rewards():
    from recipe.config import RLConfig
    from recipe.rl.orchestrator import Orchestrator
    from tests.fakes import CharTokenizer, ScriptedEngine

    def first_sample_right(prompt, request_id):  # sample 0 of each group of 4 answers the sum, the others miss
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups())
        return f"<think>t</think>{a + b if request_id % 4 == 0 else a + b + 1}"

    cfg = RLConfig(batch_size=2, rollouts_per_example=4, env_mix={"verifiers": 1.0})
    orch = Orchestrator(taskset_rows(config={"n": 8}), CharTokenizer(), cfg, ScriptedEngine(first_sample_right),
                        seed=0)
    try:
        samples, _ = orch.next_batch(0)
    finally:
        orch.close()
    assert len(samples) == 8 and {s.env for s in samples} == {"verifiers"}
    assert sorted(s.reward for s in samples) == pytest.approx([0.2] * 6 + [1.0] * 2)
    # advantage: reward minus the group mean (1.0 + 3 * 0.2) / 4
    assert sorted(s.advantage for s in samples) == pytest.approx([-0.2] * 6 + [0.6] * 2)


class BrokenTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        raise RuntimeError("reward bug")


class BrokenTaskset(vf.Taskset[BrokenTask, SumConfig]):
    def load(self):
        return sums(BrokenTask, self.config)


def test_a_reward_that_raises_costs_the_sample_not_the_run():
    row = taskset_rows(f"{HERE}:BrokenTaskset", {"n": 1})[0]
    res = get_env("verifiers").score("<think>t</think>31", row)
    assert res.reward == 0.0 and not res.masked
    assert res.errors and "reward bug" in res.errors[0]


# --- what is refused ---------------------------------------------------------------------------------------

class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class ToolTask(SumTask):
    @classmethod
    def toolsets(cls, config):
        return [CalculatorToolset(vf.ToolsetConfig())]


class BoxTask(SumTask):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime) -> float:
        return 1.0


class SetupTask(SumTask):
    async def setup(self, trace, runtime) -> None:
        await runtime.write("/task/answer.txt", b"")


class InterceptTask(SumTask):
    @vf.intercept
    async def add_hint(self, request: vf.Request) -> vf.Request | None:
        return None


class ContainerTask(SumTask):
    NEEDS_CONTAINER = True


class ToolTaskset(vf.Taskset[ToolTask, SumConfig]):
    def load(self):
        return sums(ToolTask, self.config)


class BoxTaskset(vf.Taskset[BoxTask, SumConfig]):
    def load(self):
        return sums(BoxTask, self.config)


class SetupTaskset(vf.Taskset[SetupTask, SumConfig]):
    def load(self):
        return sums(SetupTask, self.config)


class InterceptTaskset(vf.Taskset[InterceptTask, SumConfig]):
    def load(self):
        return sums(InterceptTask, self.config)


class ContainerTaskset(vf.Taskset[ContainerTask, SumConfig]):
    def load(self):
        return sums(ContainerTask, self.config)


class UserOpensTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        yield SumTask(SumData(prompt=None, answer="1"), self.config.task)


class ToolHistoryTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        call = vf.ToolCall(id="c1", name="add", arguments='{"a": 1, "b": 2}')
        yield SumTask(SumData(prompt=[vf.UserMessage(content="1+2?"), vf.AssistantMessage(tool_calls=[call]),
                                      vf.ToolMessage(tool_call_id="c1", content="3")], answer="3"), self.config.task)


class EndlessTaskset(vf.Taskset[SumTask, SumConfig]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            yield SumTask(SumData(prompt=f"What is {i} + 0?", answer=str(i)), self.config.task)
            i += 1


@pytest.mark.parametrize("taskset,config,why", [
    ("ToolTaskset", {}, "tool-using: its tasks serve the tools of CalculatorToolset"),
    ("BoxTaskset", {}, "sandbox-based: its rewards or metrics ['tests_pass'] score inside a runtime box"),
    ("SetupTaskset", {}, "sandbox-based: its Task prepares or reads a runtime box (setup)"),
    ("ContainerTaskset", {}, "sandbox-based: its Task needs a container"),
    ("InterceptTaskset", {}, "request-rewriting: its Task rewrites the model's requests or replies"),
    ("SumTaskset", {"task": {"judges": [{"id": "reference"}]}}, "model-judged: its scoring asks a model judge"),
    ("UserOpensTaskset", {}, "multi-turn: its prompt is empty, so the user opens the conversation"),
    ("ToolHistoryTaskset", {}, "tool-using: its prompt carries tool calls or tool results"),
])
def test_a_taskset_that_is_not_single_turn_is_refused_in_one_line(taskset, config, why):
    with pytest.raises(TasksetRefused) as e:
        taskset_rows(f"{HERE}:{taskset}", config)
    msg = str(e.value)
    assert "\n" not in msg and f"verifiers taskset '{HERE}:{taskset}'" in msg and why in msg, msg


def test_the_data_stage_names_the_task_and_the_reason(cfg_factory):
    from recipe.data.tiny import build_tiny

    cfg = cfg_factory(f"data.tasks=[{{env:verifiers,task:calc,params:{{taskset:'{HERE}:ToolTaskset'}}}}]")
    with pytest.raises(TasksetRefused, match=r"^config error: data\.tasks\[0\]: verifiers taskset .*tool-using"):
        build_tiny(cfg.data)


def test_scoring_refuses_a_row_whose_taskset_became_tool_using():
    row = taskset_rows(config={"n": 1})[0]
    info = json.loads(row["info"])
    row = {**row, "info": json.dumps({**info, "taskset": f"{HERE}:ToolTaskset"})}
    with pytest.raises(TasksetRefused, match="tool-using"):
        get_env("verifiers").score("<think>t</think>31", row)


def test_an_infinite_taskset_needs_a_limit():
    with pytest.raises(ConfigError, match=r"is infinite .*params\.limit"):
        taskset_rows(f"{HERE}:EndlessTaskset")
    assert [r["answer"] for r in taskset_rows(f"{HERE}:EndlessTaskset", limit=3)] == ["0", "1", "2"]


def test_bad_params_and_config_name_the_key(cfg_factory):
    from recipe.data.tiny import build_tiny

    cfg = cfg_factory(f"data.tasks=[{{env:verifiers,task:s,params:{{taskset:'{HERE}:SumTaskset',lim:3}}}}]")
    with pytest.raises(ConfigError, match=r"data\.tasks\[0\]\.params=.*takes \['taskset', 'config', 'limit'\], "
                                          r"not \['lim'\]"):
        build_tiny(cfg.data)
    with pytest.raises(ConfigError, match=r"SumConfig\) refuses it: n"):
        load_taskset(f"{HERE}:SumTaskset", {"n": "many"})
    with pytest.raises(ConfigError, match=r"is not a verifiers\.v1 Taskset subclass"):
        load_taskset(f"{HERE}:SumTask")


# --- tasksets packaged as verifiers plugins, loaded by id ------------------------------------------------

SINGLE_TURN_PACKAGE = '''
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def echoed(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ("alpha", "beta"):
            yield EchoTask(EchoData(prompt=f"Repeat: {word}", answer=word), self.config.task)
'''

GAME_ENV = '''

class GameEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GameEnv(vf.Env[GameEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            await interaction.turn()
'''

OWN_HARNESS = '''

class EchoHarness(vf.Harness[vf.HarnessConfig]):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        raise NotImplementedError
'''


def write_package(root, name, source, exports):
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(source) + f"\n__all__ = {exports!r}\n")


@pytest.fixture
def packages(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []
    yield lambda name, source, exports: (write_package(tmp_path, name, source, exports), made.append(name))
    for name in made:
        sys.modules.pop(name, None)


def test_a_taskset_package_loads_by_its_hub_id(packages):
    packages("vfa_echo_env", SINGLE_TURN_PACKAGE, ["EchoTaskset"])
    loaded = load_taskset("someone/vfa-echo-env@0.1.0")  # a hub id installs as its name, dashes as underscores
    rows = [{**r, "split": "rl"} for r in task_rows(loaded, "echo")]
    assert [r["answer"] for r in rows] == ["alpha", "beta"]
    env = get_env("verifiers")
    assert env.score("<think>t</think>beta", rows[1]).reward == 1.0
    assert env.score("<think>t</think>alpha", rows[1]).reward == 0.0


@pytest.mark.parametrize("extra,exports,why", [
    (GAME_ENV, ["EchoTaskset", "GameEnv"], "multi-turn: its package ships the environment GameEnv"),
    (OWN_HARNESS, ["EchoTaskset", "EchoHarness"], "harness-based: its package ships the harness EchoHarness"),
])
def test_a_package_that_runs_its_own_episodes_is_refused(packages, extra, exports, why):
    name = f"vfa_{exports[1].lower()}_env"
    packages(name, SINGLE_TURN_PACKAGE + extra, exports)
    with pytest.raises(TasksetRefused, match=re.escape(why)):
        list(task_rows(load_taskset(name), "echo"))


@pytest.mark.parametrize("source", [
    "import verifiers as vf\n\n\ndef load_environment(**kwargs):\n    return vf.SingleTurnEnv(dataset=None)\n",
    "import verifiers as vf\n\n\nclass Parser(vf.MaybeThinkParser):\n    pass\n",
])
def test_a_package_for_verifiers_earlier_api_is_named_so(packages, source):
    name = f"vfa_legacy_{len(source)}"
    packages(name, source, [])
    with pytest.raises(ConfigError, match=r"cannot be loaded: .*verifiers' earlier API \(load_environment\(\)"):
        load_taskset(name)


def test_without_verifiers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # makes `import verifiers` fail, as when not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(StageError, match=r"^the 'verifiers' environment needs .* install the extra with "
                                         r"`pip install -e \.\[verifiers\]`$"):
        verifiers_api()
    row = {"id": "r0", "env": "verifiers", "info": json.dumps({"taskset": "x", "config": {}, "data": {}})}
    with pytest.raises(StageError, match=r"pip install -e \.\[verifiers\]"):
        get_env("verifiers").score("<think>t</think>1", row)
