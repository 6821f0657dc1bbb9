"""`make gpu-check`: every GPU path once, one JSON line of pass/fail and figures.

    python benchmarks/gpu_check.py              # on a CUDA host: the GPU paths
    python benchmarks/gpu_check.py --quick      # short horizons (what the suite runs on CPU)
    python benchmarks/gpu_check.py --only weight_sync,tree_layout

Each check runs on `cuda:0` where CUDA is available, else on the CPU (the suite
runs them there so that this script cannot rot). A check that needs what the
host lacks (a second GPU, vLLM, Monarch) says `skipped` and why; one that fails
says `error`. The last line printed is the JSON object:

    {"device": ..., "ok": true|false, "ran": [...], "skipped": [...],
     "checks": {name: {"ok": ..., <figures>}}}

The checks:
- `model`: a tiny Llama on the device samples with the KV-cache sampler; the
  trainer's recomputation of the same tokens agrees (max log-prob gap); one
  forward/backward/AdamW step is finite.
- `bf16`: bfloat16 parameters, and float32 parameters under bfloat16 autocast:
  a training step each, finite; the bf16 sampler's gap to the fp32 trainer.
- `weight_sync`: a publisher on the device writes the shared-memory slot, a
  replica on the device pulls it with checksums: bitwise equal; then a delta
  version where one tensor changed moves only that tensor's bytes.
- `routing_replay`: a tiny Qwen3-MoE sampler in bfloat16 records its experts, the
  float32 trainer replays them: no token runs other experts.
- `tree_layout`: the trainer's log-probs of G completions of one prompt, tree
  against padded, at a long completion: gap, step times and peak memory
  (`torch.cuda.max_memory_allocated`; the process's peak RSS on CPU).
- `distributed`: DDP and FSDP2 over NCCL (gloo on CPU), 2 ranks: one step each
  equals the 1-rank step (needs 2 GPUs, or the CPU).
- `vllm`: the vLLM engine samples with processed log-probs (needs vLLM and CUDA).
- `vision`: embedded Qwen2-VL and LLaVA models on the device sample from prompts
  with pictures (pixels made on the CPU, as the environment makes them) and the
  trainer recomputes the same tokens with the same pixels (max log-prob gap).
- `checkpoint`: a trainer's model and AdamW state saved from the device and
  loaded into another model on the device: bitwise equal, on the device.
- `grpo`: a short GRPO run on Monarch meshes (20 steps; `--quick`: 3), checkpointed
  half-way and exported at the end: its mean step time and tokens/s; then the run
  resumed from its checkpoint: whether it ends at the same weights (bitwise on
  CPU; a GPU's atomic adds may reorder sums, so there the difference is a figure)
  (needs Monarch).
- `continuous`: the running decode batch (`policy.continuous`) on the device: six
  calls' rows join it mid-decode and sample what they sample in a batch of their
  own; then the weights change three times under rows (partial rollouts) and each
  token's log-prob is its own version's, recomputed by the trainer.
- `partial`: a short GRPO run on Monarch meshes with pull dispatch, continuous
  batching and partial rollouts on 2 replicas and a long tail of lengths: every
  trained token counted by its version lag; step time, tokens/s, occupancy
  (needs Monarch).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from meshrl.config import ModelConfig  # noqa: E402
from meshrl.model.generation import sample  # noqa: E402
from meshrl.model.models import batch_logprobs, completion_logprobs, load_model  # noqa: E402
from meshrl.types import Completions, TrainBatch  # noqa: E402


class Skipped(Exception):
    """The host lacks what the check needs (the message says what)."""


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_memory(figures: dict, key: str):
    """The block's peak memory in MB: the GPU allocator's, else the process's RSS
    high-water mark (which only grows: a lower bound on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        figures[key] = torch.cuda.max_memory_allocated() / 2**20
    else:
        figures[key] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompts(batch: int, length: int, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (ids 5..39 of the char vocabulary)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 40, (batch, length), generator=generator)
    lengths = torch.randint(max(1, length // 2), length + 1, (batch,), generator=generator)
    mask = (torch.arange(length) >= length - lengths[:, None]).float()
    return ids.masked_fill(mask == 0, 0).to(on), mask.to(on)


def sampled(model, batch: int, length: int, new: int, **kwargs) -> Completions:
    ids, mask = prompts(batch, length, next(model.parameters()).device)
    stats: dict = {}
    tokens, logprobs, completion_mask = sample(
        model,
        ids,
        mask,
        max_new_tokens=new,
        eos_token_id=[2],
        pad_token_id=0,
        seeds=torch.arange(batch),
        stats=stats,
        **kwargs,
    )
    return Completions(ids, mask, tokens, completion_mask, logprobs, 0, routes=stats.get("routes"))


def trainer_logprobs(model, completions: Completions, layout: str = "padded", **kw):
    return batch_logprobs(model, TrainBatch.from_completions(completions), 1.0, layout, **kw)


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs() * mask).max())


def train_step(model, completions: Completions, optimizer=None) -> float:
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    logprobs = trainer_logprobs(model, completions)
    loss = -(logprobs * completions.completion_mask).sum() / completions.completion_mask.sum()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


# --- the checks -----------------------------------------------------------------------


def check_model(quick: bool) -> dict:
    on = device()
    model = load_model(ModelConfig(), seed=0).to(on).eval()
    started = time.perf_counter()
    completions = sampled(model, 16, 8, 16 if quick else 64)
    synchronize()
    sample_s = time.perf_counter() - started
    with torch.no_grad():
        recomputed = trainer_logprobs(model, completions)
    figures = {
        "logprob_gap": gap(recomputed, completions.logprobs, completions.completion_mask),
        "sample_s": sample_s,
        "loss": train_step(model.train(), completions),
    }
    assert figures["logprob_gap"] < 1e-4, figures
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return figures


def check_bf16(quick: bool) -> dict:
    on = device()
    fp32 = load_model(ModelConfig(), seed=0).to(on)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    completions = sampled(bf16.eval(), 16, 8, 16)
    with torch.no_grad():
        reference = trainer_logprobs(fp32.eval(), completions)
    figures = {
        "sampler_bf16_gap": gap(reference, completions.logprobs, completions.completion_mask),
        "bf16_loss": train_step(bf16.train(), completions),
    }
    with torch.autocast(on.type, dtype=torch.bfloat16):
        figures["autocast_loss"] = train_step(fp32.train(), completions)
    for name in ("bf16_loss", "autocast_loss"):
        assert torch.isfinite(torch.tensor(figures[name])), figures
    assert all(torch.isfinite(p).all() for m in (fp32, bf16) for p in m.parameters())
    return figures


def check_fp8(quick: bool) -> dict:
    """FP8 replicas (`policy.precision=fp8`): on a device with FP8 matmul each
    decoder linear layer runs `torch._scaled_mm`; its output against the same
    FP8 weights dequantized to bf16, and the sampler's log-probs against the
    fp32 and the bf16-mixed trainer's (the mismatch the correction sees)."""
    from meshrl.model.losses import mismatch_metrics
    from meshrl.weights.precision import (
        Fp8Linear,
        compute_precision,
        dequantize_blocks,
        fp8_matmul_available,
        to_precision,
    )

    on = device()
    figures: dict = {"fp8_matmul": fp8_matmul_available(on)}
    linear = torch.nn.Linear(256, 384).to(on)
    layer = Fp8Linear(linear)
    x = torch.randn(37, 256, device=on)
    got = layer(x).float()
    dense = torch.nn.functional.linear(
        x.to(torch.bfloat16), dequantize_blocks(layer.weight, layer.weight_scale), layer.bias
    ).float()
    figures["layer_rel_error"] = float((got - dense).norm() / dense.norm())
    assert figures["layer_rel_error"] < 0.1, figures  # activations quantized too (1 x 128)
    # A tensor-parallel replica's blocks (`Fp8Linear.split_tensor_parallel`): the
    # matmul of each block from where it starts on the scale grid, rows joined and
    # columns summed, against the whole layer's.
    from meshrl.weights.precision import _fp8_matmul

    flat = x.to(torch.bfloat16)
    rows = [
        _fp8_matmul(flat, layer.weight[a:b], layer.weight_scale, (a, 0))
        for a, b in ((0, 192), (192, 384))
    ]
    whole = _fp8_matmul(flat, layer.weight, layer.weight_scale)
    figures["split_rows_equal"] = bool(torch.equal(torch.cat(rows, 1), whole))
    cols = sum(
        _fp8_matmul(flat[:, a:b], layer.weight[:, a:b], layer.weight_scale, (0, a))
        for a, b in ((0, 96), (96, 256))
    )
    figures["split_cols_rel_error"] = float((cols - whole).norm() / whole.norm())
    assert figures["split_rows_equal"] and figures["split_cols_rel_error"] < 0.1, figures
    trainer = load_model(ModelConfig(), seed=0).to(on).eval()
    replica = to_precision(copy.deepcopy(trainer), "fp8").eval()
    started = time.perf_counter()
    completions = sampled(replica, 16, 8, 16 if quick else 64)
    synchronize()
    figures["sample_s"] = time.perf_counter() - started
    mask = completions.completion_mask
    for name, precision in (("fp32", "fp32"), ("bf16_mixed", "bf16-mixed")):
        with torch.no_grad(), compute_precision(precision, on):
            recomputed = trainer_logprobs(trainer, completions)
        m = mismatch_metrics(recomputed.float(), completions.logprobs.float(), mask)
        figures[f"k3_kl_vs_{name}"] = m["sampling/k3_kl"]
        figures[f"abs_dlogp_vs_{name}"] = m["sampling/sampler_logprob_abs_diff"]
        figures[f"off_band_vs_{name}"] = m["sampling/ratio_off_band"]
        assert m["sampling/sampler_logprob_abs_diff"] < 0.1, figures
    return figures


def check_mixed_precision(quick: bool) -> dict:
    """trainer.precision=bf16-mixed: float32 master weights, gradients and AdamW
    state; the step's gradient against float32's within the invariance test's
    bf16-mixed tolerance (2e-2)."""
    from meshrl.weights.precision import compute_precision

    on = device()
    fp32 = load_model(ModelConfig(), seed=0).to(on)
    completions = sampled(copy.deepcopy(fp32).eval(), 16, 8, 16)
    grads = {}
    for precision in ("fp32", "bf16-mixed"):
        model = copy.deepcopy(fp32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with compute_precision(precision, on):
            logprobs = trainer_logprobs(model, completions)
        loss = -(logprobs * completions.completion_mask).sum() / completions.completion_mask.sum()
        loss.backward()
        grads[precision] = torch.cat([p.grad.flatten() for p in model.parameters()])
        optimizer.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(
            t.dtype == torch.float32
            for s in optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.is_floating_point()
        )
    error = float((grads["bf16-mixed"] - grads["fp32"]).norm() / grads["fp32"].norm())
    assert 0 < error < 2e-2, error
    return {"grad_rel_error": error}


def check_weight_sync(quick: bool) -> dict:
    from meshrl.weights.publisher import WeightPublisher
    from meshrl.weights.receiver import WeightReceiver

    on = device()
    cfg = ModelConfig(hidden_size=256, intermediate_size=1024, num_layers=4)
    source, replica = load_model(cfg, seed=0).to(on), load_model(cfg, seed=1).to(on)
    publisher = WeightPublisher(source, rdma=False)
    receiver = WeightReceiver(replica)
    figures: dict = {}
    try:
        started = time.perf_counter()
        pulled = receiver.pull(publisher.publish(0, verify=True, delta=True))
        synchronize()
        figures["full_s"] = time.perf_counter() - started
        figures["full_bytes"] = pulled.bytes_moved
        pairs = zip(source.parameters(), replica.parameters(), strict=True)
        assert pulled.verified and all(torch.equal(a, b) for a, b in pairs)
        moving = dict(source.named_parameters())["model.layers.0.mlp.down_proj.weight"]
        for version in (1, 2):  # the second compares with a slot written from the device
            with torch.no_grad():
                moving.add_(1.0)
            pulled = receiver.pull(publisher.publish(version, verify=True, delta=True))
        figures["delta_bytes"] = pulled.bytes_moved
        assert (
            pulled.verified and pulled.bytes_moved <= moving.numel() * moving.element_size() + 128
        )
        pairs = zip(source.named_parameters(), replica.parameters(), strict=True)
        different = [name for (name, a), b in pairs if not torch.equal(a, b)]
        assert not different, f"after the delta pulls: {different}"
        assert all(p.device == on for p in replica.parameters())
    finally:
        receiver.close()
        publisher.close()
    return figures


def check_routing_replay(quick: bool) -> dict:
    from meshrl.model.routing import Replay

    on = device()
    trainer = load_model(ModelConfig(arch="qwen3_moe"), seed=0).to(on).eval()
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    completions = sampled(sampler, 32, 6, 12, record_routes=True)
    replay = Replay(trainer, True)
    with torch.no_grad():
        trainer_logprobs(trainer, completions, "tree", replay=replay)
    counts = replay.take()
    assert counts["routing/ran_mismatch"] == 0 and counts["routing/tokens"] > 0, counts
    return {key.split("/")[1]: value for key, value in counts.items()}


def check_tree_layout(quick: bool) -> dict:
    on = device()
    completion = 64 if quick else (1024 if torch.cuda.is_available() else 256)
    group, prompt = 8, 64 if quick else 512
    cfg = ModelConfig(max_positions=prompt + completion + 8)
    model = load_model(cfg, seed=0).to(on).eval()
    ids, mask = prompts(1, prompt, on)
    ids, mask = ids.repeat(group, 1), mask.repeat(group, 1)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, 40, (group, completion), generator=generator).to(on)
    lengths = torch.randint(completion // 2, completion + 1, (group,), generator=generator)
    completion_mask = (torch.arange(completion) < lengths[:, None]).float().to(on)
    tokens = tokens.masked_fill(completion_mask == 0, 0)
    completions = Completions(ids, mask, tokens, completion_mask, torch.zeros_like(mask), 0)
    figures: dict = {"completion_tokens": completion, "group": group, "prompt_tokens": prompt}
    logprobs = {}
    for layout in ("padded", "tree"):
        with peak_memory(figures, f"{layout}_peak_mb"), torch.no_grad():
            started = time.perf_counter()
            logprobs[layout] = trainer_logprobs(model, completions, layout)
            synchronize()
            figures[f"{layout}_s"] = time.perf_counter() - started
    figures["gap"] = gap(logprobs["tree"], logprobs["padded"], completion_mask)
    assert figures["gap"] < 1e-4, figures
    return figures


def check_distributed(quick: bool) -> dict:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        raise Skipped("DDP and FSDP2 over NCCL need 2 GPUs")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Forked on CPU (no second import of torch); CUDA must start in fresh processes.
    start = "spawn" if torch.cuda.is_available() else "fork"
    with tempfile.TemporaryDirectory(prefix="meshrl-gpu-check-") as folder:
        mp.start_processes(
            _distributed_rank, args=(2, folder, port), nprocs=2, join=True, start_method=start
        )
        with open(os.path.join(folder, "figures.json")) as f:
            figures = json.load(f)
    assert figures["ddp_max_diff"] < 1e-5 and figures["fsdp_max_diff"] < 1e-5, figures
    return figures


def _distributed_rank(rank: int, world: int, folder: str, port: int) -> None:
    """One rank: a DDP step and an FSDP2 step on its half of a batch, compared with
    the whole batch's step on one rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    on = torch.device("cuda", rank) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        whole = sampled(load_model(ModelConfig(), seed=0).to(on).eval(), 8, 6, 8)
        half = slice(rank * 4, rank * 4 + 4)
        part = Completions(
            whole.prompt_ids[half],
            whole.prompt_mask[half],
            whole.completion_ids[half],
            whole.completion_mask[half],
            whole.logprobs[half],
            0,
        )
        count = whole.completion_mask.sum()  # the whole batch's tokens: the same gradient

        def step(model, completions, ranks: int) -> dict[str, torch.Tensor]:
            """One SGD step; DDP and FSDP2 average the ranks' gradients, so each
            rank's loss is taken `ranks` times."""
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            logprobs = trainer_logprobs(model, completions)
            (-(logprobs * completions.completion_mask).sum() / count * ranks).backward()
            optimizer.step()
            return {n: p.detach() for n, p in model.named_parameters()}

        want = step(load_model(ModelConfig(), seed=0).to(on), whole, 1)
        got = step(DistributedDataParallel(load_model(ModelConfig(), seed=0).to(on)), part, world)
        figures = {
            "ddp_max_diff": max(
                float((got["module." + n] - w).abs().max()) for n, w in want.items()
            )
        }
        sharded = load_model(ModelConfig(), seed=0).to(on)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        got = step(sharded, part, world)
        figures["fsdp_max_diff"] = max(
            float((got[n].full_tensor() - w).abs().max()) for n, w in want.items()
        )
        figures["backend"] = dist.get_backend()
        if rank == 0:
            with open(os.path.join(folder, "figures.json"), "w") as f:
                json.dump(figures, f)
    finally:
        dist.destroy_process_group()


def check_vllm(quick: bool) -> dict:
    if not torch.cuda.is_available():
        raise Skipped("vLLM runs on CUDA only")
    if importlib.util.find_spec("vllm") is None:
        raise Skipped("vllm is not installed (the `vllm` extra)")
    from meshrl.config import GenerationConfig, PolicyConfig
    from meshrl.model.engines import Request, make_engine

    model = load_model(ModelConfig(), seed=0).to(device()).eval()
    engine = make_engine(PolicyConfig(engine="vllm"), model, ModelConfig(), 0, [2], 0)
    ids, mask = prompts(8, 6, device())
    rows = [row[row != 0].tolist() for row in ids.cpu()]
    started = time.perf_counter()
    tokens, logprobs, completion_mask = engine.generate(
        Request(ids, mask, rows, GenerationConfig(max_new_tokens=16), torch.Generator())
    )
    figures = {"sample_s": time.perf_counter() - started}
    on = device()
    completions = Completions(ids, mask, tokens.to(on), completion_mask.to(on), logprobs.to(on), 0)
    with torch.no_grad():
        figures["logprob_gap"] = gap(
            trainer_logprobs(model, completions), completions.logprobs, completions.completion_mask
        )
    return figures


def check_vision(quick: bool) -> dict:
    import random

    from meshrl.envs.vision import VisionCount
    from meshrl.model.tokenizer import vision_format
    from meshrl.model.vision import stack

    on, figures = device(), {}
    for arch in ("qwen2_vl", "llava"):
        cfg = ModelConfig(arch=arch)
        model, fmt = load_model(cfg, seed=0).to(on).eval(), vision_format(cfg)
        ids, pixels = fmt.prompts([VisionCount(None).generate(random.Random(i)) for i in range(4)])
        pad, width = fmt.processor.tokenizer.pad_token_id, max(map(len, ids))
        prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=on)
        starts = torch.tensor([[width - len(x)] for x in ids])
        prompt_mask = (torch.arange(width) >= starts).float().to(on)
        images, counts = stack(pixels)  # on the CPU: the policy moves them
        tokens, logprobs, mask = sample(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=4,
            eos_token_id=-1,
            pad_token_id=pad,
            seeds=torch.arange(4),
            images=images,
            image_counts=counts,
        )
        tokens, logprobs, mask = tokens.to(on), logprobs.to(on), mask.to(on)
        with torch.no_grad():
            trained = completion_logprobs(
                model,
                torch.cat([prompt_ids, tokens], 1),
                torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], 1),
                tokens.size(1),
                images=images,
                image_counts=counts,
            )
        figures[f"{arch}_logprob_gap"] = gap(trained, logprobs, mask)
        assert figures[f"{arch}_logprob_gap"] < 1e-4, figures
    return figures


def check_checkpoint(quick: bool) -> dict:
    from meshrl.model.files import load_state, save_state

    on = device()
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=2)
    model, other = load_model(cfg, seed=0).to(on), load_model(cfg, seed=1).to(on)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    completions = sampled(model, 4, 6, 8)
    train_step(model, completions, optimizer)
    restored = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory(prefix="meshrl-gpu-check-") as folder:
        path = os.path.join(folder, "trainer.pt")
        started = time.perf_counter()
        save_state(path, model=model, optimizer=optimizer, version=3)
        extra = load_state(path, model=other, optimizer=restored)
        seconds = time.perf_counter() - started
    assert extra == {"version": 3}, extra
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert b.device == on and torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), restored.state.values(), strict=True):
        for key, value in a.items():
            assert b[key].device == value.device and torch.equal(value, b[key]), key
    return {"save_load_s": seconds, "optimizer_tensors": len(restored.state) * 3}


def check_continuous(quick: bool) -> dict:
    from meshrl.model.continuous import ContinuousEngine, Settings
    from tests.support.continuous import (
        batch_of_its_own,
        by_version,
        rows_spanning_versions,
        run_engine,
    )

    on = device()
    stops = list(range(10, 30))  # the random model ends rows at different steps
    model = load_model(ModelConfig(), seed=0).to(on).eval()
    generator = torch.Generator().manual_seed(2)
    calls = []
    for r in range(6):
        lengths = torch.randint(3, 12, (8,), generator=generator).tolist()
        rows = [torch.randint(5, 40, (n,), generator=generator).tolist() for n in lengths]
        seeds = torch.randint(-(2**62), 2**62, (8,), generator=generator).tolist()
        calls.append((rows, seeds, Settings(16 + 4 * r, 1.0, 1.0 if r % 2 else 0.9, r % 3)))

    # Six calls through a 12-row batch: rows join mid-decode at their own positions.
    engine = ContinuousEngine(model, 0, stops, max_rows=12, version=lambda: 0)
    started = time.perf_counter()
    got = run_engine(engine, calls, between=lambda i: time.sleep(0.02))
    synchronize()
    figures: dict = {"engine_s": time.perf_counter() - started, "occupancy": engine.occupancy()}
    equal, gaps = 0, [0.0]
    for (rows, seeds, settings), result in zip(calls, got, strict=True):
        alone = batch_of_its_own(model, rows, seeds, settings, stops, device=on)
        tokens, logprobs, mask = (t.cpu() for t in alone)
        if torch.equal(result["tokens"], tokens) and torch.equal(result["mask"], mask):
            equal += 1
            gaps.append(gap(result["logprobs"], logprobs, mask))
    figures.update(calls_equal=equal, calls=len(calls), logprob_gap=max(gaps))

    # Partial rollouts: the weights change three times under rows; each token's
    # log-prob is its own version's over its whole context (the rows are refilled).
    versions = [load_model(ModelConfig(), seed=s).state_dict() for s in (0, 4, 5, 6)]
    now = {"version": 0}
    engine = ContinuousEngine(model, 0, [2], max_rows=12, version=lambda: now["version"])
    calls[:] = [(rows, seeds, Settings(48)) for rows, seeds, _ in calls[:3]]

    def swap(i: int) -> None:
        time.sleep(0.05)
        with engine.paused():
            model.load_state_dict(versions[i + 1])
            now["version"] = i + 1
            engine.refill()

    got = run_engine(engine, calls, between=swap)
    spanning, refill_gaps = 0, [0.0]
    for (rows, _, _), result in zip(calls, got, strict=True):
        spanning += rows_spanning_versions(result)
        for mine, want in by_version(model, versions, rows, result, on):
            refill_gaps.append(gap(result["logprobs"], want, mine.float()))
    figures.update(rows_spanning_versions=spanning, refill_logprob_gap=max(refill_gaps))
    # A GPU's kernels may round differently with the batch's size: log-probs agree
    # to 1e-4 there (1e-5 on the CPU); a draw moved by such rounding fails the check.
    tolerance = 1e-4 if on.type == "cuda" else 1e-5
    assert figures["calls_equal"] == figures["calls"], figures
    assert figures["logprob_gap"] < tolerance and figures["refill_logprob_gap"] < tolerance, figures
    return figures


def _grpo(folder: str, name: str, *more: str) -> list[dict]:
    """A GRPO run of `grpo_default.yaml` with no warm start, evaluation or console output."""
    from algorithms.grpo import GRPO, GRPOConfig
    from meshrl.config import load_config

    cfg = load_config(
        GRPOConfig,
        os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
        [
            "warm_start.steps=0",
            "eval.every=0",
            "run.progress=false",
            "run.console_samples=0",
            f"run.dir={folder}",
            f"run.name={name}",
            *more,
        ],
    )
    return GRPO(cfg).run()


def _timing(records: list[dict], tokens: str) -> dict:
    """Steps, mean step seconds and `tokens` per second of a run, its first step left out."""
    timed = records[1:] or records
    seconds = sum(r["time/step_s"] for r in timed)
    return {
        "steps": len(records),
        "step_s": seconds / len(timed),
        "tokens_per_s": sum(r[tokens] for r in timed) / seconds,
    }


def _needs_monarch() -> None:
    if importlib.util.find_spec("monarch") is None:
        raise Skipped("Monarch (torchmonarch) is not installed: no meshes")


def check_grpo(quick: bool) -> dict:
    _needs_monarch()
    from safetensors.torch import load_file

    from meshrl.loop.checkpoint import complete, root, step_of

    steps = 3 if quick else 20
    half = 2 if quick else 10
    run = (f"steps={steps}", f"checkpoint.every={half}")
    with tempfile.TemporaryDirectory(prefix="meshrl-gpu-check-") as folder:
        records = _grpo(folder, "straight", *run)
        final = os.path.join(folder, "straight", "final", "model.safetensors")
        a = load_file(final)
        kept = complete(root(os.path.join(folder, "straight")))
        checkpoint = next((c for c in kept if step_of(c) == half), None)
        assert checkpoint, f"no checkpoint at step {half} among {kept}"
        # A resumed run goes on in its run's directory: its final weights replace a's.
        _grpo(folder, "straight", *run, f"checkpoint.resume={checkpoint}")
        b = load_file(final)
    return {
        **_timing(records, "tokens/generated"),
        "reward_last": records[-1]["reward/mean"],
        "resumed_at": step_of(checkpoint),
        "resume_equal": all(torch.equal(a[k], b[k]) for k in a),
        "resume_max_diff": max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
    }


def check_partial(quick: bool) -> dict:
    _needs_monarch()
    steps = 3 if quick else 8
    with tempfile.TemporaryDirectory(prefix="meshrl-gpu-check-") as folder:
        records = _grpo(
            folder,
            "partial",
            f"steps={steps}",
            "placement.policy=2",
            "rollout.dispatch=pull",
            "max_staleness=2",
            "policy.continuous=true",
            "policy.max_rows=32",
            "rollout.groups_per_call=1",
            "rollout.calls_per_replica=4",
            "rollout.partial=true",
            "faults.completion_lengths=8,0.2x96",
            "generation.max_new_tokens=96",
            "run.save_final=false",
        )
    lag = ("rollout/tokens_lag0", "rollout/tokens_lag1", "rollout/tokens_lag2plus")
    for r in records:  # every trained token counted once, by its lag
        assert sum(r[k] for k in lag) == r["policy/completion_tokens"], r
    timed = records[1:] or records
    return {
        **_timing(records, "policy/completion_tokens"),
        "partial_rows": sum(r["rollout/partial_rows"] for r in records),
        "tokens_lagged": sum(r[lag[1]] + r[lag[2]] for r in records),
        "occupancy": sum(r.get("policy/batch_occupancy", 0.0) for r in timed) / len(timed),
    }


CHECKS: dict[str, Callable[[bool], dict]] = {
    "model": check_model,
    "bf16": check_bf16,
    "fp8": check_fp8,
    "mixed_precision": check_mixed_precision,
    "weight_sync": check_weight_sync,
    "routing_replay": check_routing_replay,
    "tree_layout": check_tree_layout,
    "distributed": check_distributed,
    "vllm": check_vllm,
    "vision": check_vision,
    "checkpoint": check_checkpoint,
    "continuous": check_continuous,
    "grpo": check_grpo,
    "partial": check_partial,
}


def run(names: list[str], quick: bool) -> dict:
    result: dict = {"device": str(device()), "ran": [], "skipped": [], "checks": {}}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    for name in names:
        started = time.perf_counter()
        try:
            figures = {"ok": True, **CHECKS[name](quick)}
            result["ran"].append(name)
        except Skipped as why:
            figures = {"ok": True, "skipped": str(why)}
            result["skipped"].append(name)
        except Exception as error:  # noqa: BLE001 - one check's failure is a figure
            figures = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
            result["ran"].append(name)
            traceback.print_exc()
        figures["wall_s"] = time.perf_counter() - started
        result["checks"][name] = figures
        print(
            f"{name}: {'skipped' if 'skipped' in figures else 'ok' if figures['ok'] else 'FAILED'}",
            file=sys.stderr,
        )
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short horizons (the suite's CPU run)")
    parser.add_argument("--only", default="", help="comma-separated checks (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only: no check {', '.join(unknown)} (checks: {', '.join(CHECKS)})")
    result = run(names, args.quick)
    # Flushed at once: on the H200 the line was lost when the process ended after
    # the Monarch check (stdout to a file is block-buffered).
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
