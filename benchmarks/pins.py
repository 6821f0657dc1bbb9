"""What a benchmark does not measure, pinned: held-out evaluation, checkpoints, the
sample log, metric sinks and console output are off, so that a change to a shipped
config (grpo_default.yaml evaluates held-out sets; its held-out step trained 3.8x
slower than the steps around it) cannot move a figure. A benchmark that measures one
of these sets it after `UNMEASURED` (the last value of a key wins). Warm start is
each benchmark's own choice: some need the answer format learnt, some measure none."""

UNMEASURED = (
    "eval.every=0",
    "checkpoint.every=0",
    "run.samples_every=0",
    "run.sinks=[]",
    "run.console_samples=0",
    "run.progress=false",
)


def grpo_config(*overrides: str):
    """grpo_default.yaml with `UNMEASURED`, then `overrides` (the last value of a key
    wins): a benchmark's GRPO config."""
    import os

    from algorithms.grpo import GRPOConfig
    from meshrl.config import load_config

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config(
        GRPOConfig, f"{repo}/algorithms/configs/grpo_default.yaml", [*UNMEASURED, *overrides]
    )


def run_grpo(run_dir: str, name: str, *overrides: str) -> list[dict]:
    """A quiet GRPO run of `grpo_config(*overrides)`; its history (no final model saved)."""
    from contextlib import redirect_stdout
    from io import StringIO

    from algorithms.grpo import GRPO

    cfg = grpo_config(*overrides, f"run.dir={run_dir}", f"run.name={name}", "run.save_final=false")
    with redirect_stdout(StringIO()):
        return GRPO(cfg).run()
