"""Vision-language RL on real meshes: images in prompts go through the loop as tensors,
with the placeholders expanded once, across replicas, FSDP and LoRA, tools and pull."""

import os

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from algorithms.grpo import GRPO
from meshrl.model.generation import sample
from meshrl.model.models import load_model
from meshrl.model.tokenizer import load_processor
from meshrl.model.vision import VisionFormat
from meshrl.types import TrainBatch
from tests.support.runs import configure
from tests.support.vision import QWEN, TEMPLATE, VISION_CONFIG, left_padded


def vision_run(tmp_path, name: str, *overrides: str):
    """A run of the tiny vision model named `name`, 4 prompts a step, the trainer
    computing its own old log-probs (each step measures the sampler's against them),
    then `overrides`."""
    return configure(
        tmp_path,
        name,
        "prompts_per_step=4",
        "trainer.recompute_old_logprobs=true",
        *overrides,
        path=VISION_CONFIG,
    )


def assert_sampler_agrees(history: list[dict]) -> None:
    """Every step's sampler log-probs are the trainer's, to float rounding."""
    assert all(r["sampling/sampler_logprob_max_abs_diff"] < 1e-4 for r in history)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_images_go_through_the_loop_on_real_meshes(tmp_path, no_stray_procs):
    """Two policy replicas (the pixels split and concatenated with the rows), the
    trainer's own old log-probs measured against the sampler's every step."""
    cfg = vision_run(
        tmp_path,
        "vision",
        "steps=3",
        "warm_start.steps=2",
        "placement.policy=2",
        "eval.every=2",
        "eval.sets.heldout.prompts=4",
        "eval.sets.heldout.k=2",
    )
    algo = GRPO(cfg)
    try:
        history = algo.run(3)
        assert_sampler_agrees(history)
        assert "eval/heldout/reward" in history[1]
        # The held-out set is generated from its pictures too.
        image = algo.tokenizer.convert_tokens_to_ids("<image>")
        sent = algo.evaluator._send("heldout", algo.policy)
        assert all(a[3] is not None and image in a[0][0] for a in sent[1])
        rewards, _ = algo.evaluator._score("heldout", *sent)
        assert len(rewards) == 4
        # The generator hands back the ids and pixels it generated from, element by
        # element; the trainer's log-probs of them are the sampler's.
        prompts = algo.collector.sample_prompts(2)
        ids, seeds, images = algo.collector.layout(prompts).shards[1]
        out = algo.policy.slice(procs=1).generate.call_one(ids, cfg.generation, seeds, images)
        out = out.get()
        assert [
            row[mask.bool()].tolist()
            for row, mask in zip(out.prompt_ids, out.prompt_mask, strict=True)
        ] == ids
        assert torch.equal(out.images, images[0]) and torch.equal(out.image_counts, images[1])
        batch = TrainBatch.from_completions(out)
        trained = algo.trainer.logprobs.call_one(batch).get()
        assert ((trained - out.logprobs).abs() * out.completion_mask).max() < 1e-4
        # Weight sync covers the vision tower: every replica holds the trainer's bits.
        want = algo.trainer.parameters.call_one().get()
        assert any("vision_tower" in name for name in want)
        for i in range(2):
            got = algo.policy.slice(procs=i).parameters.call_one().get()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        algo.stop()  # writes final/
    finally:
        algo.close()
    final = os.path.join(algo.run_dir, "final")
    exported = AutoModelForImageTextToText.from_pretrained(final).eval()
    fmt = VisionFormat(AutoProcessor.from_pretrained(final), cfg.model.vision.max_pixels)
    assert fmt.prompts(prompts)[0][1] == ids[0]  # shard 1: the second prompt's group
    prompt_ids, prompt_mask = left_padded(ids, 0)
    tokens, _, _ = sample(
        exported,
        prompt_ids,
        prompt_mask,
        max_new_tokens=cfg.generation.max_new_tokens,
        eos_token_id=2,
        pad_token_id=0,
        seeds=torch.tensor(seeds),
        images=images[0],
        image_counts=images[1],
    )
    assert torch.equal(tokens, out.completion_ids[:, : tokens.size(1)])


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "overrides",
    [("placement.trainer=2", "placement.sharding=fsdp"), ("model.lora.rank=4",)],
    ids=["fsdp", "lora"],
)
def test_fsdp_and_lora_train_and_sync_the_vision_tower(overrides, tmp_path, no_stray_procs):
    """The vision tower trains (its FSDP shards; its LoRA adapters, merged) and
    reaches the replicas bit for bit."""
    cfg = vision_run(tmp_path, "vision", "steps=2", "warm_start.steps=0", *overrides)
    algo = GRPO(cfg)
    try:
        history = algo.run(2)
        want = algo.sup.call_all(algo.trainer, "parameters")[0]  # every rank: FSDP gathers
        got = algo.policy.slice(procs=0).parameters.call_one().get()
    finally:
        algo.close()
    assert_sampler_agrees(history)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    initial = dict(load_model(cfg.model, cfg.run.seed).named_parameters())
    tower = [k for k in want if "vision_tower" in k and "q_proj.weight" in k]
    assert tower and all(not torch.equal(want[k], initial[k]) for k in tower)
    embeddings = "model.language_model.embed_tokens.weight"  # LoRA leaves it as it was
    assert torch.equal(want[embeddings], initial[embeddings]) == ("model.lora.rank=4" in overrides)


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["llava", "qwen2_vl_chat_by_path"])
def test_a_tool_returns_a_picture_mid_episode(model, tmp_path, caplog, no_stray_procs):
    """`vision_zoom`: the tool's crop joins the episode as a second image; the
    trainer's log-probs of the turn after it are the sampler's (Qwen2-VL loaded
    by path with a chat template: at the M-RoPE positions of both pictures'
    grids, the crop in a tool message). A corrupt picture from the tool fails
    its episode, which is counted and replaced."""
    source = "model.arch=llava"
    if model != "llava":  # the tiny Qwen2-VL saved with a chat template
        processor = load_processor(QWEN)
        processor.chat_template = processor.tokenizer.chat_template = TEMPLATE
        load_model(QWEN).save_pretrained(tmp_path / "qwen")
        processor.save_pretrained(tmp_path / "qwen")
        source = f"model.path={tmp_path / 'qwen'}"
    cfg = vision_run(
        tmp_path,
        "zoom",
        "steps=2",
        "warm_start.steps=0",
        "task.name=tests.support.envs:BrokenZoom",
        source,
    )
    algo = GRPO(cfg)
    try:
        history = algo.run(2)
        episodes = algo.last_episodes
    finally:
        algo.close()
    assert_sampler_agrees(history)
    assert all(r["episodes/turns_mean"] == 2 for r in history)
    assert len(episodes) == 4 * 8 and all(len(e.images) == 2 for e in episodes)
    assert history[0]["episodes/failed"] == 1  # the one environment proc's first zoom
    assert "meshrl_corrupt_zoom.png" in caplog.text
    last = history[-1]
    assert last["samples/trained_total"] == 2 * 4 * 8


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_pictures_go_by_pull(tmp_path, no_stray_procs):
    """Work by pull: each group's pixels travel with it to whichever replica
    takes it, two groups a call, and come back with its completions."""
    pull = (
        "rollout.dispatch=pull",
        "rollout.groups_per_call=2",
        "placement.policy=2",
        "warm_start.steps=2",
        "steps=4",
        "checkpoint.every=2",
        "checkpoint.keep=1",
    )
    history = GRPO(vision_run(tmp_path, "pull", *pull)).run()
    assert_sampler_agrees(history)
    assert history[-1]["samples/trained_total"] == 4 * 4 * 8
    assert all(r["samples/dropped"] == 0 for r in history)
