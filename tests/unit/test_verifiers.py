"""The verifiers adapter (`task.name=verifiers:...`): prompts from a taskset defined
in the tests (tests/support/vf_taskset.py, a local dataset and an async rubric),
rewards from its rubric, and one line for a taskset that does not exist or cannot be
played single-turn. (GRPO training on it: tests/e2e/test_verifiers.py.)"""

import importlib.util
import random
import sys

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, TaskConfig, load_config
from meshrl.envs import make_task
from meshrl.envs.verifiers import VerifiersTask, build_trace, prompt_text
from tests.conftest import DEFAULT_CONFIG
from tests.support.vf_rubric import NAME, read_jsonl, rubric

# The `verifiers` extra (in dev), looked for without importing it: collecting this file
# costs each pytest worker nothing.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None, reason="needs the verifiers extra"
)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_prompts_come_from_the_taskset_and_rewards_from_its_rubric():
    from tests.support.vf_taskset import ROWS

    task = make_task(TaskConfig(name=NAME))
    assert isinstance(task, VerifiersTask) and len(task.tasks) == 200
    rows = read_jsonl(ROWS)
    prompts = task.sample(20, random.Random(0))
    for prompt in prompts:
        row = rows[prompt.data["index"]]
        assert prompt.text == f"{row['digits']}>" and prompt.answer == row["answer"]
        assert task.demonstration(prompt) == row["answer"]
        for completion in (row["answer"], f" {row['answer']}\n", row["digits"], "12", "", "9999"):
            assert task.reward(prompt, completion) == pytest.approx(rubric(prompt.text, completion))
    assert task.reward(prompts[0], prompts[0].answer) == 1.0  # the metric does not count
    import verifiers.v1 as vf

    with pytest.raises(vf.TaskError, match="ValueError: the rubric exploded on purpose") as info:
        task.reward(prompts[0], "boom")
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_system_and_chat_prompts_become_one_user_text():
    """meshrl renders a prompt as one user message: the system prompt is its first
    paragraph; a chat prompt's messages are paragraphs. The rubric still sees
    the task's own messages."""
    from tests.support.vf_taskset import ReverseData, ReverseTask

    data = ReverseData(prompt="471>", system_prompt="Reverse the digits.", answer="174")
    assert prompt_text(data) == "Reverse the digits.\n\n471>"
    chat = ReverseData(
        prompt=[{"role": "user", "content": "Reverse."}, {"role": "user", "content": "471>"}],
        answer="174",
    )
    assert prompt_text(chat) == "Reverse.\n\n471>"
    for each in (data, chat):
        trace = build_trace(ReverseTask(each), "174")
        assert trace.last_reply == "174"
        assert [m.role for m in trace.messages][-1] == "assistant"


EXPORT = ["ReverseTaskset"]
RUNTIME_TASKSET = """
import verifiers.v1 as vf
from tests.support.vf_taskset import ReverseData, ReverseTask, ReverseTaskset

class InBox(ReverseTask):
    @vf.reward
    async def passes_tests(self, trace, runtime) -> float:
        return 1.0

class InBoxTaskset(vf.Taskset[InBox, vf.TasksetConfig]):
    def load(self):
        for task in ReverseTaskset(self.config).load():
            yield InBox(task.data, self.config.task)

__all__ = ["InBoxTaskset"]
"""


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, source, problem",
    [
        # verifiers' own resolution of a top-level id: lower case, '-' as '_'
        ("VF-Tmp-Reexport", f"from tests.support.vf_taskset import *\n__all__ = {EXPORT}", ""),
        ("vf_tmp_broken", "import not_installed_dependency", "does not import: ModuleNotFound"),
        ("vf_tmp_no_all", "x = 1", "defines no `__all__`"),
        # verifiers would skip the reward without a runtime: the reward would be partial
        ("vf_tmp_runtime", RUNTIME_TASKSET, "need a runtime (passes_tests)"),
    ],
)
def test_tasksets_meshrl_cannot_play_are_one_line(tmp_path, monkeypatch, name, source, problem):
    module = name.replace("-", "_").lower()
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = VerifiersTask.check_name(f"verifiers:{name}")
    assert (problem in line) if problem else line == ""
    assert "\n" not in line


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, fragment",
    [
        ("verifiers:no-such-taskset", "verifiers taskset 'no-such-taskset' not found"),
        ("verifiers:tests.no_such_module", "'tests.no_such_module' not found"),
    ],
)
def test_a_taskset_that_does_not_exist_is_one_config_line(name, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(GRPOConfig, DEFAULT_CONFIG, [f"task.name={name}"])
    message = str(info.value)
    assert message.startswith("config key 'task.name': ") and fragment in message
    assert "\n" not in message
    assert (
        VerifiersTask.check_name("verifiers:") == "name a verifiers taskset: verifiers:TASKSET_ID"
    )


@pytest.mark.unit
def test_without_the_extra_the_line_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # what a missing package raises
    problem = VerifiersTask.check_name("verifiers:some_taskset_not_loaded_yet")
    assert "pip install 'meshrl[verifiers]'" in problem
