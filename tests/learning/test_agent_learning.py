"""An agent task whose agent is an unmodified framework, learned: GRPO lifts a
LangChain agent (`ChatOpenAI(...).bind_tools([calculator])`,
`tests.support.agent_frameworks.langchain`) to call its calculator, as the built-in
calculator learns to (tests/learning/test_environments.py)."""

import json

import pytest

from tests.support import agent_frameworks as frameworks

pytestmark = [pytest.mark.learning, pytest.mark.timeout(300)]


def test_grpo_lifts_a_langchain_agent_to_call_its_calculator(tmp_path, no_stray_procs):
    """A tiny model taught the LangChain agent's episodes on 16 multiplications
    (`teach_some_calls`: each call whole, but a quarter of the taught openings a
    call, about a third of the episodes at the run's temperature 0.7; a guess,
    nearly always wrong, in the rest), then 8 GRPO steps of 8 prompts x 8
    episodes, each played by LangChain through the endpoint: the share
    of episodes whose framework ran the calculator and the mean reward both climb,
    from the first 2 steps to the last 4. Measured on 2026-12-05 (2 loaded cores,
    about 60 s a run, teaching included), with the teaching seed and run.seed both
    0, 1, 2 and 3 (the test runs 0): calls 0.32/0.40/0.38/0.41 to 0.90/0.89/0.84/0.91,
    reward 0.32/0.40/0.38/0.41 to 0.83/0.78/0.54/0.82. The reward dips at times
    late in a run (a question's memorized answer disturbed: seed 2's last 4 steps
    0.50, 0.41, 0.52, 0.73), hence its smaller margin: at lr 5e-4 or temperature
    1 the answers broke more often (seed 2's reward fell to 0.23 at the last step)."""
    from algorithms.grpo import GRPO
    from tests.support.runs import QUIET, configure

    questions = frameworks.multiplications(16, seed=1)
    model = frameworks.teach_some_calls(tmp_path, questions, share=0.25, steps=300)
    dataset = tmp_path / "questions.jsonl"
    rows = [{"prompt": q, "answer": a} for q, a in questions.items()]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shares: list[float] = []
    frameworks.TOOL_RUNS.clear()  # episode keys repeat between runs in one process
    frameworks.RECEIVED.clear()

    class Counted(GRPO):
        def after_step(self, step, metrics):  # the share of episodes that ran the calculator
            ran = [bool(frameworks.TOOL_RUNS.get(e.key)) for e in self.last_episodes]
            shares.append(sum(ran) / len(ran))
            super().after_step(step, metrics)

    cfg = configure(
        tmp_path,
        "learn",
        "steps=8",
        "prompts_per_step=8",
        "group_size=8",
        "optim.lr=2.5e-4",
        f"model.path={model}",
        "task.name=agent:tests.support.agent_frameworks:langchain",
        f"task.dataset={dataset}",
        "generation.max_new_tokens=96",
        "generation.temperature=0.7",
        "policy.tool_parser=hermes",
        "placement.threads_per_proc=1",
        "warm_start.steps=0",
        "eval.every=0",
        *QUIET,
    )
    history = Counted(cfg).run()
    rewards = [r["reward/mean"] for r in history]
    assert len(rewards) == len(shares) == 8

    def climb(values):
        return sum(values[-4:]) / 4 - sum(values[:2]) / 2

    assert climb(shares) > 0.3, shares  # measured 0.45 to 0.58
    assert climb(rewards) > 0.1, rewards  # measured 0.16 to 0.51
