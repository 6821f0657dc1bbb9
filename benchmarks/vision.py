"""What images cost a step: the embedded tiny LLaVA's trainer step and sampler
prefill with the pictures, against the same ids with the vision tower left out
(the image tokens then embed as plain tokens: the same sequence lengths, the
same language model work), in one process, on one GRPO batch of `grpo_vision.yaml`
(16 prompts x 8 rows, one 32x32 picture each). Also the processor's time for
the controller to expand the placeholders and make the pixels.

    python benchmarks/vision.py [--repeats 20]

Prints one JSON line: seconds per call, median of `--repeats`, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshrl.config import ModelConfig  # noqa: E402
from meshrl.envs.vision import VisionCount  # noqa: E402
from meshrl.model.generation import sample  # noqa: E402
from meshrl.model.models import completion_logprobs, load_model  # noqa: E402
from meshrl.model.tokenizer import vision_format
from meshrl.model.vision import stack  # noqa: E402


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="as a proc of the run gets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch="llava")
    model, fmt = load_model(cfg), vision_format(cfg)
    task, rng = VisionCount(None), random.Random(0)
    prompts = [p for p in (task.generate(rng) for _ in range(16)) for _ in range(8)]
    encode_s = median_s(lambda: fmt.prompts(prompts[::8]), args.repeats)
    ids, pixels = fmt.prompts(prompts)
    images, counts = stack(pixels)
    answer = torch.tensor(
        [[fmt.processor.tokenizer.convert_tokens_to_ids(p.answer), 2] for p in prompts]
    )
    full = torch.cat([torch.tensor(ids), answer], 1)
    mask = torch.ones_like(full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(with_images: bool) -> None:
        pictures = {"images": images, "image_counts": counts} if with_images else {}
        logprobs = completion_logprobs(model, full, mask, 2, **pictures)
        optimizer.zero_grad()
        (-logprobs.mean()).backward()
        optimizer.step()

    # Without pictures the 16 prompts' ids would all be equal and share one prefill;
    # a token of each group's own keeps 16 distinct prefills, as with the pictures.
    text_ids = torch.tensor(ids)
    text_ids[:, 1] = 3 + torch.arange(len(ids)) // 8

    def generate(with_images: bool) -> None:
        pictures = {"images": images, "image_counts": counts} if with_images else {}
        prompt = torch.tensor(ids) if with_images else text_ids
        sample(
            model.eval(),
            prompt,
            torch.ones_like(prompt),
            max_new_tokens=2,
            eos_token_id=2,
            pad_token_id=0,
            seeds=torch.arange(len(ids)),
            **pictures,
        )
        model.train()

    result = {
        "train_step_s_images": median_s(lambda: train(True), args.repeats),
        "train_step_s_no_vision_tower": median_s(lambda: train(False), args.repeats),
        "generate_s_images": median_s(lambda: generate(True), args.repeats),
        "generate_s_no_vision_tower": median_s(lambda: generate(False), args.repeats),
        "controller_encode_s_16_prompts": encode_s,
    }
    result["train_ratio"] = result["train_step_s_images"] / result["train_step_s_no_vision_tower"]
    result["generate_ratio"] = result["generate_s_images"] / result["generate_s_no_vision_tower"]
    result["pixels_mb_per_batch"] = images.numel() * images.element_size() / 1e6
    result["rows"], result["tokens_per_row"] = len(ids), full.size(1)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
