"""Host and proc health: a preflight on every host before a role's actors run
there, and a heartbeat that finds a hung proc, writes its stacks and kills it.

Preflight (`health.preflight`): a `Preflight` actor (`meshrl.procs.preflight_actor`)
on the first proc of each host checks the cores its procs may use (affinity and
CPU quota, `cpu_cores`), the device (a matmul at the model's dtype; on CUDA also the device
count, free memory, ECC errors where the driver reports them), the collective
among the role's procs (gloo, or NCCL on GPUs), a Monarch RDMA buffer read from
another host, the run directory (a file written and fsynced, free space for a
checkpoint) and the versions of Python, torch, transformers and Monarch against
the controller's. `judge` turns the figures into findings: a check that failed,
or a figure below `health.min_ratio` of the median of the hosts checked.

Hangs (`health.hang_s`): `HangWatch` asks every proc's `Watch` (an actor of its
own, which answers while the role's actors compute) every second; a proc that has
not answered for `hang_s` is hung (stopped, or deadlocked holding the GIL). Its
Python stacks, every thread's, are taken on its host (`dump_and_kill`: py-spy if
installed, else the `faulthandler` each proc registers on SIGUSR2 at start,
`install_stack_dump`), written to faults.log, the proc is killed, and it is
entered in `proc_pool.lost`: the call waiting on it fails at once and the
Supervisor replaces it as a lost proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from meshrl.procs import proc_pool
from meshrl.procs.faultlog import log_fault
from meshrl.procs.stacks import dump_and_kill, install_stack_dump  # noqa: F401 (also from here)

logger = logging.getLogger(__name__)


# --- preflight: what runs on each host -------------------------------------------


def versions() -> dict[str, str]:
    """Python's, torch's, transformers' and Monarch's versions, as installed (read
    from the distributions' metadata: nothing imported)."""
    found = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("monarch", "torchmonarch"),
    ):
        try:
            found[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def cpu_cores(proc_root: str = "/proc/self", cgroup_root: str = "/sys/fs/cgroup") -> float:
    """The cores this process may use: its CPU affinity, capped by every CPU quota
    above it in its cgroup (v1 `cpu.cfs_quota_us / cpu.cfs_period_us`, v2
    `cpu.max`), as the kernel enforces them. A host held to a tenth of a core
    reads 0.1 however idle or busy the machine is, where timings under load do
    not separate it from a healthy host that waits its turn."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        with open(os.path.join(proc_root, "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return cores
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, `cpu.max` is "quota period" or "max ..."
            base, files = cgroup_root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base = next(
                (
                    os.path.join(cgroup_root, name)
                    for name in (controllers, "cpu", "cpu,cpuacct")
                    if os.path.isdir(os.path.join(cgroup_root, name))
                ),
                None,
            )
            if base is None:
                continue
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        parts = path.strip("/").split("/") if path.strip("/") else []
        for depth in range(len(parts), -1, -1):  # its own group up to the root
            here = os.path.join(base, *parts[:depth])
            try:
                values = [Path(here, name).read_text().split() for name in files]
            except OSError:
                continue
            quota, period = (values[0] if len(files) == 1 else [values[0][0], values[1][0]])[:2]
            if quota not in ("max", "-1") and int(period) > 0:
                cores = min(cores, int(quota) / int(period))
    return round(cores, 3)


def matmul_rate(dtype: str, seconds: float, size: int = 256) -> float:
    """GFLOP/s of square matmuls at `dtype`, over at least `seconds` of wall time
    (longer than a CPU quota's period, 100 ms, so a throttled host shows)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device).to(torch_dtype)
    b = torch.randn(size, size, device=device).to(torch_dtype)
    torch.mm(a, b)  # warm
    count, started = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return count * 2 * size**3 / elapsed / 1e9


def cuda_figures(expected_devices: int | None) -> tuple[dict, list[str]]:
    """On a CUDA host: device count (against `expected_devices`), each device's free
    memory share and uncorrected ECC errors where nvidia-smi reports them. Figures
    and failures (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}, []
    figures: dict[str, Any] = {"cuda_devices": torch.cuda.device_count()}
    failures = []
    if expected_devices and figures["cuda_devices"] < expected_devices:
        failures.append(
            f"device: {figures['cuda_devices']} CUDA devices, {expected_devices} expected"
        )
    free = []
    for index in range(figures["cuda_devices"]):
        have, total = torch.cuda.mem_get_info(index)
        free.append(have / total)
    figures["cuda_free_share"] = round(min(free), 3) if free else 0.0
    ecc = ecc_errors()
    if ecc:
        figures["ecc_uncorrected"] = ecc
        if any(v > 0 for v in ecc):
            failures.append(f"device: uncorrected ECC errors {ecc}")
    return figures, failures


def ecc_errors() -> list[int]:
    """Volatile uncorrected ECC errors per GPU, from nvidia-smi; [] where it does not
    report them (no driver tool, ECC off: `[N/A]`)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=ecc.errors.uncorrected.volatile.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    values = [line.strip() for line in out.splitlines() if line.strip()]
    return [int(v) for v in values] if values and all(v.isdigit() for v in values) else []


def disk_figures(run_dir: str, need_bytes: int, nbytes: int = 4 << 20) -> tuple[dict, list[str]]:
    """Write and fsync `nbytes` in `run_dir` (a private file, removed), and its free
    space against `need_bytes` (the next checkpoint)."""
    path = os.path.join(run_dir, f".preflight-{socket.gethostname()}-{os.getpid()}")
    data = os.urandom(nbytes)  # (made before the clock starts: it costs CPU, not disk)
    try:
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
        took = time.perf_counter() - started
        free = shutil.disk_usage(run_dir).free
    except OSError as error:
        return {}, [f"run_dir: cannot write {run_dir}: {error.strerror or error}"]
    figures = {
        "disk_mb_s": round(nbytes / 2**20 / max(took, 1e-6), 1),
        "free_gb": round(free / 2**30, 2),
    }
    if free < need_bytes:
        return figures, [
            f"run_dir: {_size(free)} free in {run_dir}, the next checkpoint needs "
            f"{_size(need_bytes)}"
        ]
    return figures, []


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MB"


@dataclass
class Spec:
    """What a host is checked for (sent to its `Preflight` actor)."""

    dtype: str = "float32"
    run_dir: str = ""
    need_bytes: int = 0
    matmul_s: float = 0.3
    expected_devices: int | None = None


# --- preflight: judging the figures ----------------------------------------------

RATED = ("cpu_cores", "matmul_gflops", "gloo_gb_s", "nccl_gb_s", "rdma_gb_s")
"""Figures judged against the median (higher is better). The run directory's write
rate is shown, not judged: a shared filesystem's rate moves with every other
writer, while a directory that cannot be written or lacks the room is a failure."""


@dataclass
class Finding:
    """A host that failed a check, or fell below `min_ratio` of the median."""

    host: str
    check: str
    detail: str

    def line(self) -> str:
        return f"host {self.host} failed the {self.check} check: {self.detail}"


def judge(
    figures: dict[str, dict],
    failures: dict[str, list[str]],
    min_ratio: float,
    baseline: dict[str, float] | None = None,
    controller: dict[str, str] | None = None,
) -> list[Finding]:
    """Findings for hosts (`figures`: host -> its figures; `failures`: host -> its
    failed checks as `check: why`): each failure, each version that differs from
    `controller`'s, and each `RATED` figure below `min_ratio` of its median, taken
    over these hosts and `baseline` (medians of hosts checked before: one new host
    is judged against the run's others). A single host with no baseline has no
    median to fall below."""
    found = []
    for host, failed in failures.items():
        for failure in failed:
            check, _, why = failure.partition(": ")
            found.append(Finding(host, check, why))
    if controller:
        for host, figs in figures.items():
            differ = {
                k: v
                for k, v in figs.get("versions", {}).items()
                if controller.get(k) not in (None, v)
            }
            if differ:
                said = ", ".join(f"{k} {v} (controller {controller[k]})" for k, v in differ.items())
                found.append(Finding(host, "versions", said))
    medians = medians_of(figures, baseline)
    for host, figs in figures.items():
        for key in RATED:
            if key not in figs or key not in medians or medians[key] <= 0:
                continue
            ratio = figs[key] / medians[key]
            if ratio < min_ratio:
                found.append(
                    Finding(
                        host,
                        key.split("_")[0],
                        f"{key} {figs[key]:g} is {ratio:.2f} of the median {medians[key]:g} "
                        f"(health.min_ratio {min_ratio:g})",
                    )
                )
    return found


def medians_of(figures: dict[str, dict], baseline: dict[str, float] | None = None) -> dict:
    """Each `RATED` figure's median over the hosts (and the `baseline`'s value, as
    many times as hosts it stood for: `baseline['hosts']`), where two or more
    hosts give one."""
    medians = {}
    weight = int((baseline or {}).get("hosts", 0))
    for key in RATED:
        values = [f[key] for f in figures.values() if key in f]
        if baseline and key in baseline:
            values += [baseline[key]] * weight
        if len(values) >= 2:
            medians[key] = statistics.median(values)
    return medians


# --- hangs -------------------------------------------------------------------------


@dataclass
class _Beat:
    target: Any  # what identifies the proc asked (replaced procs: a new one)
    future: Any = None
    sent: float = 0.0
    answered: float = 0.0
    pid: int | None = None
    host: str = ""
    hung: bool = False  # reported: never again (its replacement is a new target)


class HangWatch:
    """Asks every proc's `Watch` (`meshes.watches`) every `every_s`; a proc that
    has not answered for `hang_s` is hung: `on_hang(role, rank, pid, host,
    silent_s)` takes its stacks and kills it (a thread; `close()` stops it). Procs replaced since
    (a new actor mesh at that rank) start afresh."""

    def __init__(
        self,
        meshes: Any,
        hang_s: float,
        on_hang: Callable[[str, int, int | None, str, float], None],
        every_s: float | None = None,
    ):
        self.meshes, self.hang_s, self.on_hang = meshes, hang_s, on_hang
        self.every_s = every_s or min(1.0, hang_s / 4)
        self.beats: dict[tuple[str, int], _Beat] = {}
        self.hung: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshrl-heartbeat", daemon=True)
        self._thread.start()

    def _targets(self) -> dict[tuple[str, int], tuple[Any, Any]]:
        """(role, rank) -> (what identifies its proc, its Watch): a role's actor mesh
        (a slice is a new object each time), or an elastic role's member."""
        found = {}
        for role, watch in list(self.meshes.watches.items()):
            with contextlib.suppress(Exception):  # a role being replaced: next time
                for rank in range(self.meshes.size(role)):
                    target = watch.slice(procs=rank)
                    found[(role, rank)] = (
                        target if getattr(watch, "elastic", False) else watch,
                        target,
                    )
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.tick(time.monotonic())
            except Exception as error:  # noqa: BLE001 - a mesh changing meanwhile: next time
                logger.debug("heartbeat: %s", error)

    def tick(self, now: float) -> None:
        """One round: collect the answers that came, ask again those that answered,
        report those silent for `hang_s`."""
        targets = self._targets()
        for key in [k for k in self.beats if k not in targets]:
            del self.beats[key]
        for key, (ident, target) in targets.items():
            try:
                self._beat(key, ident, target, now)
            except Exception as error:  # noqa: BLE001 - one proc's trouble stops no other's beat
                logger.debug("heartbeat of %s[%d]: %s", *key, error)

    def _beat(self, key: tuple[str, int], ident: Any, target: Any, now: float) -> None:
        """One proc's round: its answer collected, asked again, or reported hung."""
        beat = self.beats.get(key)
        if beat is None or beat.target is not ident:
            beat = self.beats[key] = _Beat(ident, answered=now)
        if beat.hung:
            return
        if beat.future is not None:
            try:
                answer = beat.future.get(timeout=0.001)
            except TimeoutError:
                answer = None
            except Exception:  # noqa: BLE001 - its proc is gone: the loss's own path
                beat.future, beat.answered = None, now
                return
            if answer is not None:
                beat.future, beat.answered = None, now
                beat.pid, beat.host = answer.get("pid"), answer.get("host", "")
        if beat.future is None:
            beat.future, beat.sent = target.status.call_one(), now
            return
        role, rank = key
        silent_s = now - beat.answered
        if beat.pid is None and self.meshes.job_cfg.kind in ("local", "process"):
            # Never answered here: a proc busy since the watch began (a replica's
            # rollout holds its proc's actors' thread) has its pid from its spawn, on
            # this machine.
            with contextlib.suppress(Exception):
                beat.pid, beat.host = self.meshes.pid_of(role, rank), socket.gethostname()
        # Only a proc whose pid is known (it answered here before, or at its spawn on
        # this machine), so it can be killed: one still starting is left to the call
        # deadline.
        if (
            silent_s > self.hang_s
            and beat.pid is not None
            and f"{role}[{rank}]" not in proc_pool.lost
        ):
            self.hung.append({"role": role, "rank": rank, "silent_s": silent_s})
            beat.hung = True  # reported once
            self.on_hang(role, rank, beat.pid, beat.host, silent_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def hung_line(role: str, rank: int, silent_s: float, pid: int | None, host: str) -> str:
    return (
        f"hung: {role}[{rank}] (pid {pid} on {host or '?'}) answered no heartbeat for "
        f"{silent_s:.1f}s (health.hang_s); its stacks are in faults.log, it was killed "
        "and is replaced as a lost proc"
    )


def take_stacks(pid: int | None, host: str, remote: Callable[[int], str] | None) -> str:
    """The stacks of hung proc `pid`, killing it: here when it runs on this host, else
    through `remote(pid)` (SLURM: a job step on its node), else a line saying why not."""
    if pid is None:
        return "(its pid is unknown: it never answered)"
    here = host == socket.gethostname() and proc_pool.alive(pid)
    if remote is not None:
        try:
            return remote(pid)
        except Exception as error:  # noqa: BLE001 - then here, where it is this host
            if not here:
                return f"(its stacks could not be taken on {host}: {error})"
    if here:
        return dump_and_kill(pid)
    return f"(process {pid} runs on {host}, which this controller cannot reach)"


def log_hang(line: str, stacks: str) -> None:
    log_fault(f"{line}\n--- stacks of the hung proc ---\n{stacks}\n--- end of stacks ---")


if __name__ == "__main__":  # `python -m meshrl.procs.health dump PID`, on the proc's host
    if len(sys.argv) != 3 or sys.argv[1] != "dump" or not sys.argv[2].isdigit():
        sys.exit("usage: python -m meshrl.procs.health dump PID")
    print(dump_and_kill(int(sys.argv[2])), flush=True)
