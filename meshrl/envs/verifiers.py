"""verifiers tasksets as single-turn meshrl tasks (`task.name=verifiers:TASKSET_ID`).

verifiers 0.4 (the `verifiers` extra) is imported lazily, so `meshrl.envs`
works without it. The taskset is loaded once per process (when the task is
built: the config check, the environment actors' start) with
`vf.load_environment`, and its tasks (listed once, in `load()` order; the first
`MAX_TASKS` of an endless one) are the prompt pool that `generate` draws from.

TASKSET_ID is what verifiers resolves: a taskset that ships with it, or an
installed top-level module exporting one `vf.Taskset` subclass in `__all__`
(in lower case, `-` read as `_`). A dotted module path (`mypkg.tasksets.mine`, a module of
your project, like `mypkg.envs:MyEnv` for your own Env) is imported by meshrl
and handed to verifiers under a top-level alias: verifiers 0.4 resolves only
top-level names.

A prompt is the task's prompt as one user message (meshrl renders prompts
through the tokenizer's chat template as a single user turn): the system
prompt, when the task has one, then a blank line, then the prompt's text (a
chat prompt's message texts joined by blank lines, their roles dropped). The
reward is the taskset's own rubric: `task.score` on a trace of that prompt and
the completion as the one sampled assistant reply, `trace.reward` (the
weighted sum of its `@vf.reward` functions). A rubric that raises fails that
episode (the environment procs count it). The warm start's demonstration is
the task data's `answer` field.

Only what scores a single reply without a sandbox is played: a taskset whose
tasks need a container, tools, setup or a runtime in their rewards, or that
exports its own `vf.Env`, is refused with one line (those are multi-turn
agents: run them against the policy's OpenAI-compatible endpoint instead).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any

from meshrl.envs.base import Env
from meshrl.types import Prompt

PREFIX = "verifiers:"
MAX_TASKS = 100_000
"""Tasks listed from a taskset whose `load()` never ends."""
INSTALL = "pip install 'meshrl[verifiers]'"


class VerifiersError(ValueError):
    """A taskset meshrl cannot play; one line."""


@dataclass
class _Loaded:
    env: Any  # the vf.Env (SingleAgentEnv)
    tasks: list  # vf.Task, in load() order


_loaded: dict[str, _Loaded] = {}
_lock = threading.Lock()


class VerifiersTask(Env):
    """A verifiers taskset's tasks, scored by its rubric."""

    threaded = True  # rubrics are async and may wait (remote checks): under task.step_timeout_s

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        self.taskset_id = taskset_id(cfg.name)
        # Loaded now, in the actor's start, not in the first reward: that runs
        # under task.step_timeout_s, which a large dataset's loading could exceed.
        load(self.taskset_id)

    @staticmethod
    def check_name(name: str) -> str:
        """'' when `name` loads a taskset meshrl can play, else the one-line problem."""
        try:
            load(taskset_id(name))
        except VerifiersError as error:
            return str(error)
        return ""

    @property
    def tasks(self) -> list:
        return load(self.taskset_id).tasks

    def generate(self, rng: random.Random) -> Prompt:
        tasks = self.tasks
        index = rng.randrange(len(tasks))  # the same list in every process (checked by key)
        task = tasks[index]
        answer = getattr(task.data, "answer", None)
        return Prompt(
            text=prompt_text(task.data),
            answer="" if answer is None else str(answer),
            data={"index": index, "key": task.key, "has_answer": answer is not None},
        )

    def from_row(self, row: dict) -> Prompt:
        raise VerifiersError(
            f"{self.cfg.name}: the prompts are the taskset's own; task.dataset does not apply"
        )

    def task_of(self, prompt: Prompt) -> Any:
        """The vf.Task a prompt was drawn from (this process's copy of it)."""
        index, key = prompt.data["index"], prompt.data["key"]
        tasks = self.tasks
        if not (0 <= index < len(tasks)) or tasks[index].key != key:
            raise VerifiersError(
                f"taskset '{self.taskset_id}' loads different tasks in different processes "
                f"(task {index} differs): its load() must be deterministic"
            )
        return tasks[index]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The taskset's rubric on `completion` (a TaskError names a rubric that raised)."""
        task = self.task_of(prompt)
        trace = build_trace(task, completion)
        asyncio.run(task.score(trace))  # each call in its own loop: rewards run in threads
        return float(trace.reward)

    def demonstration(self, prompt: Prompt) -> str:
        if not prompt.data["has_answer"]:
            raise VerifiersError(
                f"taskset '{self.taskset_id}' has no `answer` in its task data to warm-start "
                "on: set warm_start.steps=0"
            )
        return prompt.answer


def taskset_id(name: str) -> str:
    return name.removeprefix(PREFIX).strip()


def prompt_text(data: Any) -> str:
    """The text of a task's prompt as one user message: the system prompt, a
    blank line, then the prompt (a chat prompt's message texts, blank-line joined)."""
    return "\n\n".join(part for part in (data.system_prompt, data.prompt_text) if part)


def build_trace(task: Any, completion: str) -> Any:
    """A trace of the task's prompt and `completion` as the sampled reply, the
    way a tool-less harness records one turn."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import AgentInfo, TraceTask

    data = task.data
    messages = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    else:
        messages.extend(data.prompt or [])
    nodes = [
        vf.MessageNode(message=message, parent=i - 1 if i else None)
        for i, message in enumerate(messages)
    ]
    reply = vf.AssistantMessage(content=completion)
    nodes.append(
        vf.MessageNode(message=reply, parent=len(nodes) - 1 if nodes else None, sampled=True)
    )
    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )


def load(ident: str) -> _Loaded:
    """The taskset `ident`, loaded once per process; VerifiersError (one line)
    when it is missing or not a single-turn taskset."""
    with _lock:
        if ident not in _loaded:
            _loaded[ident] = _load(ident)
        return _loaded[ident]


def _load(ident: str) -> _Loaded:
    if not ident:
        raise VerifiersError("name a verifiers taskset: verifiers:TASKSET_ID")
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise VerifiersError(
            f"the verifiers adapter needs the verifiers package ({error}): {INSTALL}"
        ) from None
    try:
        config = vf.resolve_env_config({"taskset": {"id": _resolvable(ident)}})
        env = vf.load_environment(config)
    except ModuleNotFoundError as error:
        raise VerifiersError(_not_found(ident, error)) from None
    except Exception as error:  # noqa: BLE001 - any failure of the taskset's own code: one line
        raise VerifiersError(f"verifiers taskset '{ident}': {_line(error)}") from None
    if type(env) is not vf.SingleAgentEnv:
        raise VerifiersError(
            f"verifiers taskset '{ident}' comes with its own environment "
            f"({type(env).__name__}); meshrl plays single-turn tasksets"
        )
    taskset = env.taskset if env.taskset.bounded else env.taskset.take(MAX_TASKS)
    try:
        tasks = list(taskset)
    except Exception as error:  # noqa: BLE001
        raise VerifiersError(f"verifiers taskset '{ident}' load(): {_line(error)}") from None
    if not tasks:
        raise VerifiersError(f"verifiers taskset '{ident}' has no tasks")
    problem = _single_turn_problem(tasks[0], type(env.taskset), config.taskset)
    if problem:
        raise VerifiersError(f"verifiers taskset '{ident}' {problem}")
    return _Loaded(env, tasks)


def _resolvable(ident: str) -> str:
    """The id to give verifiers: `ident`, or for a dotted module path (which
    verifiers 0.4 cannot resolve: it looks it up under its own tasksets package,
    whose missing subpackage raises), a top-level alias of the module meshrl imports."""
    if not _dotted(ident):
        return ident
    module = importlib.import_module(module_name(ident))  # ModuleNotFoundError: not found
    alias = "meshrl_taskset__" + module.__name__.lower().replace(".", "__")
    sys.modules.setdefault(alias, module)
    return alias


def _dotted(ident: str) -> bool:
    return "." in ident and "/" not in ident and "@" not in ident  # not owner/name@1.0


def module_name(ident: str) -> str:
    """The module imported for a taskset id: `-` reads as `_`; verifiers also
    lowercases a top-level id and drops a hub id's owner/ and @version."""
    if _dotted(ident):
        return ident.replace("-", "_")
    return ident.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _single_turn_problem(task: Any, taskset_cls: type, taskset_config: Any) -> str:
    """Why the tasks cannot be scored on one reply without a sandbox, or ''."""
    import verifiers.v1 as vf

    agent = "a multi-turn agent (run it against the policy's OpenAI-compatible endpoint)"
    if task.NEEDS_CONTAINER:
        return f"needs a container: {agent}"
    if task.toolsets(task.config) or taskset_cls.toolsets(taskset_config):
        return f"gives the model tools: {agent}"
    if type(task).setup is not vf.Task.setup:
        return f"prepares a runtime in its setup(): {agent}"
    rewards = task.hooks("reward")
    judges = task.plugged_judges()
    if not rewards and not judges:
        return "has no @vf.reward function"
    needs = [fn.__name__ for fn in rewards if _needs_runtime(fn)]
    needs += [judge.reward_name for judge in judges if _needs_runtime(judge.score)]
    if needs:
        # verifiers would skip them without a runtime: the reward would be partial.
        return f"has rewards that need a runtime ({', '.join(needs)}): {agent}"
    return ""


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _not_found(ident: str, error: ModuleNotFoundError) -> str:
    """verifiers' not-found message in one line, or the import inside the
    taskset's module that failed (verifiers reports that as not found too)."""
    cause = error.__cause__ if isinstance(error.__cause__, ModuleNotFoundError) else error
    module = module_name(ident)
    missing = cause.name or module
    if not (module == missing or module.startswith(missing + ".")):
        return f"verifiers taskset '{ident}' does not import: {_line(cause)}"
    return (
        f"verifiers taskset '{ident}' not found (no module '{module}' is installed or ships "
        "with verifiers): a taskset is a module exporting one vf.Taskset subclass in __all__"
    )


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
