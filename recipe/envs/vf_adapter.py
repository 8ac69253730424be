"""Prime Intellect's verifiers tasksets as an environment of this project (the optional extra `verifiers`).

verifiers 0.4.0 (`verifiers.v1`) splits an environment in two: a taskset (rows as typed `TaskData`, scoring as a
`Task`'s `@vf.reward` / `@vf.metric` methods) and a harness (the program that talks to the model: a tool-less chat
loop, a bash agent, a coding CLI), run in a runtime (a local process, a container, a remote sandbox). This adapter
takes the taskset alone:

- `make data`: the taskset's tasks become schema rows (`task_rows`): the prompt as the model would see it (system
  prompt, then the prompt) and, in `info`, the taskset's name and config and the task's own data, from which the
  task is rebuilt to score;
- generation stays this project's (its engines, its chat format);
- `VerifiersEnv.score` turns the completion into a verifiers trace (the prompt, then one assistant message: the
  text after </think> as its content, the reasoning before it as its reasoning_content, as vLLM's reasoning parser
  hands a reply to a harness) and calls the task's own `Task.score(trace)`; the reward is the trace's weighted sum.

That is the rollout verifiers' `null` harness (a chat loop without tools: one reply) would have scored, so it is
faithful only for single-turn tasksets scored from the transcript alone. Anything more (a harness or environment of
the taskset's own, tools, a runtime box, a model judge, request rewriting, a conversation the user opens) is
refused with one line that names the taskset and says why, rather than scored wrongly (`single_turn_problems`).

verifiers is imported lazily: without it, the project runs as before, and a task or row that names this
environment stops with one line naming the extra to install.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from recipe.chat import THINK_END, THINK_START, parse_final_answer
from recipe.envs.base import Environment, RewardResult, call_with_timeout
from recipe.errors import ConfigError, RecipeError, StageError

log = logging.getLogger(__name__)

NAME = "verifiers"
INSTALL = "pip install -e .[verifiers]"
PARAMS = ("taskset", "config", "limit")  # what a data task of this environment takes (data.tasks[].params)


class TasksetRefused(ConfigError):
    """A taskset this adapter would score wrongly (not single-turn, or not scored from the transcript alone)."""


def verifiers_api():
    """`verifiers.v1`, or one line saying how to install it."""
    try:
        import verifiers
    except ImportError:
        raise StageError(f"the '{NAME}' environment needs Prime Intellect's verifiers library, which is not "
                         f"installed: install the extra with `{INSTALL}`") from None
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise StageError(f"the '{NAME}' environment takes verifiers.v1 tasksets (verifiers >= 0.4.0), and the "
                         f"installed verifiers {getattr(verifiers, '__version__', '?')} has none ({e}): install "
                         f"the extra with `{INSTALL}`") from None
    return vf


@dataclass(frozen=True)
class LoadedTaskset:
    """A taskset resolved from its name: `ref` as the task names it, the Taskset instance (rows not loaded yet),
    the package that exported it, and the config arguments it was built from (written into every row)."""

    ref: str
    taskset: Any
    package: Any
    config_args: dict

    @property
    def task_type(self):
        return type(self.taskset).task_type()


def load_taskset(ref: str, config_args: dict | None = None, where: str = "") -> LoadedTaskset:
    """The taskset `ref` names, built with `config_args` (its TasksetConfig's fields: what `--env.taskset.*` sets).

    `ref` is a verifiers taskset id, resolved as verifiers itself does (`vf.import_taskset`, `vf.load_taskset`):
    the installed package of that name (an Environments Hub id `owner/name@version` installs as `name`) exporting
    one Taskset subclass in `__all__`. Or `module:Class`, a Taskset subclass that is not packaged as a plugin
    (a taskset defined in a script or a test). `where` names the config key in errors."""
    vf = verifiers_api()
    where = f"{where}: " if where else ""
    config_args = dict(config_args or {})
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{where}params.taskset must name a verifiers taskset (an installed taskset id, or "
                          f"module:Class), got {ref!r}")
    module_name, _, attr = ref.partition(":")
    try:
        if attr:
            package = importlib.import_module(module_name)
            cls = getattr(package, attr, None)
            if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
                raise ConfigError(f"{where}verifiers taskset {ref!r}: {module_name}.{attr} is not a "
                                  f"verifiers.v1 Taskset subclass (it is {cls!r})")
            from verifiers.v1.utils.generic import concrete_type  # the lookup vf.taskset_config_type makes

            config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            taskset = cls(_validated_config(config_type, config_args, ref, where))
        else:
            package = vf.import_taskset(ref)
            config_type = vf.taskset_config_type(ref)
            taskset = vf.load_taskset(_validated_config(config_type, {**config_args, "id": ref}, ref, where))
    except RecipeError:
        raise
    except Exception as e:  # an import or plugin lookup that fails: say which API the package was written for
        raise ConfigError(f"{where}verifiers taskset {ref!r} cannot be loaded: {_load_failure(ref, e)}") from None
    return LoadedTaskset(ref=ref, taskset=taskset, package=package, config_args=config_args)


def _validated_config(config_type, args: dict, ref: str, where: str):
    try:
        return config_type.model_validate(args)
    except Exception as e:  # pydantic's ValidationError: name the first bad field
        first = str(e).splitlines()
        detail = "; ".join(line.strip() for line in first[1:3]) if len(first) > 1 else str(e)
        raise ConfigError(f"{where}params.config={ {k: v for k, v in args.items() if k != 'id'} }: verifiers "
                          f"taskset {ref!r} ({config_type.__name__}) refuses it: {detail}") from None


def _load_failure(ref: str, error: Exception) -> str:
    """Why `ref` did not load, in one line. The INTELLECT-3 environments of the Environments Hub were written for
    verifiers' earlier API (a `load_environment()` returning `vf.SingleTurnEnv` and the like), which verifiers
    0.4.0 does not have: such a package fails on a missing `verifiers` attribute, or imports and exports no
    Taskset."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    module_name = ref.partition(":")[0].rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    legacy = "module 'verifiers' has no attribute" in text
    try:
        legacy = legacy or hasattr(importlib.import_module(module_name), "load_environment")
    except Exception:  # not importable at all: the error above says why
        pass
    if legacy:
        return (f"{text}; it looks written for verifiers' earlier API (load_environment() returning "
                f"vf.SingleTurnEnv, ...), which verifiers 0.4.0 does not have: the adapter takes verifiers.v1 "
                f"tasksets")
    return text


# --- what makes a taskset single-turn -----------------------------------------------------------------------


def _exports(package, base) -> list[str]:
    """Names of the `base` subclasses the package exports in `__all__` (verifiers' plugin convention: a taskset
    package may export a Harness of its own, or an Env that runs its episodes)."""
    out = []
    for name in getattr(package, "__all__", None) or []:
        obj = getattr(package, name, None)
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
            out.append(obj.__name__)
    return out


def _needs_runtime(fn) -> bool:
    """A scoring hook that takes the runtime box and has no default for it: Task.score skips it without a
    runtime, which would silently drop part of the reward."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def taskset_problems(loaded: LoadedTaskset, task) -> list[str]:
    """Why the taskset is not single-turn and scored from the transcript alone, judged on its package, its
    Task class and config (one task instance shows what is plugged into the config); [] when it is."""
    vf = verifiers_api()
    from verifiers.v1.utils.decorators import discover_decorated  # what Task.score and the rollout look up

    problems = []
    harnesses = _exports(loaded.package, vf.Harness)
    if harnesses:
        problems.append(f"harness-based: its package ships the harness {', '.join(harnesses)}, a program of its "
                        f"own that drives the model")
    envs = [e for e in _exports(loaded.package, vf.Env) if e != vf.SingleAgentEnv.__name__]
    if envs:
        problems.append(f"multi-turn: its package ships the environment {', '.join(envs)}, which runs each "
                        f"episode itself (a user simulator, a game engine, several agents)")
    tools = [type(t).__name__ for t in (list(type(loaded.taskset).toolsets(loaded.taskset.config))
                                        + list(task.toolsets(task.config)))]
    if tools:
        problems.append(f"tool-using: its tasks serve the tools of {', '.join(tools)}")
    if getattr(task, "NEEDS_CONTAINER", False):
        problems.append("sandbox-based: its Task needs a container (NEEDS_CONTAINER)")
    prepared = [hook for hook in ("setup", "finalize", "stage_verifier")
                if getattr(type(task), hook) is not getattr(vf.Task, hook)]
    if prepared:
        problems.append(f"sandbox-based: its Task prepares or reads a runtime box ({', '.join(prepared)})")
    in_box = [fn.__name__ for fn in task.hooks("reward") + task.hooks("metric") if _needs_runtime(fn)]
    if in_box:
        problems.append(f"sandbox-based: its rewards or metrics {in_box} score inside a runtime box")
    if task.config.judges:
        problems.append("model-judged: its scoring asks a model judge (taskset.task.judges), and this adapter "
                        "scores without a model")
    rewriting = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    if rewriting:
        problems.append(f"request-rewriting: its Task rewrites the model's requests or replies "
                        f"(@vf.intercept {rewriting}), which this project's engines would not apply")
    return problems


def row_problems(data) -> list[str]:
    """Why one task's data cannot be a single-turn row: no prompt, tool traffic, images, a box to run in."""
    vf = verifiers_api()
    problems = []
    if data.prompt is None:
        problems.append("multi-turn: its prompt is empty, so the user opens the conversation")
    for m in [] if data.prompt is None or isinstance(data.prompt, str) else data.prompt:
        if isinstance(m, vf.ToolMessage) or getattr(m, "tool_calls", None):
            problems.append("tool-using: its prompt carries tool calls or tool results")
            break
        if isinstance(m.content, list) and any(not isinstance(p, vf.TextContentPart) for p in m.content):
            problems.append("multimodal: its prompt carries images, and this project's models read text")
            break
    if data.image or data.artifacts:
        problems.append("sandbox-based: it names a container image or artifacts to collect from a runtime box")
    if data.skills:
        problems.append("harness-based: it installs skills for an agent harness")
    return problems


def refuse(ref: str, problems: list[str], where: str = "") -> None:
    if problems:
        where = f"{where}: " if where else ""
        raise TasksetRefused(f"{where}verifiers taskset {ref!r} is not single-turn or not scored from the "
                             f"transcript alone, so the '{NAME}' environment refuses it: {'; '.join(problems)}")


# --- rows -------------------------------------------------------------------------------------------------


def prompt_messages(data) -> list:
    """The verifiers messages the model is sent for this task, as the `null` harness sends them: the system
    prompt, then the prompt (a text becomes one user message)."""
    vf = verifiers_api()
    out = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    return out + ([vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt))


def schema_message(m) -> dict:
    """A verifiers message as a schema message (role, content, tool_calls); text content only (row_problems
    refuses the rest)."""
    from verifiers.v1.types import content_text

    content = m.content if isinstance(m.content, str) else content_text(m.content) if m.content else ""
    return {"role": m.role, "content": content, "tool_calls": None}


def reference_answer(data) -> str:
    """The row's `answer` column: the task data's `answer` field where it declares one (a common taskset
    convention, not a verifiers API; scoring never reads it), else empty."""
    value = getattr(data, "answer", None)
    return "" if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def task_rows(loaded: LoadedTaskset, task_name: str, limit: int | None = None, where: str = "",
              difficulty: float = 0.0) -> Iterator[dict]:
    """Schema rows (every key but `split`, which the data builder assigns) of the taskset's tasks, lazily, in
    the taskset's order, at most `limit` (required for an infinite taskset). Refuses the taskset on its first
    task, and any task that is not single-turn, naming it."""
    if limit is None and not loaded.taskset.bounded:
        raise ConfigError(f"{where + ': ' if where else ''}verifiers taskset {loaded.ref!r} is infinite "
                          f"(Taskset.INFINITE): give params.limit, the number of tasks to read")
    data_type = loaded.task_type.data_type()
    seen = set()
    for n, task in enumerate(loaded.taskset):
        if limit is not None and n >= limit:
            return
        if n == 0:
            refuse(loaded.ref, taskset_problems(loaded, task), where)
        label = f"{where + ': ' if where else ''}task {task.data.idx}" + (f" ({task.data.name})" if task.data.name
                                                                           else "")
        refuse(loaded.ref, row_problems(task.data), label)
        stored = task.data.model_dump(mode="json")
        if data_type.model_validate(stored) != task.data:  # scoring rebuilds the task from this copy
            raise ConfigError(f"{label}: the data of verifiers taskset {loaded.ref!r} does not survive a JSON "
                              f"round trip ({data_type.__name__}), so it cannot be rebuilt to score")
        if task.key in seen:
            continue  # verifiers requires unique keys; a repeated task would only repeat a row
        seen.add(task.key)
        yield {
            "id": f"{task_name}-{task.key[:12]}",
            "env": NAME, "task": task_name,
            "prompt": [schema_message(m) for m in prompt_messages(task.data)],
            "completion": [],
            "answer": reference_answer(task.data),
            "info": json.dumps({"taskset": loaded.ref, "config": loaded.config_args, "data": stored,
                                "key": task.key}, sort_keys=True),
            "difficulty": float(difficulty),
            "tools": "[]",
        }


def rows_from_params(params: dict, task_name: str, where: str, difficulty: float = 0.0) -> Iterator[dict]:
    """task_rows for a data task of this environment: params {taskset, config, limit} (data.tasks[].params)."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ConfigError(f"{where}.params={params}: the '{NAME}' environment takes {list(PARAMS)}, not {unknown}")
    if "taskset" not in params:
        raise ConfigError(f"{where}.params needs taskset: the verifiers taskset to read (an installed taskset id, "
                          f"or module:Class)")
    limit = params.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{where}.params.limit must be an integer >= 1, got {limit!r}")
    config = params.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{where}.params.config must be a mapping of the taskset's config fields, got {config!r}")
    loaded = load_taskset(params["taskset"], dict(config), where)
    return task_rows(loaded, task_name, limit, where, difficulty)


# --- scoring ----------------------------------------------------------------------------------------------


def split_reply(completion: str) -> tuple[str | None, str | None]:
    """(content, reasoning_content) of the assistant message for a completion in this project's format, as
    vLLM's reasoning parser splits a reply: the text after the last </think> is the content, the text before it
    (less <think>) the reasoning. Without </think> the reply never left its reasoning: no content."""
    answer = parse_final_answer(completion)
    if answer is None:
        reasoning = completion.strip().removeprefix(THINK_START).strip()
        return None, reasoning or None
    reasoning = completion.rsplit(THINK_END, 1)[0].strip().removeprefix(THINK_START).strip()
    return answer, reasoning or None


def reply_trace(task, completion: str):
    """The verifiers trace of one single-turn rollout: the prompt messages, then the reply as the one sampled
    assistant message, stopped as a finished agent run stops (`agent_completed`)."""
    vf = verifiers_api()
    from verifiers.v1.state import state_cls  # the Task's declared State type, as a rollout builds it

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="recipe", trainable=True),
    )
    for message in prompt_messages(task.data):
        trace.nodes.append(vf.MessageNode(parent=len(trace.nodes) - 1 if trace.nodes else None, message=message))
    content, reasoning = split_reply(completion)
    trace.nodes.append(vf.MessageNode(parent=len(trace.nodes) - 1, sampled=True,
                                      message=vf.AssistantMessage(content=content, reasoning_content=reasoning)))
    trace.stop("agent_completed")
    return trace


class VerifiersEnv(Environment):
    """A verifiers taskset's rows, scored by the taskset's own Task.score on a trace of this project's reply."""

    name = NAME
    rubric = []  # the taskset's own rewards score (Task.score)
    _resolved: dict = {}  # (taskset, config) -> (LoadedTaskset, checked): shared by every instance (get_env makes many)
    _lock = threading.Lock()

    def task_of(self, row: dict):
        """The verifiers Task a row was written from, rebuilt from its info; the taskset is resolved and checked
        once per (taskset, config)."""
        try:
            ref = json.loads(row["info"])
            key = json.dumps([ref["taskset"], ref["config"]], sort_keys=True)
            data = ref["data"]
        except (ValueError, KeyError, TypeError) as e:
            raise StageError(f"row {row.get('id')!r} of the '{NAME}' environment has no taskset reference in its "
                             f"info ({type(e).__name__}: {e}): rewrite the data with `make data`") from None
        with self._lock:
            if key not in self._resolved:
                self._resolved[key] = [load_taskset(ref["taskset"], ref["config"], f"row {row.get('id')!r}"), False]
            entry = self._resolved[key]
        loaded = entry[0]
        try:
            task_data = loaded.task_type.data_type().model_validate(data)
        except Exception as e:  # pydantic's ValidationError: the taskset's data type changed since `make data`
            raise StageError(f"row {row.get('id')!r}: its task data no longer fits verifiers taskset "
                             f"{loaded.ref!r} ({str(e).splitlines()[0]}): rewrite the data with `make data`") from None
        task = loaded.task_type(task_data, loaded.taskset.config.task)
        if not entry[1]:  # a taskset that changed since `make data` is refused here too, before any score
            refuse(loaded.ref, taskset_problems(loaded, task), f"row {row.get('id')!r}")
            entry[1] = True
        refuse(loaded.ref, row_problems(task.data), f"row {row.get('id')!r}")
        return task

    def score(self, completion: str, row: dict) -> RewardResult:
        task = self.task_of(row)  # a RecipeError (no verifiers, a refused taskset) stops the run: every row alike
        trace = reply_trace(task, completion)
        metrics = {"formatted": float(parse_final_answer(completion) is not None)}
        try:
            call_with_timeout(lambda: asyncio.run(task.score(trace)), (), self.reward_timeout_s)
        except RecipeError:
            raise
        except Exception as e:  # a verifier bug or a hang costs one sample, not the run
            log.warning("verifiers taskset scoring failed on row %s: %s", row.get("id"), e)
            return RewardResult(reward=0.0, metrics=metrics, errors=[f"Task.score: {type(e).__name__}: {e}"])
        metrics.update({name: r.score for name, r in trace.rewards.items() if r is not None})
        metrics.update({f"metric.{name}": v for name, v in trace.metrics.items() if v is not None})
        return RewardResult(reward=float(trace.reward), metrics=metrics)
