"""A private SLURM cluster on this machine, for the `cluster` tests and for trying
`job.kind=slurm` by hand (`make cluster`).

Debian's slurmctld and slurmd (22.05) run as root with every file in one
directory: one `slurm.conf` used by every daemon (`-f`) and every client
(`SLURM_CONF`, which the `sbatch`/`squeue` calls of a run inherit), auth/none
(no munge), and one slurmd per node (`slurmd -N cK`), all on 127.0.0.1 with a
port each. Partitions: `debug` (every node, the default) and `urgent` over the
same nodes at a higher priority tier, whose jobs preempt `debug` jobs by
requeueing them (`PreemptMode=REQUEUE`).

    python -m tests.support.slurm_cluster start [--dir runs/slurm] [--nodes 8]
    python -m tests.support.slurm_cluster stop [--dir runs/slurm] [--after PID]

`Cluster.start()` installs the three packages when they are missing and it can
(root and apt-get); `Cluster.unavailable()` says in one line why it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from meshrl.procs.proc_pool import alive  # (a zombie daemon is not running)

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def installed() -> bool:
    return all(shutil.which(c) for c in COMMANDS)


def install() -> str | None:
    """Install Debian's SLURM packages if missing; None, or why they cannot be."""
    if installed():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "SLURM is not installed, and installing it needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in range(2):
        if attempt:  # a fresh machine's package lists may be missing
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode == 0 and installed():
            return None
    return f"apt-get could not install {' '.join(PACKAGES)}: {done.stderr.strip()[-200:]}"


def _processes(marks: list[bytes], daemon: bytes | None = None) -> list[int]:
    """Pids of processes whose environment holds one of `marks`, or whose command is
    `daemon` (a slurmd with its node name)."""
    pids, mine = [], _ancestors()  # (`make cluster-stop` from a shell with SLURM_CONF set)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        named = daemon is not None and cmd[:1] and cmd[0].endswith(b"slurmd") and daemon in cmd
        if named or any(mark in env for mark in marks):
            pids.append(int(entry))
    return pids


def _ancestors() -> set[int]:
    """This process and its parents."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _node_processes(node: str) -> list[int]:
    """Pids of the processes a node runs: its slurmd and every process of its jobs
    (they carry SLURMD_NODENAME=node in their environment)."""
    return _processes([f"SLURMD_NODENAME={node}".encode()], node.encode())


class Cluster:
    """A SLURM cluster of `nodes` nodes (c1..cN) whose files all lie in `root`."""

    def __init__(self, root: str, nodes: int = 8):
        self.root = os.path.abspath(root)
        self.nodes = [f"c{i}" for i in range(1, nodes + 1)]
        self.conf = os.path.join(self.root, "slurm.conf")

    @property
    def env(self) -> dict[str, str]:
        """The environment a client needs (SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": self.conf}

    @staticmethod
    def unavailable() -> str | None:
        """Why no cluster can run here (one line), or None."""
        if not sys.platform.startswith("linux"):
            return "a SLURM cluster needs Linux"
        return install()

    # --- lifetime -------------------------------------------------------------------

    def write_conf(self) -> None:
        os.makedirs(os.path.join(self.root, "state"), exist_ok=True)
        ports = free_ports(1 + len(self.nodes))
        cpus = os.cpu_count() or 1
        memory = 4096
        node_lines = [
            f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"Port={p} CPUs={cpus} RealMemory={memory} State=UNKNOWN"
            for n, p in zip(self.nodes, ports[1:], strict=True)
        ]
        nodes = f"c[1-{len(self.nodes)}]"
        text = f"""# written by tests/support/slurm_cluster.py: a private cluster, every file in {self.root}
ClusterName=meshrl
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=4
MinJobAge=60
SlurmdTimeout=30
InactiveLimit=0
{chr(10).join(node_lines)}
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8 PriorityTier=1
PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP OverSubscribe=FORCE:8 PriorityTier=10
"""
        with open(self.conf, "w") as f:
            f.write(text)

    def run(self, *command: str, check: bool = True) -> str:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def start(self, timeout_s: float = 60.0) -> Cluster:
        """Start slurmctld and one slurmd per node; return when every node is idle."""
        why = self.unavailable()
        if why:
            raise RuntimeError(why)
        self.stop()
        shutil.rmtree(os.path.join(self.root, "state"), ignore_errors=True)
        self.write_conf()
        self.run("slurmctld", "-c", "-f", self.conf)  # -c: no job of an earlier cluster
        for node in self.nodes:
            self.start_node(node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and all(
                s.startswith("idle") for s in states.values()
            ):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM nodes did not come up: {self.node_states()}")

    def start_node(self, node: str) -> None:
        os.makedirs(os.path.join(self.root, "spool", node), exist_ok=True)
        self.run("slurmd", "-f", self.conf, "-N", node)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def pids(self) -> list[int]:
        """Pids of this cluster's daemons, from their pid files."""
        pids = []
        for name in ["slurmctld", *(f"slurmd-{n}" for n in self.nodes)]:
            path = os.path.join(self.root, f"{name}.pid")
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                pids.append(int(f.read().strip()))
        return [p for p in pids if alive(p)]

    def processes(self) -> list[int]:
        """Every process of this cluster (daemons, step daemons, jobs, and clients
        started with `env`): by the SLURM_CONF in their environment."""
        return _processes([f"SLURM_CONF={self.conf}".encode()])

    def jobs(self) -> list[str]:
        """Ids of the jobs in the queue (any state)."""
        if not os.path.exists(self.conf) or not self.pids():
            return []
        out = self.run("squeue", "-h", "-o", "%i", check=False)
        return out.split()

    def stop(self) -> None:
        """Cancel every job, stop every daemon, then kill what is left of the
        cluster: its jobs' processes, and the step daemons of a lost node, which
        outlive its slurmd."""
        jobs = self.jobs()  # (none when the daemons are down)
        if jobs:
            self.run("scancel", "--full", "--quiet", *jobs, check=False)
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in {*self.pids(), *self.processes()}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    # --- faults ---------------------------------------------------------------------

    def lose_node(self, node: str) -> None:
        """A node lost: its slurmd and every process of its jobs killed at once, and
        the node marked down (as slurmctld would once it stopped answering)."""
        for pid in _node_processes(node):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.run("scontrol", "update", f"nodename={node}", "state=down", "reason=lost", check=False)

    def restore_node(self, node: str, timeout_s: float = 30.0) -> None:
        """Bring a lost node back: its slurmd started again and the node resumed."""
        if not any(p for p in _node_processes(node)):
            self.start_node(node)
        self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        deadline = time.monotonic() + timeout_s
        while not self.node_states().get(node, "").startswith(("idle", "alloc", "mix")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node} did not come back: {self.node_states().get(node)}")
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.slurm_cluster", description=__doc__
    )
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--dir", default="runs/slurm", help="where every file of it lies")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument(
        "--after", type=int, metavar="PID", help="stop: first wait for process PID to end"
    )
    args = parser.parse_args(argv)
    cluster = Cluster(args.dir, args.nodes)
    if args.action == "stop":
        while args.after and alive(args.after):
            time.sleep(1.0)
        cluster.stop()
        print(f"stopped the SLURM cluster in {cluster.root}")
        return
    started = time.monotonic()
    cluster.start()
    print(
        f"SLURM cluster up in {time.monotonic() - started:.1f}s: {len(cluster.nodes)} nodes "
        f"(c1..c{len(cluster.nodes)}), partitions debug (default) and urgent\n"
        f"  export SLURM_CONF={cluster.conf}\n"
        f"  sinfo\n"
        f"  .venv/bin/python -m algorithms.grpo --config algorithms/configs/grpo_default.yaml "
        f"job.kind=slurm job.python_exe=$PWD/.venv/bin/python\n"
        f"stop it with: make cluster-stop"
    )


if __name__ == "__main__":
    main()
