"""Vision-language models without meshes: the sampler and the trainer see the same ids
and pixels; the embedded tiny VLMs save and load with transformers' auto classes;
models by path, chat templates with pictures, and bad images."""

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from algorithms.grpo import GRPOConfig
from meshrl.config import ModelConfig, VisionConfig, load_config
from meshrl.envs import make_task
from meshrl.envs.base import Step
from meshrl.envs.rollout import ChatFormat, EpisodeState, _reply
from meshrl.envs.vision import VisionCount
from meshrl.loop.collector import Collector
from meshrl.loop.state import LoopState
from meshrl.model import vision
from meshrl.model.generation import sample
from meshrl.model.models import completion_logprobs, completion_values, load_model, load_value_model
from meshrl.model.tokenizer import load_processor, load_tokenizer, vision_format
from meshrl.model.vision import ImageError, VisionFormat, stack
from meshrl.types import Prompt
from tests.support.vision import LLAVA, QWEN, QWEN3, QWEN25, TEMPLATE, VISION_CONFIG, left_padded


def _prompts(n: int, seed: int = 0) -> list[Prompt]:
    return [VisionCount(None).generate(random.Random(seed + i)) for i in range(n)]


def _generate(model, fmt, prompts, seeds, share_prefix=True):
    """Sample with `model` from `prompts` (ids and pixels by `fmt`): the tokens,
    their log-probs and mask, and the prompt ids, mask and pixels."""
    ids, pixels = fmt.prompts(prompts)
    prompt_ids, prompt_mask = left_padded(ids, fmt.processor.tokenizer.pad_token_id)
    images, counts = stack(pixels)
    tokens, logprobs, mask = sample(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=4,
        eos_token_id=2,
        pad_token_id=0,
        seeds=torch.tensor(seeds),
        share_prefix=share_prefix,
        images=images,
        image_counts=counts,
    )
    return tokens, logprobs, mask, prompt_ids, prompt_mask, images, counts


def _sampled_and_trained(model, fmt, prompts, seeds):
    """Sample from `prompts` and check that the trainer's log-probs of the rows are
    the sampler's (< 1e-4); the tokens, their log-probs and mask, and the pixels."""
    tokens, logprobs, mask, prompt_ids, prompt_mask, images, counts = _generate(
        model, fmt, prompts, seeds
    )
    with torch.no_grad():
        full = torch.cat([prompt_ids, tokens], 1)
        attention = torch.cat([prompt_mask, mask], 1)
        trained = completion_logprobs(
            model, full, attention, tokens.size(1), images=images, image_counts=counts
        )
    assert ((trained - logprobs).abs() * mask).max() < 1e-4
    return tokens, logprobs, mask, images


@pytest.mark.unit
@pytest.mark.parametrize(
    "arch", [LLAVA, QWEN, QWEN25, QWEN3], ids=["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
)
def test_the_sampler_and_the_trainer_agree_on_rows_with_images(arch):
    """Rows of one text with other pictures share no prefill; the trainer's
    forward over prompt + completion with the same pixels gives the sampler's
    log-probs (float32), and other pixels give other ones."""
    model, fmt = load_model(arch).eval(), vision_format(arch)
    prompts = [p for p in _prompts(3) for _ in range(2)]  # same text; 3 pictures, 2 rows each
    seeds = list(range(len(prompts)))
    shared = _generate(model, fmt, prompts, seeds)
    alone = _generate(model, fmt, prompts, seeds, share_prefix=False)
    assert torch.equal(shared[0], alone[0])
    tokens, logprobs, mask, prompt_ids, prompt_mask, images, counts = shared
    with torch.no_grad():
        full = torch.cat([prompt_ids, tokens], 1)
        attention = torch.cat([prompt_mask, mask], 1)
        T = tokens.size(1)
        trained = completion_logprobs(model, full, attention, T, images=images, image_counts=counts)
        other = completion_logprobs(
            model, full, attention, T, images=images.flip(0), image_counts=counts
        )
    assert ((trained - logprobs).abs() * mask).max() < 1e-4
    assert ((other - logprobs).abs() * mask).max() > 1e-3
    # PPO's critic sees the pictures too.
    critic = load_value_model(arch)
    torch.nn.init.normal_(critic.value_head.weight)
    with torch.no_grad():
        values = [
            completion_values(critic, full, attention, T, "padded", x, counts)
            for x in (images, images.flip(0))
        ]
    assert not torch.allclose(values[0], values[1])


@pytest.mark.unit
@pytest.mark.parametrize("arch", [LLAVA, QWEN], ids=["llava", "qwen2_vl"])
def test_pixels_made_on_the_cpu_go_to_the_models_device(arch):
    """The environment makes pixels on the CPU; the sampler and the trainer hand
    the model its image arguments on the model's device (an H200 run failed with
    CPU pixels into a CUDA patch embedding). The meta device stands in for a GPU."""
    fmt = vision_format(arch)
    _, pixels = fmt.prompts(_prompts(2))
    images, counts = stack(pixels)
    on = torch.device("meta")
    made = vision.inputs(images, counts, torch.bfloat16, on)
    assert made and all(v.device == on for v in made.values())
    assert made["pixel_values"].dtype == torch.bfloat16
    assert all(v.device.type == "cpu" for v in vision.inputs(images, counts).values())


@pytest.mark.unit
@pytest.mark.parametrize(
    "arch, processor_class, tower",
    [
        (LLAVA, "LlavaProcessor", ("vision_tower", "multi_modal_projector")),
        (QWEN, "Qwen2VLProcessor", ("visual",)),
        (QWEN25, "Qwen2_5_VLProcessor", ("visual",)),
        (QWEN3, "Qwen3VLProcessor", ("visual",)),
    ],
    ids=["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
)
def test_the_embedded_vlm_round_trips_through_transformers_auto_classes(
    arch, processor_class, tower, tmp_path
):
    model, processor = load_model(arch), load_processor(arch)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    fmt, saved = vision_format(arch), vision_format(ModelConfig(path=str(tmp_path)))
    prompts = _prompts(2)
    (ids, pixels), (ids2, pixels2) = fmt.prompts(prompts), saved.prompts(prompts)
    assert ids == ids2 and all(torch.equal(a, b) for a, b in zip(pixels, pixels2, strict=True))
    # (Qwen2-VL's AutoProcessor also builds its video processor, which needs torchvision.)
    with open(tmp_path / "processor_config.json") as f:
        assert json.load(f)["processor_class"] == processor_class
    got = _generate(loaded.eval(), saved, prompts, [1, 2])
    want = _generate(model.eval(), fmt, prompts, [1, 2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Whether the vision tower trains is a config key.
    frozen = load_model(replace(arch, vision=VisionConfig(train=False)))
    still = {n for n, p in frozen.named_parameters() if not p.requires_grad}
    assert still and all(any(part in n for part in tower) for n in still)


@pytest.mark.unit
@pytest.mark.parametrize("arch", [QWEN, QWEN25, QWEN3], ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_positions_are_the_models_own_from_the_image_grids(arch):
    """M-RoPE: an image's tokens take its grid's rows and columns, and the text
    after it goes on from the largest. The positions meshrl computes (padded,
    prefilled, decoded) give the log-probs of HF's own forward of each row
    alone, and plain positions give others."""
    model, fmt = load_model(arch).eval(), vision_format(arch)
    prompts = [
        Prompt("Red?", "1", images=[np.full((32, 32, 3), 9 * i, np.uint8)]) for i in range(2)
    ]
    prompts.append(_prompts(1)[0])  # another text length: left padding
    tokens, logprobs, mask, prompt_ids, prompt_mask, images, counts = _generate(
        model, fmt, prompts, [3, 4, 5]
    )
    assert images.shape[1:] == (1, 1 + 16, 3 * 2 * 8 * 8)  # (grid row, 4 x 4 patches)
    ids, pixels = fmt.prompts(prompts)
    for row in range(len(prompts)):
        T = int(mask[row].sum())
        full = torch.tensor([ids[row] + tokens[row, :T].tolist()])
        inputs = vision.inputs(pixels[row][None], torch.tensor([1]))
        kinds = (full == model.config.image_token_id).int()
        with torch.no_grad():
            own = model(input_ids=full, mm_token_type_ids=kinds, **inputs).logits
            plain = model(input_ids=full, position_ids=torch.arange(full.size(1))[None], **inputs)
        want, other = (
            _picked(x[0, -T - 1 : -1], full[0, -T:], model.config) for x in (own, plain.logits)
        )
        assert (want - logprobs[row, :T]).abs().max() < 1e-4, row  # measured 5e-7
        assert (other - want).abs().max() > 1e-4, row  # measured 7e-4 to 1e-3


def _picked(logits: torch.Tensor, tokens: torch.Tensor, config) -> torch.Tensor:
    """Log-probs of `tokens` without the image placeholders, as the sampler draws."""
    logits = logits.clone()
    logits[:, vision.placeholder_ids(config)] = -float("inf")
    return logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


TINY_TOWER = dict(
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
"""The vision tower of the tiny checkpoints saved below (32-px pictures, 16 patches)."""


def _save_tiny_gemma3(path) -> None:
    """A tiny Gemma 3 (SigLIP tower, 4 image tokens a picture) and its processor,
    saved as a checkpoint to load by `model.path`."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from meshrl.model.models import embedded_config
    from meshrl.model.tokenizer import build_char_tokenizer

    chars = build_char_tokenizer()
    tokens = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=chars.backend_tokenizer,
        pad_token=chars.pad_token,
        bos_token=chars.bos_token,
        eos_token=chars.eos_token,
        padding_side="left",
        extra_special_tokens=tokens,
    )
    images = Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    text = embedded_config(ModelConfig(arch="gemma3"), len(tokenizer), pad_token_id=0)
    text.layer_types = ["full_attention", "full_attention"]  # completions see the picture
    tower = SiglipVisionConfig(**TINY_TOWER)
    config = Gemma3Config(
        text_config=text,
        vision_config=tower,
        mm_tokens_per_image=4,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4
    ).save_pretrained(path)


def _save_tiny_llava_next(path) -> None:
    """A tiny LLaVA-NeXT (the tiny LLaVA's tower and LM, any-resolution tiles of
    32 px) and its processor, saved as a checkpoint to load by `model.path`."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next import image_processing_pil_llava_next as next_images

    from meshrl.model.models import embedded_config

    tokenizer, pins = load_tokenizer(LLAVA), [[32, 32], [32, 64], [64, 32]]
    images = next_images.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=pins,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    text = embedded_config(ModelConfig(arch="llama"), len(tokenizer), pad_token_id=0)
    tower = CLIPVisionConfig(**TINY_TOWER)
    config = LlavaNextConfig(
        text_config=text,
        vision_config=tower,
        image_grid_pinpoints=pins,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(config).save_pretrained(path)
    LlavaNextProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        image_token="<image>",
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    ).save_pretrained(path)


@pytest.mark.unit
def test_llava_next_by_path_takes_pictures_of_any_size_in_tiles(tmp_path):
    """LLaVA-NeXT cuts each picture into tiles by its size: rows of three sizes
    (other token counts, other tile counts, padded) give the sampler HF's own
    log-probs of each row alone, and the trainer the sampler's."""
    _save_tiny_llava_next(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    model, fmt = load_model(cfg).eval(), vision_format(cfg)
    sides = [(32, 32), (32, 64), (64, 32)]
    prompts = [
        Prompt("Red?", "1", images=[np.full((h, w, 3), 50 * i, np.uint8)])
        for i, (h, w) in enumerate(sides)
    ]
    tokens, logprobs, mask, images = _sampled_and_trained(model, fmt, prompts, [4, 5, 6])
    assert images.shape[2] == 1 + 3  # (the size, then up to 3 tiles)
    for row, prompt in enumerate(prompts):  # the processor's own output for the row
        raw = fmt.processor(
            text=[fmt.text(prompt.text, 1)], images=prompt.images, return_tensors="pt"
        )
        assert raw["image_sizes"].tolist() == [list(sides[row])]
        n = int(mask[row].sum())
        alone = torch.cat([raw["input_ids"], tokens[row : row + 1, :n]], 1)
        with torch.no_grad():
            own = model(
                input_ids=alone, pixel_values=raw["pixel_values"], image_sizes=raw["image_sizes"]
            )
        want = _picked(own.logits[0, -n - 1 : -1], alone[0, -n:], model.config)
        assert (want - logprobs[row, :n]).abs().max() < 1e-4, row


@pytest.mark.unit
def test_gemma3_by_path_attends_both_ways_within_a_picture(tmp_path):
    """Gemma 3's image tokens attend to each other both ways (`token_type_ids`, which
    meshrl derives from the ids): the sampler's log-probs equal HF's own forward of
    each row alone with the processor's token types, and the trainer's equal the
    sampler's; causal attention within the picture gives others."""
    _save_tiny_gemma3(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    model, fmt = load_model(cfg).eval(), vision_format(cfg)
    prompts = _prompts(3)
    tokens, logprobs, mask, _ = _sampled_and_trained(model, fmt, prompts, [1, 2, 3])
    ids, pixels = fmt.prompts(prompts)
    for row in range(len(prompts)):
        n = int(mask[row].sum())
        alone = torch.tensor([ids[row] + tokens[row, :n].tolist()])
        types = (alone == model.config.image_token_id).long()
        with torch.no_grad():
            own = model(input_ids=alone, pixel_values=pixels[row], token_type_ids=types).logits
            causal = model(input_ids=alone, pixel_values=pixels[row]).logits
        want, other = (
            _picked(x[0, -n - 1 : -1], alone[0, -n:], model.config) for x in (own, causal)
        )
        assert (want - logprobs[row, :n]).abs().max() < 1e-5, row  # measured 5e-7
        assert (other - want).abs().max() > 1e-4, row  # measured 1.7e-4 to 2.4e-4


@pytest.mark.unit
def test_a_tools_picture_goes_through_the_chat_template():
    """With a chat template the tool's picture is part of a tool message: the
    episode's ids are the processor's own rendering of the whole conversation,
    pictures expanded in place, and its pixels are those of both pictures."""
    processor = load_processor(QWEN)
    processor.chat_template = processor.tokenizer.chat_template = TEMPLATE
    fmt, chat = VisionFormat(processor, 10**6), ChatFormat(processor.tokenizer)
    prompt = _prompts(1)[0]
    crop = np.full((32, 32, 3), 200, np.uint8)
    ids, pixels = fmt.prompts([prompt])
    turn = processor.tokenizer("top left", add_special_tokens=False).input_ids
    episode = EpisodeState("e", prompt, ids[0], tokens=list(turn), last_turn=turn)
    reply, shown = _reply(chat, fmt, Step("Zoomed:", done=False, images=[crop]), episode)
    user = [{"type": "image"}, {"type": "text", "text": prompt.text}]
    conversation = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "top left"},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "Zoomed:"}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    whole = processor(text=[text], images=[prompt.images[0], crop], return_tensors="pt")
    assert ids[0] + turn + reply == whole["input_ids"][0].tolist()
    assert torch.equal(torch.cat([pixels[0], torch.stack(shown)]), fmt._pixels(whole))


@pytest.mark.unit
def test_bad_images_and_mismatched_models_get_one_line(tmp_path):
    fmt = VisionFormat(load_processor(LLAVA), max_pixels=64 * 64)
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageError, match="broken.png"):
        fmt.prompts([Prompt("How many red?", "1", images=[str(corrupt)])])
    with pytest.raises(ImageError, match=r"100x100, more than model.vision.max_pixels=4096"):
        fmt.prompts([Prompt("x", "1", images=[np.zeros((100, 100, 3), dtype=np.uint8)])])
    # Images for a text-only model: one line naming the keys that pick the model.
    cfg = load_config(GRPOConfig, VISION_CONFIG, ["model.arch=llama"])
    task = make_task(cfg.task)
    collector = Collector(
        cfg,
        LoopState(),
        None,
        None,
        load_tokenizer(cfg.model),
        task,
        256,
        None,
        None,
        vision=vision_format(cfg.model),
    )
    with pytest.raises(ImageError, match="model.arch' to llava or 'model.path'"):
        collector.sample_prompts(2)
    # A processor of another model: the tiny VLM saved beside a 64px processor.
    load_model(LLAVA).save_pretrained(tmp_path / "vlm")
    load_processor(replace(LLAVA, vision=VisionConfig(image_size=64))).save_pretrained(
        tmp_path / "vlm"
    )
    with pytest.raises(ImageError, match=r"'model.path'.*64px images.*32px"):
        vision_format(ModelConfig(path=str(tmp_path / "vlm")))
    # Qwen2-VL beside a processor of another patch size.
    load_model(QWEN).save_pretrained(tmp_path / "qwen")
    load_processor(replace(QWEN, vision=VisionConfig(patch_size=4))).save_pretrained(
        tmp_path / "qwen"
    )
    with pytest.raises(ImageError, match=r"'model.path'.*patch_size is 4.*patch_size is 8"):
        vision_format(ModelConfig(path=str(tmp_path / "qwen")))
    # A processor that gives more than pixels (LLaVA-NeXT's image sizes).
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next import image_processing_pil_llava_next as next_images

    tiles = next_images.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=[[32, 32], [32, 64]],
    )
    anyres = LlavaNextProcessor(
        image_processor=tiles,
        tokenizer=load_tokenizer(LLAVA),
        patch_size=8,
        vision_feature_select_strategy="full",
        image_token="<image>",
    )
    with pytest.raises(ImageError, match=r"'model.path'.*also gives image_sizes, which meshrl"):
        vision.check_pair(anyres, load_model(LLAVA).config, "model.path")
    # An M-RoPE model not supported yet.
    from transformers import Glm4vConfig

    with pytest.raises(ImageError, match=r"'model.path': glm4v \(M-RoPE.*not supported yet"):
        vision.check_pair(load_processor(QWEN), Glm4vConfig(), "model.path")
    # A text model with a processor saved beside it.
    load_model(ModelConfig()).save_pretrained(tmp_path / "text")
    load_processor(LLAVA).save_pretrained(tmp_path / "text")
    with pytest.raises(ImageError, match="'model.path': a llama model takes no images"):
        vision_format(ModelConfig(path=str(tmp_path / "text")))
