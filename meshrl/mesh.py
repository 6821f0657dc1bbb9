"""Role meshes on a Monarch host, deadlines on remote calls, and clean shutdown.

`RoleMeshes(placement_counts)` spawns one proc mesh per role (its procs named
`procs`), gives each proc its share of the CPU cores, and stops every proc on
`stop()`, on leaving a `with` block, on error and on Ctrl-C. `wait(future,
"policy.generate")` is how the controller collects a result: it honours a
deadline, stays responsive to Ctrl-C, and turns an actor failure into a
`RemoteCallError` naming the role, the endpoint and the cause.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.05


class RemoteCallError(RuntimeError):
    """A remote call failed, timed out, or its mesh lost a process."""


# --- faults --------------------------------------------------------------------------

faults: list[str] = []
"""Mesh failures Monarch reported with no handler, oldest first (for inspection)."""


def _record_fault(failure: Any) -> None:
    """Monarch's unhandled-fault hook. Its default ends the client process; here
    the failure is recorded and logged, and the call that needed the dead proc
    fails at the controller with a `RemoteCallError` instead."""
    text = str(failure).strip()
    faults.append(text)
    logger.warning("mesh failure: %s", text.splitlines()[0] if text else "unknown")


def install_fault_hook() -> None:
    import monarch.actor

    monarch.actor.unhandled_fault_hook = _record_fault


def wait(future: Any, what: str, timeout_s: float) -> Any:
    """Block on a Monarch future for at most `timeout_s` seconds.

    Polls in short slices so that Ctrl-C is handled at once; an error inside
    the actor, or the death of its proc, raises `RemoteCallError` naming `what`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.get(timeout=POLL_S)
        except TimeoutError:
            pass
        except Exception as error:
            raise RemoteCallError(f"{what} failed: {_first_line(error)}") from error
        if time.monotonic() > deadline:
            raise RemoteCallError(f"{what} did not answer within {timeout_s:g}s")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # Actor errors carry the remote traceback; its last line is the cause.
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[-1].strip() if "Traceback" in text else lines[0].strip()


def start_each(actors: Any, endpoint: str, args_per_rank: Sequence[tuple]) -> list:
    """Call `endpoint` on proc i of `actors` with `args_per_rank[i]`, all at once;
    returns the futures (collect them with `gather`)."""
    return [
        getattr(actors.slice(procs=i), endpoint).call_one(*args)
        for i, args in enumerate(args_per_rank)
    ]


def gather(futures: Sequence, what: str, timeout_s: float) -> list:
    """The results of `start_each`'s futures in rank order."""
    return [wait(f, f"{what}[{i}]", timeout_s) for i, f in enumerate(futures)]


def call_each(
    actors: Any, endpoint: str, args_per_rank: Sequence[tuple], what: str, timeout_s: float
) -> list:
    """Call `endpoint` on proc i of `actors` with `args_per_rank[i]`, all at once,
    and return the results in rank order."""
    return gather(start_each(actors, endpoint, args_per_rank), what, timeout_s)


def call_all(actors: Any, endpoint: str, *args: Any, what: str, timeout_s: float) -> list:
    """Call `endpoint` with the same arguments on every proc; results in rank order."""
    values = wait(getattr(actors, endpoint).call(*args), what, timeout_s)
    return [value for _, value in values.items()]


def split(items: Sequence, num_parts: int) -> list[list]:
    """Contiguous, nearly equal parts (order kept): shards for replicas."""
    size, extra = divmod(len(items), num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        end = start + size + (1 if i < extra else 0)
        parts.append(list(items[start:end]))
        start = end
    return parts


# --- meshes --------------------------------------------------------------------------


DEVICE_OFFSET_ENV = "MESHRL_DEVICE_OFFSET"


def _setup_proc(num_threads: int, device_offset: int) -> None:
    """Runs first in every spawned proc: its share of the cores, and where its
    role's GPUs start (proc i of the mesh takes GPU offset + i; see
    `meshrl.models.device_for_this_proc`)."""
    # RDMA registration of CUDA memory wants expandable segments; the allocator
    # reads this at its first CUDA allocation, which comes later.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ[DEVICE_OFFSET_ENV] = str(device_offset)


class RoleMeshes:
    """One Monarch proc mesh per role on `host` (default: this host).

    `counts` maps role -> number of procs, e.g. {"policy": 1, "trainer": 2}.
    On a GPU host the roles take consecutive GPUs in that order (policy 0..,
    then trainer ..), except `cpu_roles`, which take none.
    Use as a context manager, or call `stop()`.
    """

    def __init__(
        self,
        counts: dict[str, int],
        host: Any = None,
        threads_per_proc: int | None = None,
        cpu_roles: tuple[str, ...] = ("environment",),
    ):
        from monarch.actor import this_host

        install_fault_hook()
        self.counts = dict(counts)
        total = sum(self.counts.values())
        threads = threads_per_proc or max(1, (os.cpu_count() or 1) // total)
        host = host if host is not None else this_host()
        self.meshes: dict[str, Any] = {}
        device_offset = 0
        try:
            for role, count in self.counts.items():
                self.meshes[role] = host.spawn_procs(
                    per_host={"procs": count},
                    bootstrap=functools.partial(_setup_proc, threads, device_offset),
                    name=role,
                )
                if role not in cpu_roles:
                    device_offset += count
        except BaseException:
            self.stop()
            raise

    def __getitem__(self, role: str) -> Any:
        return self.meshes[role]

    def __contains__(self, role: str) -> bool:
        return role in self.meshes

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every proc. Safe to call twice; never raises."""
        meshes, self.meshes = self.meshes, {}
        for role, mesh in meshes.items():
            try:
                # Not `wait`: polling a `stop()` future with short timeouts cancels it.
                mesh.stop().get(timeout=timeout_s)
            except BaseException as error:  # noqa: BLE001 - best effort, keep stopping the rest
                logger.warning("could not stop %s mesh cleanly: %s", role, error)

    def __enter__(self) -> RoleMeshes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
