"""Data parallelism inside one role's mesh (trainer, critic).

Each proc of the mesh is one rank; the process group is local to the mesh
(gloo on CPU, NCCL when every rank has a GPU of its own).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint


class Rendezvous(Actor):
    """Spawned on a role's mesh on other hosts: where its rank 0 can listen."""

    @endpoint
    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()), port


def data_parallel(
    model: torch.nn.Module,
    device: torch.device,
    rank: int,
    world_size: int,
    master: tuple[str, int],
    ranks_per_host: int | None = None,
) -> torch.nn.Module:
    """`model` wrapped in DDP over this mesh's procs (itself when there is one
    proc); `master` is rank 0's (address, port)."""
    if world_size == 1:
        return model
    os.environ["MASTER_ADDR"], port = master[0], master[1]
    os.environ["MASTER_PORT"] = str(port)
    # NCCL needs a GPU of its own per rank; with fewer GPUs than ranks, gloo.
    own_gpus = device.type == "cuda" and (ranks_per_host or world_size) <= torch.cuda.device_count()
    dist.init_process_group("nccl" if own_gpus else "gloo", rank=rank, world_size=world_size)
    return torch.nn.parallel.DistributedDataParallel(model)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def clipped_step(
    loss: torch.Tensor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
) -> float:
    """Backward, clip the gradient norm, step; returns the norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
    optimizer.step()
    return grad_norm.item()
