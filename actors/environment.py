"""Environment: scores completions of the task's prompts with verifiable rewards."""

from __future__ import annotations

from monarch.actor import Actor, endpoint

from meshrl.config import ModelConfig, TaskConfig
from meshrl.envs import make_task
from meshrl.faults import Drillable
from meshrl.models import load_tokenizer
from meshrl.types import Prompt


class Environment(Drillable, Actor):
    def __init__(self, task_cfg: TaskConfig, model_cfg: ModelConfig):
        self.task = make_task(task_cfg)
        self.tokenizer = load_tokenizer(model_cfg)

    @endpoint
    def score(self, prompts: list[Prompt], completion_ids: list[list[int]]) -> list[float]:
        """Reward in [0, 1] of each completion (token ids, EOS excluded by decoding)."""
        self.drill("score")
        if not completion_ids:
            return []
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [self.task.reward(p, t) for p, t in zip(prompts, texts, strict=True)]
