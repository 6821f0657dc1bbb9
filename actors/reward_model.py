"""Reward model: scores texts with a HF sequence-classification model.

Loaded by local path (`reward_model.path`, a `save_pretrained` directory with
its tokenizer); the score of a completion is the model's logit (its first
label) on the prompt followed by the completion. The controller weighs it
with the environment's rule reward (`reward_model.weight`, `rule_weight`).
"""

from __future__ import annotations

import torch
from monarch.actor import Actor, endpoint

from meshrl.model.models import device_for_this_proc
from meshrl.observe.telemetry import observed
from meshrl.procs.faults import Drillable


class RewardModel(Drillable, Actor):
    role = "reward_model"

    def __init__(self, path: str, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = device_for_this_proc()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    @endpoint
    @observed
    def score(self, texts: list[str]) -> list[float]:
        """The model's score (first logit) of each text."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True
            ).to(self.device)
            with torch.no_grad():
                logits = self.model(**batch).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores
