"""Environments on real meshes: multi-turn tool episodes with their tokens masked,
a reward model beside the rule reward, and episodes that fail without stopping the
run."""

import math

import pytest
import torch

from tests.support.runs import grpo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def tiny_reward_model(path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from meshrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)


def test_tool_episodes_mask_the_tool_tokens_and_train(tmp_path, no_stray_procs):
    """GRPO on the calculator: every episode's token stream is the prompt, then the
    model's turns (loss mask 1) and the tool's replies (mask 0, exactly the reply
    text); the trainer's log-probs of the model's tokens, with the replies in
    context, equal the sampler's. A reward model scores beside the rule reward."""
    tiny_reward_model(tmp_path / "rm")
    algo, history = grpo(
        tmp_path,
        "grpo_calculator.yaml",
        f"reward_model.path={tmp_path / 'rm'}",
        "reward_model.weight=0.5",
        "generation.max_new_tokens=8",
        "warm_start.steps=0",
    )
    assert len(history) == 2
    tok = algo.tokenizer
    for episode in algo.last_episodes:
        assert not episode.failed and 1 <= episode.turns <= 4
        segments, start = [], 0
        for i in range(1, len(episode.tokens) + 1):
            if i == len(episode.tokens) or episode.loss_mask[i] != episode.loss_mask[start]:
                segments.append((episode.loss_mask[start], episode.tokens[start:i]))
                start = i
        model_turns = [ids for mask, ids in segments if mask == 1]
        replies = [tok.decode(ids) for mask, ids in segments if mask == 0]
        assert len(model_turns) == episode.turns
        assert replies == episode.replies and len(replies) in (episode.turns - 1, episode.turns)
        assert all(ids[-1] == tok.eos_token_id or len(ids) == 8 for ids in model_turns)
        assert all(v >= 0 for v, m in zip(episode.versions, episode.loss_mask, strict=True) if m)
    for record in history:
        assert record["tokens/environment"] > 0  # replies were in the batch...
        assert record["sampling/logprob_abs_diff"] < 1e-4  # ...and attended, not trained
        assert math.isfinite(record["train/loss"]) and record["samples/trained"] == 8
        assert record["reward/mean"] == pytest.approx(
            record["reward/rule_mean"] + 0.5 * record["reward/model_mean"], abs=1e-5
        )
        assert record["time/reward_model/score_s"] > 0


def test_failed_episodes_are_counted_and_their_groups_played_again(tmp_path, no_stray_procs):
    """The environment raises in one episode, hangs past the step timeout in another
    and returns garbage in a third: those groups are dropped and new prompts played;
    the run goes on with a full batch, and every sample is accounted for."""
    algo, history = grpo(
        tmp_path,
        "grpo_default.yaml",
        "task.name=tests.support.envs:Flaky",
        "task.step_timeout_s=1",
        "warm_start.steps=0",
    )
    first = history[0]
    assert first["episodes/failed"] == 3 and first["samples/dropped_env_failed"] >= 2
    for record in history:
        assert record["samples/trained"] == 8
        assert record["samples/generated_total"] == (
            record["samples/trained_total"] + record["samples/dropped_total"]
        )
    assert history[1].get("episodes/failed", 0) == 0


def test_a_failed_reward_is_contained_in_single_turn_scoring(tmp_path, no_stray_procs):
    _, history = grpo(
        tmp_path,
        "grpo_default.yaml",
        "steps=1",
        "task.name=tests.support.envs:FlakyScore",
        "warm_start.steps=0",
    )
    (record,) = history
    assert record["episodes/failed"] == 1 and record["samples/dropped_env_failed"] == 2
    assert record["samples/trained"] == 8
    assert record["samples/generated_total"] == 10 == record["samples/dropped_total"] + 8
