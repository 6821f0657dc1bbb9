"""Run directory, metric recording and the console view of a run.

`RunLogger` appends one JSON object per step to `metrics.jsonl`, shows a
progress bar (step, reward, step time), draws `reward.png` at the end and
prints a short summary.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any


def make_run_dir(base: str, name: str, default_prefix: str) -> str:
    """Create `base/name` (or `base/<prefix>-<timestamp>`); never reuse a run's files."""
    if not name:
        name = f"{default_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = os.path.join(base, name)
    if os.path.exists(os.path.join(path, "metrics.jsonl")):
        raise FileExistsError(f"run directory {path} already holds a run; pick another run.name")
    os.makedirs(path, exist_ok=True)
    return path


class RunLogger:
    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        progress: bool = True,
        desc: str = "grpo",
        headline: str = "reward/mean",
        first_step: int = 0,
        sinks: tuple[str, ...] = (),
    ):
        """`headline` is the metric the bar, the plot and the summary show. With
        `first_step` > 0 (a resumed run) the records of earlier steps are kept
        and those of later steps, written before the interruption, dropped."""
        self.run_dir = run_dir
        self.headline = headline
        self.history: list[dict[str, Any]] = []
        self._bar = None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.samples_path = os.path.join(run_dir, "samples.jsonl")
        if first_step and os.path.exists(self.path):
            with open(self.path) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
        self._file = open(self.path, "a")  # noqa: SIM115
        self.sinks = [SINKS[name](run_dir) for name in sinks]
        if first_step:
            self.rewind(first_step)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=first_step,
                desc=desc,
                unit="step",
                file=sys.stdout,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def log(self, metrics: dict[str, Any]) -> None:
        record = {k: _plain(v) for k, v in metrics.items()}
        self.history.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.log(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                **{self.headline.split("/")[-1]: f"{record.get(self.headline, float('nan')):.3f}"},
                step_s=f"{record.get('time/step_s', float('nan')):.2f}",
                refresh=False,
            )

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append one step's sample rows (prompt, completion, reward, ...) to
        samples.jsonl, one JSON object per row with its step."""
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

    def rewind(self, step: int) -> None:
        """Forget the records of `step` and later (a run going back to a checkpoint)."""
        if os.path.exists(self.samples_path):
            with open(self.samples_path) as f:
                kept = [line for line in f if json.loads(line)["step"] < step]
            with open(self.samples_path, "w") as f:
                f.writelines(kept)
        self.history = [r for r in self.history if r.get("step", 0) < step]
        for sink in self.sinks:
            sink.rewind(step)
        self._file.close()
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.history)
        os.replace(self.path + ".tmp", self.path)
        self._file = open(self.path, "a")  # noqa: SIM115
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self._file.closed:
            self._file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.history if key in r]

    def plot_reward(self, filename: str = "reward.png") -> str | None:
        rewards = self.series(self.headline)
        if not rewards:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history if self.headline in r]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, rewards, lw=1, alpha=0.5, label=self.headline)
        window = max(1, len(rewards) // 20)
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1])
            / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({window})")
        ax.set_xlabel("step")
        ax.set_ylabel(self.headline)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        path = os.path.join(self.run_dir, filename)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def summary(self) -> str:
        rewards = self.series(self.headline)
        steps = self.series("time/step_s") or [0.0]
        if not rewards:
            return "no steps recorded"
        k = min(10, max(1, len(rewards) // 2))
        first, last = rewards[:k], rewards[-k:]
        return (
            f"{len(self.history)} steps | {self.headline} first-{k} mean {sum(first) / len(first):.3f} -> "
            f"last-{k} mean {sum(last) / len(last):.3f} | mean step {sum(steps) / len(steps):.3f}s | "
            f"run dir {self.run_dir}"
        )


class TensorBoardSink:
    """Every numeric metric as a scalar at its step, in `<run dir>/tensorboard`."""

    def __init__(self, run_dir: str):
        self.dir = os.path.join(run_dir, "tensorboard")
        self.writer = self._open(None)

    def _open(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.dir, purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def rewind(self, step: int) -> None:
        """Events at `step` and later are dropped (TensorBoard's purge_step)."""
        self.writer.close()
        self.writer = self._open(step)

    def close(self) -> None:
        self.writer.close()


SINKS = {"tensorboard": TensorBoardSink}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN; keep it visible
    return value
