"""SLURM allocations for a run's roles: `job.kind: slurm`.

Each role's hosts are one SLURM job of their own (`sbatch --nodes=job.hosts[role]
--exclusive --no-kill --requeue`), so each role runs on nodes of its own, a role
can be given a new allocation without touching the others (a lost node, a
requeue), and `meshrl status` names each role's job and nodes. One Monarch
worker runs per node (`python -m meshrl.procs.slurm`), listening on the node's
`NodeAddr` (`scontrol show node`: node names need not resolve as host names) at
a port of its own, so several nodes may share one host.

Why not Monarch 0.7's `monarch.job.SlurmJob`: it misreads SLURM 22.05's
`squeue --json`, cancels its own job when it holds fewer nodes than asked, dials
node names as host names, puts every worker on port 22222 and every role in one
job (docs/launch.md has the details; `meshrl.procs.slurm_queue` reads text formats).

Scheduler notices reach the controller through the job itself: the batch script
traps SIGTERM (preemption, requeue, cancel) and the `--signal` warning before
the time limit (SIGUSR1), and writes it into the job's comment, which
`Allocations.notices()` reads with squeue. The workers ignore SIGTERM, so the
procs outlive it until SLURM's SIGKILL (`KillWait`, or the partition's
`GraceTime`): time for the controller to write a checkpoint first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from meshrl.config.policy import port_free
from meshrl.procs import channels
from meshrl.procs.slurm_faults import note_lost, quarantined
from meshrl.procs.slurm_queue import (
    GONE,
    NEVER_CLEARS,
    RUNNING,
    SlurmError,
    blame,
    hostnames,
    node_addresses,
    query,
    reason_key,
    restarts,
    slurm,
    unhealthy,
)
from meshrl.procs.tls import CA_ENV, RunCA

logger = logging.getLogger(__name__)

PORT_ENV = "MESHRL_WORKER_PORT"
RESTARTS = 8  # requeues of one job before its ports and worker ids repeat
LOG_DIR = "slurm-logs"
"""Where SLURM jobs write their output when the caller names no place (a run
names its own: <run dir>/slurm)."""
# --- one role's allocation -----------------------------------------------------------


@dataclass
class Allocation:
    """One SLURM job holding `count` nodes for the host mesh `name`."""

    name: str
    count: int
    port: int  # worker i of restart r listens at port + (r % RESTARTS) * count + i
    service_ids: list = field(default_factory=list)  # Monarch ProcIds, same layout
    job_id: str | None = None
    nodes: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    restarts: int = 0

    def slot(self, index: int) -> int:
        """Worker `index`'s place in the port and worker-id layout of this restart."""
        return (self.restarts % RESTARTS) * self.count + index

    def listening(self, index: int) -> bool:
        """Worker `index` of the running job accepts connections."""
        return _listening(self.addresses[index], self.port + self.slot(index))

    def workers(self) -> list[str]:
        """Monarch worker addresses (`ProcId@tls://addr:port`) of the running job."""
        from monarch._src.job.service_identity import service_proc_addr

        return [
            service_proc_addr(
                f"tls://{addr}:{self.port + self.slot(i)}", self.service_ids[self.slot(i)]
            )
            for i, addr in enumerate(self.addresses)
        ]


class Allocations:
    """The SLURM jobs of a run: submit one per host mesh, wait for it to run,
    give a role a new one, cancel them all. `exclude`: nodes no job may get
    (quarantined ones, `faults.quarantine_after`)."""

    def __init__(
        self,
        cfg: Any,
        log_dir: str,
        exclude: set[str] | None = None,
        cpu_meshes: set[str] | None = None,
    ):
        self.cfg = cfg  # a meshrl.procs.job.JobConfig
        self.log_dir = log_dir
        self.exclude = exclude if exclude is not None else set()
        self.cpu_meshes = cpu_meshes or set()  # host meshes of CPU-only roles: no GPUs asked
        self.jobs: dict[str, Allocation] = {}
        self.ports_taken: set[int] = set()
        self.port_holds: dict[int, list[socket.socket]] = {}  # base -> held names

    # --- submitting -------------------------------------------------------------------

    def _port(self, count: int) -> int:
        """A base port for `count` workers x RESTARTS, apart from this run's others
        (and free on this host, where nodes share it)."""
        span = count * RESTARTS
        # Below the ephemeral range: there the kernel hands out the ports of
        # outgoing connections and of `port 0` listeners (Monarch's own channels).
        low = ephemeral_low()
        for _ in range(200):
            base = random.randrange(10000, low - span)
            wanted = set(range(base, base + span))
            if wanted & self.ports_taken:
                continue
            # Held before the check, so another run on this host that checks later
            # sees the range taken even though its workers do not listen yet.
            holds = _hold_ports(base, span)
            if holds is None or not _free_here(base, span):
                for hold in holds or ():
                    hold.close()
                continue
            self.ports_taken |= wanted
            self.port_holds[base] = holds
            return base
        raise SlurmError("no free range of worker ports found")

    def script(self, alloc: Allocation, role: str) -> str:
        from monarch._src.job.service_identity import serialize_service_proc_ids

        cfg = self.cfg
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={cfg.name}-{alloc.name}",
            f"#SBATCH --nodes={alloc.count}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --exclusive",
            "#SBATCH --no-kill",  # a lost node takes its procs, not the role's others
            "#SBATCH --requeue",
            f"#SBATCH --output={self.log_dir}/slurm-%j-{alloc.name}.out",
        ]
        optional = {
            "partition": cfg.partition,
            "account": cfg.account,
            "qos": cfg.qos,
            "time": cfg.time_limit,
            "gpus-per-node": cfg.gpus_per_node if role not in self.cpu_meshes else None,
        }
        lines += [f"#SBATCH --{key}={value}" for key, value in optional.items() if value]
        if cfg.time_limit:
            lines.append(f"#SBATCH --signal=B:USR1@{cfg.warn_before_s}")
        if self.exclude:
            lines.append(f"#SBATCH --exclude={','.join(sorted(self.exclude))}")
        lines += [f"#SBATCH {arg}" for arg in cfg.slurm_args if arg.startswith("-")]
        ids = serialize_service_proc_ids(alloc.service_ids)
        worker = f"{shlex.quote(cfg.python_exe)} -m meshrl.procs.slurm"
        lines += [
            # The run's CA, for the workers' certificates (`meshrl.procs.tls`): in the
            # script's environment, which only the job's user and SLURM's administrators
            # read, never on a command line.
            f"export {CA_ENV}={shlex.quote(run_ca().bundle())}",
            f"export MONARCH_SERVICE_PROC_IDS={shlex.quote(ids)}",
            f"export {PORT_ENV}={alloc.port} MESHRL_NODES_PER_RESTART={alloc.count}",
            # Notices for the controller, in the job's comment (it reads them with squeue).
            'notice() { scontrol update jobid="$SLURM_JOB_ID" comment="meshrl:$1:$(date +%s)"; }',
            "trap 'notice warning' USR1",
            "trap 'notice terminated' TERM",
            # --no-kill on the step too: a lost node ends its own worker, not the step
            # on the role's other nodes (whose workers were killed with it, and their
            # healthy nodes counted lost and quarantined).
            f"srun --no-kill --kill-on-bad-exit=0 {worker} &",
            "workers=$!",
            # `wait` returns at each trapped signal: wait again until the workers end.
            'while kill -0 "$workers" 2>/dev/null; do wait "$workers"; done',
        ]
        return "\n".join(lines) + "\n"

    def submit(self, name: str, count: int, role: str | None = None) -> Allocation:
        """Submit a job of `count` nodes for host mesh `name` (its role: `role`)."""
        from monarch._src.job.service_identity import allocate_service_proc_ids

        role = role or name
        alloc = Allocation(name, count, self._port(count))
        alloc.service_ids = allocate_service_proc_ids(count * RESTARTS)
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            out = subprocess.run(
                ["sbatch", "--parsable"],
                input=self.script(alloc, role),
                env=job_environment(),
                capture_output=True,
                text=True,
                timeout=60,
            )
        except FileNotFoundError:
            raise SlurmError(
                "config key 'job.kind': slurm needs SLURM's sbatch on this machine's PATH"
            ) from None
        if out.returncode != 0:
            reason = (out.stderr.strip().splitlines() or ["sbatch failed"])[-1]
            reason = reason.removeprefix("sbatch: error: ")
            raise SlurmError(
                f"config key '{blame(reason, role)}': SLURM refused the {name} job: {reason}"
            )
        alloc.job_id = out.stdout.strip().split(";")[0]
        self.jobs[name] = alloc
        logger.info("SLURM job %s submitted for %s (%d nodes)", alloc.job_id, name, count)
        return alloc

    # --- waiting ----------------------------------------------------------------------

    def wait_running(self, alloc: Allocation, timeout_s: float | None) -> None:
        """Return once the job runs and its workers listen; a job that cannot start
        (a pending reason that never clears, `job.job_start_timeout_s` passed, its
        workers gone) is cancelled and raises SlurmError in one line."""
        started, said = time.monotonic(), 0.0
        while True:
            info = query([alloc.job_id]).get(alloc.job_id)
            waited = time.monotonic() - started
            if info is None or info.state in GONE:
                state = info.state if info else "gone from the queue"
                self._fail(
                    alloc,
                    f"the {alloc.name} job {alloc.job_id} ended before it ran "
                    f"({state}){self._log_tail(alloc)}",
                    "job.slurm_args",
                )
            if info.state == RUNNING and info.nodelist:
                alloc.nodes = hostnames(info.nodelist)
                addresses = node_addresses(alloc.nodes)
                alloc.addresses = [addresses[n] for n in alloc.nodes]
                alloc.restarts = restarts(alloc.job_id)
                self._wait_listening(alloc, timeout_s)
                return
            if info.state == "PENDING" and info.reason in NEVER_CLEARS:
                self._fail(
                    alloc,
                    f"the {alloc.name} job {alloc.job_id} cannot start: "
                    f"SLURM's reason: {info.reason}",
                    reason_key(info.reason, alloc.name),
                )
            if timeout_s is not None and waited > timeout_s:
                self._fail(
                    alloc,
                    f"the {alloc.name} job {alloc.job_id} did not start within "
                    f"{timeout_s:g}s; SLURM's reason: {info.reason}",
                    "job.job_start_timeout_s",
                )
            if waited - said > 30:
                said = waited
                print(
                    f"waiting for SLURM to start the {alloc.name} job {alloc.job_id} "
                    f"({info.state}, {info.reason}) for {waited:.0f}s",
                    flush=True,
                )
            time.sleep(0.25)

    def _wait_listening(self, alloc: Allocation, timeout_s: float | None) -> None:
        """Each worker accepts connections (it booted), or the job ended."""
        deadline = time.monotonic() + max(120.0, timeout_s or 0)
        for i in range(len(alloc.addresses)):
            while not alloc.listening(i):
                info = query([alloc.job_id]).get(alloc.job_id)
                if info is None or info.state != RUNNING or time.monotonic() > deadline:
                    state = info.state if info else "gone from the queue"
                    self._fail(
                        alloc,
                        f"the {alloc.name} workers of job {alloc.job_id} did not "
                        f"start on {alloc.nodes[i]} ({state}){self._log_tail(alloc)}",
                        "job.python_exe",
                    )
                time.sleep(0.2)

    def _log_tail(self, alloc: Allocation) -> str:
        path = f"{self.log_dir}/slurm-{alloc.job_id}-{alloc.name}.out"
        with contextlib.suppress(OSError), open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
            if lines:
                return f": {lines[-1]} (log: {path})"
        return ""

    def _fail(self, alloc: Allocation, message: str, key: str) -> None:
        self.cancel(alloc.name)
        raise SlurmError(f"config key '{key}': {message}")

    # --- after the start ---------------------------------------------------------------

    def where(self) -> dict[str, dict]:
        """Each host mesh's SLURM job id and nodes."""
        return {name: {"job_id": a.job_id, "nodes": list(a.nodes)} for name, a in self.jobs.items()}

    def worker_alive(self, name: str, index: int) -> bool:
        """Worker `index` of the mesh's job listens (its node and job are up)."""
        alloc = self.jobs.get(name)
        return alloc is not None and index < len(alloc.addresses) and alloc.listening(index)

    def dead_nodes(self, name: str) -> list[str]:
        """Nodes of the mesh's job whose worker no longer listens."""
        alloc = self.jobs.get(name)
        if alloc is None:
            return []
        return [n for i, n in enumerate(alloc.nodes) if not self.worker_alive(name, i)]

    def requeued(self, name: str) -> bool:
        """SLURM requeued the mesh's job (preemption, `scontrol requeue`, a time limit
        handed back): it starts again by itself, as the same job."""
        alloc = self.jobs.get(name)
        if alloc is None or alloc.job_id is None:
            return False
        info = query([alloc.job_id]).get(alloc.job_id)
        if info is None or info.state in GONE:
            return False
        return info.state != RUNNING or restarts(alloc.job_id) != alloc.restarts

    def alive(self, name: str) -> bool:
        """The mesh's job runs, with the same restart count, and every worker listens."""
        alloc = self.jobs.get(name)
        info = query([alloc.job_id]).get(alloc.job_id) if alloc and alloc.job_id else None
        if info is None or info.state != RUNNING or restarts(alloc.job_id) != alloc.restarts:
            return False
        return not self.dead_nodes(name)

    def notices(self) -> dict[str, str]:
        """Host mesh -> the newest scheduler notice its job's batch script wrote
        (`meshrl:warning:TIME`: the time limit is near; `meshrl:terminated:TIME`:
        preempted, requeued or cancelled); meshes without one are left out."""
        by_id = {a.job_id: name for name, a in self.jobs.items() if a.job_id}
        return {
            by_id[job_id]: info.comment
            for job_id, info in query(list(by_id)).items()
            if info.comment.startswith("meshrl:")
        }

    def clear_notice(self, name: str) -> None:
        alloc = self.jobs.get(name)
        if alloc is not None and alloc.job_id:
            slurm("scontrol", "update", f"jobid={alloc.job_id}", "comment=", check=False)

    def requeue(self, name: str) -> None:
        """Hand the job back to the scheduler, which starts it again (a time limit's
        warning: the run goes on in a fresh allocation of the same job)."""
        slurm("scontrol", "requeue", self.jobs[name].job_id, check=False)

    def cancel(self, name: str) -> None:
        """End a mesh's job (the procs were stopped before, or are lost), not waiting
        for it to leave the queue: a job being replaced, whose lost node answers
        no signal (`end_jobs`)."""
        self.cancel_all([name], wait_s=0.0)

    def cancel_all(self, names: list[str] | None = None, wait_s: float = 5.0) -> None:
        """End the jobs of these meshes (default: all) together, waiting up to
        `wait_s` for them to leave the queue (`end_jobs`)."""
        names = list(self.jobs) if names is None else names
        allocs = [self.jobs.pop(n) for n in names if n in self.jobs]
        end_jobs([a.job_id for a in allocs if a.job_id is not None], wait_s)
        for alloc in allocs:
            for port in range(alloc.port, alloc.port + alloc.count * RESTARTS):
                self.ports_taken.discard(port)
            for hold in self.port_holds.pop(alloc.port, ()):
                hold.close()


END_SIGNAL = "HUP"
"""What ends a run's jobs: every process of the job (batch script, srun, workers,
procs) exits on it by default, and SLURM only signals it (see `end_jobs`)."""


def end_jobs(job_ids: list[str], wait_s: float = 5.0) -> None:
    """End these jobs so that they leave the queue within a second or so.

    A cancel (`scancel`, also `scancel --signal=KILL`: SLURM 22.05 turns it into a
    cancel) sends SIGTERM, which the workers ignore (for the checkpoint before a
    preemption), and SIGKILL only after KillWait (30 s by default): the jobs stayed
    COMPLETING that long. A plain signal is delivered at once: SIGHUP to every
    process of each job (`--full`: the batch script too) ends them, and the jobs
    complete. What is still queued after `wait_s` (a node that does not answer)
    is cancelled."""
    if not job_ids:
        return
    for job_id in job_ids:
        # A slurmctld that does not answer the signal in time (a loaded machine) leaves
        # the job to the plain cancel below, never the run's end to an error.
        with contextlib.suppress(subprocess.TimeoutExpired, SlurmError):
            slurm("scancel", f"--signal={END_SIGNAL}", "--full", job_id, check=False, timeout_s=10)
    deadline = time.monotonic() + wait_s
    left = set(job_ids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            queued = query(sorted(left))
        except SlurmError:
            break
        left = {j for j in left if j in queued and queued[j].state not in GONE}
        if all(queued[j].state == "PENDING" for j in left):  # signals reach no pending job
            break
    queued = query(sorted(left)) if left else {}
    for job_id in sorted(left):
        if job_id in queued and queued[job_id].state != "COMPLETING":  # (ending already)
            with contextlib.suppress(subprocess.TimeoutExpired, SlurmError):
                slurm("scancel", job_id, check=False)


def ephemeral_low() -> int:
    """The lowest port of this host's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(11000, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def _hold_ports(base: int, span: int) -> list[socket.socket] | None:
    """Claim ports base..base+span for this process against every other run on this
    host: one abstract unix socket per port (Linux; names only, no files), bound
    exclusively and released by the kernel when the process ends, however it ends.
    None when another process holds one of them. Elsewhere nothing is claimed and
    the listener check alone decides."""
    if not sys.platform.startswith("linux"):
        return []
    holds: list[socket.socket] = []
    try:
        for port in range(base, base + span):
            hold = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            holds.append(hold)
            hold.bind(f"\0meshrl-worker-port-{port}")
    except OSError:
        for hold in holds:
            hold.close()
        return None
    return holds


def _free_here(base: int, span: int) -> bool:
    """No listener on 127.0.0.1 at base..base+span (nodes that share this host)."""
    return all(port_free(port) for port in range(base, base + span))


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=2.0):
            return True
    except OSError:
        return False


def controller_transport(by_name: Any) -> Any:
    """Monarch's TCP transport by host name, or loopback where this host's name
    resolves to nothing else (Monarch would refuse it)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        infos = []
    routable = [
        i[4][0]
        for i in infos
        if not ipaddress.ip_address(i[4][0]).is_loopback
        and not ipaddress.ip_address(i[4][0]).is_link_local
    ]
    return by_name if routable else "tls://127.0.0.1:0"


# --- the Monarch job ---------------------------------------------------------------------


def job_environment() -> dict[str, str]:
    """The environment sbatch hands a role's job (`--export=ALL`): this process's,
    with the job's output files its user's only, and without this host's socket
    hook (`meshrl.procs.channels`): the batch script and srun need none, and each
    worker seals its own node's channels, in a directory of that node's."""
    env = dict(os.environ, SLURM_UMASK="0077")
    for name in (channels.DIR_ENV, channels.LIB_ENV):
        env.pop(name, None)
    library = os.environ.get(channels.LIB_ENV)
    preload = [p for p in env.pop("LD_PRELOAD", "").split() if p != library]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    return env


_ca: RunCA | None = None


def run_ca() -> RunCA:
    """This controller's run CA, made and installed for this process on first use (one
    per process: the hosts that join a run later must trust the same one)."""
    global _ca
    if _ca is None:
        ca = RunCA.create()
        ca.install([])
        _ca = ca
    return _ca


def make_job(
    cfg: Any, meshes: dict[str, int], cpu_meshes: set[str] | None = None, log_dir: str = LOG_DIR
) -> Any:
    """A Monarch job whose host meshes are SLURM allocations of their own
    (`Allocations`); those in `cpu_meshes` ask for no GPUs."""
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
    from monarch._rust_bindings.monarch_hyperactor.config import configure
    from monarch._src.actor.bootstrap import attach_to_workers
    from monarch._src.job.job import JobState, JobTrait

    # The workers dial this process back: by its host name, or on a cluster whose
    # nodes share this host (their NodeAddr loopback), at 127.0.0.1; over TLS with
    # the run's certificates, both ends checked.
    run_ca()
    configure(default_transport=controller_transport(ChannelTransport.Tls))

    class SlurmJob(JobTrait):
        def __init__(self) -> None:
            super().__init__()
            # (`quarantined`: the set itself, it grows)
            self.allocations = Allocations(cfg, log_dir, quarantined, cpu_meshes)
            self.meshes = dict(meshes)

        def _create(self, client_script: str | None) -> None:
            if client_script is not None:
                raise RuntimeError("meshrl's SLURM job runs no batch-mode client")
            try:
                for name, count in self.meshes.items():
                    self.allocations.submit(name, count)
            except BaseException:
                self.allocations.cancel_all()
                raise

        def host_mesh(self, name: str) -> Any:
            alloc = self.allocations.jobs[name]
            self.allocations.wait_running(alloc, cfg.job_start_timeout_s)
            return attach_to_workers(name=name, ca="trust_all_connections", workers=alloc.workers())

        def _state(self) -> Any:
            try:
                return JobState({name: self.host_mesh(name) for name in self.meshes})
            except BaseException:
                self.allocations.cancel_all()
                raise

        def reallocate(self, name: str) -> Any:
            """A new allocation for host mesh `name` (the old one cancelled; a job that
            SLURM requeued is waited for instead), attached; its host mesh."""
            dead = self.allocations.dead_nodes(name)
            if self.allocations.requeued(name):
                # SLURM requeues a job whose node failed, too: count that node, not
                # those of a preemption or a requeue (healthy, only their job ended).
                note_lost(unhealthy(dead))
                self.allocations.clear_notice(name)
                return self.host_mesh(name)
            note_lost(dead)
            self.allocations.cancel(name)
            self.allocations.submit(name, self.meshes[name])
            return self.host_mesh(name)

        def host_alive(self, name: str, index: int) -> bool:
            return self.allocations.worker_alive(name, index)

        def can_run(self, spec: Any) -> bool:
            return False  # never reused from a cache: each run submits its own

        def _kill(self) -> None:
            self.allocations.cancel_all()

    return SlurmJob()


# --- the worker on each node -------------------------------------------------------------


def serve() -> None:
    """One Monarch worker on this node (run by srun in a meshrl SLURM job)."""
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
    from monarch._rust_bindings.monarch_hyperactor.config import configure
    from monarch._src.job.service_identity import deserialize_service_proc_ids, service_proc_addr
    from monarch.actor import run_worker_loop_forever

    # The same layout as `Allocation.slot`, from what SLURM tells this node.
    rank = int(os.environ["SLURM_NODEID"])
    count = int(os.environ["MESHRL_NODES_PER_RESTART"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0")) % RESTARTS
    index = restart * count + rank
    node = os.environ["SLURMD_NODENAME"]
    addr = node_addresses([node])[node]
    port = int(os.environ[PORT_ENV]) + index
    ids = deserialize_service_proc_ids(os.environ["MONARCH_SERVICE_PROC_IDS"])
    # SLURM's SIGTERM (preemption, requeue) must not end the procs before the
    # controller wrote its checkpoint; its SIGKILL after KillWait/GraceTime does.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Private channels on this node too, and this node's certificate from the run's
    # CA (handed over in the job's environment, then dropped from it).
    channels.seal()
    ca = RunCA.from_bundle(os.environ.pop(CA_ENV))
    ca.install([node, addr])
    configure(default_transport=controller_transport(ChannelTransport.Tls))
    print(f"meshrl worker on {node} at tls://{addr}:{port}", flush=True)
    run_worker_loop_forever(
        address=service_proc_addr(f"tls://{addr}:{port}", ids[index]),
        ca="trust_all_connections",
    )


if __name__ == "__main__":
    serve()
    sys.exit(0)
