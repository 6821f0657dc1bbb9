"""SLURM's client commands, as meshrl reads them: the queue (`squeue -o`), nodes
and their addresses (`scontrol show hostnames|node`), restarts, node health, and
which config key an sbatch refusal or a pending reason is about. Text formats
only: they have not changed in many SLURM releases (Monarch 0.7 read
`squeue --json`, whose layout 22.05 does not share; see `meshrl.procs.slurm`)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from meshrl.config.files import ConfigError

RUNNING = "RUNNING"
GONE = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
NEVER_CLEARS = (
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionDown",
    "PartitionInactive",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "QOSMaxNodePerJobLimit",
    "AssocMaxNodesPerJob",
)
"""Pending reasons SLURM keeps until the job changes: the run fails at once."""


class SlurmError(ConfigError):
    """SLURM refused or dropped an allocation: one line naming the key and SLURM's
    reason (a `ConfigError`: the run ends with that line, no traceback)."""


def slurm(*command: str, check: bool = True, timeout_s: float = 60.0) -> str:
    """Run a SLURM client command; its stdout (a failure: SlurmError with its stderr)."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise SlurmError(
            f"config key 'job.kind': slurm needs SLURM's {command[0]} on this machine's PATH"
        ) from None
    if check and done.returncode != 0:
        text = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(text[-1] if text else f"{command[0]} failed ({done.returncode})")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """`c[1-3],d4` -> [c1, c2, c3, d4], in SLURM's order (SLURM_NODEID's)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    return slurm("scontrol", "show", "hostnames", nodelist).split()


def node_addresses(nodes: list[str]) -> dict[str, str]:
    """Each node's NodeAddr (its name when SLURM has no other)."""
    if not nodes:
        return {}
    out = slurm("scontrol", "show", "node", "-o", ",".join(nodes), check=False)
    found = {}
    for line in out.splitlines():
        name = re.search(r"NodeName=(\S+)", line)
        addr = re.search(r"NodeAddr=(\S+)", line)
        if name:
            found[name.group(1)] = addr.group(1) if addr else name.group(1)
    return {n: found.get(n, n) for n in nodes}


@dataclass
class JobInfo:
    state: str
    nodelist: str  # `c[1-2]`; `hostnames()` expands it
    reason: str
    comment: str


def query(job_ids: list[str]) -> dict[str, JobInfo]:
    """The queue's view of these jobs (a job no longer in it is left out)."""
    if not job_ids:
        return {}
    out = slurm("squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%N|%r|%k", check=False)
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|", 4)
        if len(parts) == 5:
            job_id, state, nodelist, reason, comment = parts
            jobs[job_id] = JobInfo(state, nodelist, reason, "" if comment == "(null)" else comment)
    return jobs


def restarts(job_id: str) -> int:
    """How often SLURM requeued this job (`scontrol show job`'s Restarts)."""
    out = slurm("scontrol", "show", "job", "-o", job_id, check=False)
    match = re.search(r"Restarts=(\d+)", out)
    return int(match.group(1)) if match else 0


def blame(message: str, role: str) -> str:
    """The config key an sbatch refusal is about."""
    text = message.lower()
    if "partition" in text:
        return "job.partition"
    if "node configuration is not available" in text or "node count" in text:
        return f"job.hosts.{role}"
    if "account" in text:
        return "job.account"
    if "qos" in text:
        return "job.qos"
    if "time limit" in text:
        return "job.time_limit"
    return "job.slurm_args"


def unhealthy(nodes: list[str]) -> list[str]:
    """Those of `nodes` that SLURM has down, drained, failing or not responding."""
    if not nodes:
        return []
    out = slurm("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T", check=False)
    bad = ("down", "drain", "fail", "not_responding", "*")
    return sorted(
        {
            line.split()[0]
            for line in out.splitlines()
            if len(line.split()) == 2 and any(b in line.split()[1] for b in bad)
        }
    )


def reason_key(reason: str, name: str) -> str:
    """The config key a pending reason that never clears is about."""
    if reason.startswith("Partition"):
        return "job.partition" if "Node" not in reason else f"job.hosts.{name}"
    if "Account" in reason or "Assoc" in reason:
        return "job.account"
    if "QOS" in reason:
        return "job.qos"
    return "job.slurm_args"
