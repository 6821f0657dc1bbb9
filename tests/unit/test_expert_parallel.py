"""Expert parallelism over 2 gloo ranks gives the 1-proc forward, gradients and
AdamW step of a tiny Qwen3-MoE (5 experts: ranks hold 3 and 2), under DDP, under
FSDP2, and with routing replay."""

from __future__ import annotations

import contextlib
import multiprocessing

import pytest
import torch

from meshrl.model.architectures import tiny_config
from meshrl.model.losses import LossScale
from meshrl.model.routing import Replay
from meshrl.procs.expert_parallel import expert_names, expert_range

WORLD, ROWS, WIDTH, VOCAB, LAYERS, EXPERTS, TOP_K = 2, 4, 6, 32, 2, 5, 2
CASES = ("ddp", "fsdp", "replay")  # replay: DDP with the routes of `batch` replayed
TOLERANCE = 1e-5


def build() -> torch.nn.Module:
    import transformers

    config = tiny_config(
        "qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=LAYERS,
        num_heads=2,
        intermediate_size=32,
        max_positions=16,
    )
    config.num_experts, config.num_experts_per_tok = EXPERTS, TOP_K
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def batch():
    """Token ids, targets and routes (distinct random experts per token and layer)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (ROWS, WIDTH), generator=generator)
    targets = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator)
    order = torch.rand(ROWS, WIDTH, LAYERS, EXPERTS, generator=generator).argsort(-1)
    return ids, targets, order[..., :TOP_K].to(torch.int16)


def run(model, call, rows: slice, ranks: int, replay: bool):
    """A forward without grad (the routers' own routes), then forward and backward
    of `rows` of the batch, the loss built as LossScale builds it; then one AdamW
    step. Returns (both forwards' logits [rows, 2, ...], grads, weights) of `model`."""
    ids, targets, routes = batch()
    with torch.no_grad():
        quiet = call(ids[rows]).logits
    mask = torch.ones(ROWS, WIDTH)
    scale = LossScale.of(mask, ranks)
    replayed = Replay(model, True)
    own = routes[rows].reshape(-1, LAYERS, TOP_K)
    with replayed.forward(own) if replay else contextlib.nullcontext():
        logits = call(ids[rows]).logits
    if replay:  # the routers ran with the random routes, not their own choice
        assert replayed.ran_mismatch == 0 < replayed.router_mismatch
    terms = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), targets[rows], reduction="none"
    )
    scale.token_mean(terms, mask[rows]).backward()
    grads = {
        name: whole(torch.zeros_like(p) if p.grad is None else p.grad)
        for name, p in model.named_parameters()
    }
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    weights = {name: whole(p.detach()) for name, p in model.named_parameters()}
    return torch.stack([quiet, logits.detach()], dim=1), grads, weights


def whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from meshrl.procs.expert_parallel import ddp_ignore, expert_parallel
    from meshrl.procs.parallel import shard_layers

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        for case in CASES:
            model = build()
            names = expert_parallel(model)
            if case == "fsdp":
                shard_layers(model, None, names)
                call = model
                sharded = {n for n, p in model.named_parameters() if hasattr(p, "full_tensor")}
                assert sharded == {n for n, _ in model.named_parameters()} - set(names)
            else:
                ddp_ignore(model, names)
                call = torch.nn.parallel.DistributedDataParallel(model)
            rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
            result = run(model, call, rows, WORLD, case == "replay")
            torch.save((names, *result), f"{out}/{case}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_expert_parallel_matches_one_proc(tmp_path):
    references = {}  # case: (logits, grads, weights) of one proc on the whole batch
    for case in CASES:
        model = build()
        references[case] = run(model, model, slice(None), 1, case == "replay")
    names = expert_names(model)
    assert len(names) == 2 * LAYERS
    assert [expert_range(EXPERTS, WORLD, r) for r in range(WORLD)] == [(0, 3), (3, 5)]

    # fork: the ranks start with torch and transformers' Qwen3-MoE already imported
    # (spawned, each imports them again: seconds on 2 busy cores).
    context = multiprocessing.get_context("fork")
    procs = [
        context.Process(target=rank_main, args=(rank, str(tmp_path / "store"), str(tmp_path)))
        for rank in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [proc.exitcode for proc in procs] == [0] * WORLD

    worst = {}
    for case, (logits, grads, weights) in references.items():
        parts = [torch.load(tmp_path / f"{case}-{r}.pt") for r in range(WORLD)]
        assert all(part[0] == names for part in parts)
        differences = [(torch.cat([p[1] for p in parts]) - logits).abs().max()]
        for want, got in ((grads, 2), (weights, 3)):
            for name, value in want.items():
                if name in names:  # each rank's chunk of the experts
                    mine = torch.cat([p[got][name] for p in parts])
                else:
                    mine = parts[0][got][name]
                    assert torch.equal(mine, parts[1][got][name]), name
                assert mine.shape == value.shape, name
                differences.append((mine - value).abs().max())
        worst[case] = float(max(differences))
    print("max differences", worst)
    assert max(worst.values()) < TOLERANCE, worst
