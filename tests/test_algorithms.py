"""Every shipped algorithm end to end on real meshes: each learns its task from
its shipped config (DPO from the command line, the on-policy ones from Python,
where they reuse the suite's procs), each runs from Python with more procs per
role, and a one-hook GRPO subclass is used."""

import json
import math
import os
import re
import subprocess

import pytest
import torch

from algorithms.dapo import DAPO, DAPOConfig
from algorithms.dpo import DPO, DPOConfig
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from algorithms.rloo import RLOO
from meshrl.config import load_config
from meshrl.procs import zygote
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

CONFIGS = os.path.join(REPO, "algorithms", "configs")
QUIET = ["run.progress=false", "run.save_final=false"]


def run_cli(module, config, run_dir, *overrides, timeout=300):
    """The launch command from the config's header, writing to `run_dir`."""
    result = subprocess.run(
        zygote.python_m(
            module,
            "--config",
            os.path.join(CONFIGS, f"{config}.yaml"),
            *overrides,
            f"run.dir={run_dir}",
            "run.name=run",
            *QUIET,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


SHARED_PAGES = ("observability.md", "reliability.md", "environments.md")


def undocumented_metrics(records: list[dict], page: str) -> list[str]:
    """Keys logged in `records` that no metrics table names: the algorithm's page,
    grpo.md (the on-policy loop's shared table), or the shared pages. A table's
    `<name>` matches one path segment (`time/<role>/<endpoint>_s`)."""
    pages = {page, "algorithms/grpo.md"}
    patterns = []
    for name in sorted(pages) + list(SHARED_PAGES):
        with open(os.path.join(REPO, "docs", name)) as f:
            for line in f:
                if line.startswith("| `"):
                    for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                        parts = re.split(r"(<[^>]+>)", key)
                        regex = "".join(
                            "[^/]+" if p.startswith("<") else re.escape(p) for p in parts
                        )
                        patterns.append(re.compile(f"^{regex}$"))
    logged = {key for record in records for key in record}
    return sorted(k for k in logged if not any(p.match(k) for p in patterns))


def first_last(records, key="reward/mean", k=10):
    values = [r[key] for r in records if key in r]
    return sum(values[:k]) / k, sum(values[-k:]) / k


# Each on-policy algorithm, from its shipped config, for 120 steps: the reward
# starts at chance (~0.1) after the format-only warm-start and must climb. (The
# command line runs the same object: test_e2e.py runs it as a user would.)
LEARNERS = {
    "rloo": (RLOO, GRPOConfig),
    "reinforce_pp": (ReinforcePP, ReinforcePPConfig),
    "dr_grpo": (GRPO, GRPOConfig),
    "dapo": (DAPO, DAPOConfig),
    "gspo": (GRPO, GRPOConfig),
    "ppo": (PPO, PPOConfig),
}


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_algorithm_learns_from_its_shipped_config(name, tmp_path, no_stray_procs):
    cls, schema = LEARNERS[name]
    steps = 120
    overrides = [f"steps={steps}", f"run.dir={tmp_path}", "run.name=run", *QUIET]
    records = cls(load_config(schema, os.path.join(CONFIGS, f"{name}.yaml"), overrides)).run()
    assert [r["step"] for r in records] == list(range(steps))
    assert not undocumented_metrics(records, f"algorithms/{name}.md")
    first, last = first_last(records)
    assert first < 0.25 and last - first >= 0.3, (first, last)
    if name == "ppo":
        # The critic starts from nothing and fits the returns as the policy's reward
        # settles (measured over steps 80-119: explained variance 0.13; ~0.5 by step
        # 200); test_actors.py checks that value steps fit fixed returns.
        ev = [r["value/explained_variance"] for r in records[-40:]]
        assert all(math.isfinite(v) for v in ev) and sum(ev) / len(ev) > 0.05, ev
        assert all(r["value/grad_norm"] > 0 for r in records)  # the critic trains every step
        assert all(r["policy/kl_ref"] >= -1e-6 for r in records[1:])
    if name == "dapo":
        assert sum(r["dapo/groups_zero_variance"] for r in records) > 0
        assert all(r["dapo/groups_sampled"] >= 16 for r in records)
    if name == "reinforce_pp":
        assert records[-1]["policy/kl_ref"] > 0  # the reference runs; its KL is in the reward
    if name in ("dapo", "gspo"):  # two minibatches: the second one is off-policy
        assert max(r["policy/clip_fraction"] for r in records) > 0


def test_dpo_held_out_accuracy_rises(tmp_path, no_stray_procs):
    records = run_cli("algorithms.dpo", "dpo", tmp_path)
    assert records[0]["eval/accuracy_before"] == 0.5  # policy == reference: all ties
    accuracies = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(accuracies) == 200 // 25
    assert accuracies[-1] >= 0.75, accuracies
    assert records[-1]["rewards/margin"] > 0


# From Python, with more procs per role than the CLI runs use.
CALCULATOR = [
    "task.name=calculator",
    f"task.dataset={REPO}/meshrl/envs/data/calculator.jsonl",
    "task.max_turns=3",
    "model.max_positions=512",
    "generation.max_new_tokens=8",
]
PYTHON_RUNS = [
    (GRPO, GRPOConfig, "gspo", ["placement.trainer=2", "minibatches=2"]),
    # With a held-out set evaluated every step: 6 prompts x 3 samples over 2 replicas.
    (
        RLOO,
        GRPOConfig,
        "rloo",
        [
            "placement.policy=2",
            "eval.every=1",
            "eval.sets.heldout.prompts=6",
            "eval.sets.heldout.k=3",
        ],
    ),
    (ReinforcePP, ReinforcePPConfig, "reinforce_pp", ["placement.reference=2"]),
    # With the held-out set on an eval mesh of its own, every step.
    (
        DAPO,
        DAPOConfig,
        "dapo",
        [
            "placement.environment=2",
            "eval.every=1",
            "eval.mesh=true",
            "eval.sets.heldout.prompts=4",
            "eval.sets.heldout.k=2",
        ],
    ),
    # PPO on the multi-turn calculator: GAE over the model's tokens, the tool's masked;
    # a held-out set of whole episodes evaluated after the last step.
    (
        PPO,
        PPOConfig,
        "ppo",
        [
            "placement.critic=2",
            "placement.trainer=2",
            *CALCULATOR,
            "eval.every=3",
            "eval.sets.tools.prompts=4",
            "eval.sets.tools.k=2",
        ],
    ),
    # 3 reference procs for 64 rows: blocks of 22, 21, 21.
    (
        DPO,
        DPOConfig,
        "dpo",
        ["placement.trainer=2", "placement.reference=3", "eval.every=2", "warm_start.steps=1"],
    ),
]


@pytest.mark.parametrize(
    "cls, schema, config, overrides", PYTHON_RUNS, ids=[run[2] for run in PYTHON_RUNS]
)
def test_algorithm_runs_from_python(cls, schema, config, overrides, tmp_path, no_stray_procs):
    cfg = load_config(
        schema,
        os.path.join(CONFIGS, f"{config}.yaml"),
        ["steps=3", f"run.dir={tmp_path}", "run.name=py", *QUIET, *overrides]
        + ([] if cls is DPO else ["warm_start.steps=1"]),
    )
    history = cls(cfg).run()
    assert [r["step"] for r in history] == [0, 1, 2]
    page = "algorithms/dpo.md" if cls is DPO else f"algorithms/{config}.md"
    assert not undocumented_metrics(history, page)
    for record in history:
        assert all(isinstance(v, int | str) or math.isfinite(v) for v in record.values()), record
        if cls is DAPO and record["step"]:  # the eval mesh's figures come a step later
            last = record["step"] == len(history) - 1  # ... but the last step's wait for it
            assert record["eval/step"] == (record["step"] if last else record["step"] - 1)
            assert 0 <= record["eval/heldout/pass@1"] <= record["eval/heldout/pass@2"] <= 1
        if cls is RLOO:  # the held-out set, every step: pass@1 <= pass@3, both in [0, 1]
            assert 0 <= record["eval/heldout/pass@1"] <= record["eval/heldout/pass@3"] <= 1
            assert 0 <= record["eval/heldout/reward"] <= 1
        if cls is PPO and record["step"] == 2:  # the held-out episodes, scored
            assert 0 <= record["eval/tools/pass@1"] <= record["eval/tools/pass@2"] <= 1
        if cls is PPO:  # the replies were in the batch, attended, and the critic trained
            assert record["tokens/environment"] > 0 and record["episodes/turns_mean"] >= 1
            assert record["sampling/logprob_abs_diff"] < 1e-4 and record["value/grad_norm"] > 0


class ZeroAdvantageGRPO(GRPO):
    """The hook a variant overrides: every completion gets advantage 0."""

    calls = 0

    def compute_advantages(self, rewards, batch):
        ZeroAdvantageGRPO.calls += 1
        return torch.zeros_like(rewards)


def test_a_subclass_overriding_one_hook_is_what_runs(tmp_path, no_stray_procs):
    cfg = load_config(
        GRPOConfig,
        os.path.join(CONFIGS, "grpo_default.yaml"),
        ["steps=4", "warm_start.steps=0", f"run.dir={tmp_path}", *QUIET],
    )
    cfg.run.name = "base"
    base = GRPO(cfg).run()
    cfg.run.name = "zero"
    zero = ZeroAdvantageGRPO(cfg).run()
    assert ZeroAdvantageGRPO.calls == 4
    # Zero advantages zero the policy gradient on the trainer procs; GRPO's do not.
    assert all(r["train/grad_norm"] == 0 for r in zero)
    assert all(r["train/grad_norm"] > 0 for r in base)
