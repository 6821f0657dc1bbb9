"""A verifiers taskset for the adapter's tests (`task.name=verifiers:tests.support.vf_taskset`):
reverse three digits (`471>` -> `174`), the rows from the local dataset
vf_taskset.jsonl beside this file, the rubric two weighted rewards
(per-position credit and the exact answer) and a metric, which does not count.
The reply `boom` makes the rubric raise, on purpose."""

from __future__ import annotations

import json
import os

import verifiers.v1 as vf

ROWS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vf_taskset.jsonl")


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=0.75)
    async def positions(self, trace: vf.Trace) -> float:
        reply, answer = trace.last_reply, self.data.answer
        if reply == "boom":
            raise ValueError("the rubric exploded on purpose")
        longest = max(len(reply), len(answer))
        return sum(a == b for a, b in zip(reply, answer, strict=False)) / longest

    @vf.reward(weight=0.25)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        with open(ROWS) as f:
            for line in f:
                row = json.loads(line)
                data = ReverseData(id=row["id"], prompt=f"{row['digits']}>", answer=row["answer"])
                yield ReverseTask(data, self.config.task)


__all__ = ["ReverseTaskset"]
