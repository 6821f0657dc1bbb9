"""The preflight of a run's allocations (`health.preflight`), as the controller runs
it: `HostChecks.run(roles)` after those roles' procs started and before any of
their actors, at the start and for each allocation a recovery makes. The checks
themselves, and how figures are judged, are in `meshrl.procs.health`.

A host that fails a check, or whose figures fall below `health.min_ratio` of the
median, is quarantined: one console line naming it with its figures, the same
with every figure in faults.log, listed under `quarantined` in status.json. On
SLURM its role gets a new allocation excluding it (`--exclude`), checked in turn;
on one machine (`local`, `process`) and when no allocation is left, the run
refuses to start in one line naming the host and the check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from meshrl.config.files import ConfigError
from meshrl.observe.status import brief
from meshrl.procs.faultlog import log_fault

logger = logging.getLogger(__name__)

TRIES = 3
"""New allocations asked for one role's failing hosts before the run refuses."""
RDMA_BYTES = 4 << 20
COLLECTIVE_BYTES = 4 << 20


class HostChecks:
    """The preflight of `meshes` (a `RoleMeshes`), with `spec` (a
    `meshrl.procs.health.Spec`: the model's dtype, the run directory, the
    checkpoint's size). `figures` (host -> figures), `quarantined` and `seconds`
    (each preflight's wall time) are what status.json shows."""

    def __init__(self, meshes: Any, spec: Any = None, health: Any = None):
        from meshrl.procs.health import Spec, versions

        self.meshes = meshes  # (`RoleMeshes` sets itself here)
        self.health = health  # `meshrl.config.health.HealthConfig`
        self.spec = spec if spec is not None else Spec()
        self.controller = versions()
        self.figures: dict[str, dict] = {}
        self.quarantined: dict[str, str] = {}  # host -> the finding's line
        self.seconds: list[dict] = []  # per preflight: hosts, seconds
        self.baseline: dict[str, float] | None = None
        self.actors: dict[str, Any] = {}  # role -> its Preflight actors (RDMA peers later)
        self.lock = threading.Lock()

    # --- running ----------------------------------------------------------------------

    def run(self, roles: list[str]) -> None:
        """Check the hosts of `roles` (those with hosts of their own), replacing or
        refusing those that fail."""
        roles = [r for r in roles if r not in self.meshes.beside and r in self.meshes.by_role]
        if self.meshes.job_cfg.kind == "local":  # one host: checked once, by the first role
            roles = roles[:1] if not self.figures else []
        for _ in range(TRIES):
            if not roles:
                return
            findings = self.check(roles)
            if not findings:
                return
            roles = self.replace(findings)
        raise ConfigError(
            f"config key 'health.min_ratio': {TRIES} allocations in a row had hosts failing "
            f"the preflight; the last: {findings[0].line()}"
        )

    def _hosts_of(self, role: str) -> dict[str, int]:
        """Host name -> the rank of its first proc of `role`."""
        meshes, first = self.meshes, {}
        if role in meshes.elastic:
            group = meshes.by_role[role]
            for rank, member in enumerate(group.members):
                first.setdefault(member.host, rank)
            return {f"{role}/{host}": rank for host, rank in first.items()}
        per_host = meshes.counts[role]
        return {f"{role}/{h}": h * per_host for h in range(meshes.hosts[role])}

    def check(self, roles: list[str]) -> list:
        """Run the checks on every host of `roles` at once; the findings (each host
        named by its SLURM node, else its host name and role)."""
        from meshrl.procs.health import RATED, judge, medians_of
        from meshrl.procs.mesh import wait
        from meshrl.procs.preflight_actor import Preflight

        meshes, spec = self.meshes, self.spec
        if meshes.job_cfg.kind == "local":
            spec = type(spec)(**{**vars(spec), "matmul_s": min(spec.matmul_s, 0.05)})
        started = time.monotonic()
        firsts: dict[str, tuple[str, int, Any]] = {}  # key -> (role, rank, its actor)
        for role in roles:
            actors = meshes.spawn(role, "preflight", Preflight)
            self.actors[role] = actors
            for key, rank in self._hosts_of(role).items():
                firsts[key] = (role, rank, actors.slice(procs=rank))
        timeout = max(60.0, 20 * spec.matmul_s)
        asked = {key: actor.check.call_one(spec) for key, (_, _, actor) in firsts.items()}
        answers = {
            key: wait(f, f"{key.split('/')[0]}.preflight", timeout) for key, f in asked.items()
        }
        figures = {key: a["figures"] for key, a in answers.items()}
        failures = {key: list(a["failures"]) for key, a in answers.items()}
        if meshes.job_cfg.kind != "local":
            self._rdma(firsts, figures, failures, timeout)
            for role in roles:
                self._collective(role, figures, failures, timeout)
        # Hosts named as a user knows them: SLURM's node, else the host's name.
        named = {key: self._name(key, figures[key]) for key in figures}
        by_name = {named[k]: {**figures[k], "role": k.split("/")[0]} for k in figures}
        failed = {named[k]: v for k, v in failures.items() if v}
        # A `process` job's hosts are this machine's subprocesses: their figures differ
        # only by who else computes at that moment, so only failures count there.
        rated = meshes.job_cfg.kind not in ("local", "process")
        ratio = self.health.min_ratio if rated else 0.0
        findings = judge(by_name, failed, ratio, self.baseline, self.controller)
        took = time.monotonic() - started
        with self.lock:
            self.figures.update(by_name)
            self.seconds.append({"hosts": len(by_name), "s": round(took, 3)})
        bad = {f.host for f in findings}
        good = {h: f for h, f in by_name.items() if h not in bad}
        if good and self.baseline is None:  # what later allocations are judged against
            self.baseline = {**medians_of(good), "hosts": len(good)}
            for key in RATED:
                values = [f[key] for f in good.values() if key in f]
                if len(values) == 1:
                    self.baseline[key] = values[0]
        log_fault(
            f"preflight of {len(by_name)} host(s) ({', '.join(roles)}) in {took:.2f}s: "
            + "; ".join(f"{h}: {brief(f)}" for h, f in by_name.items())
        )
        return findings

    def joined(self, role: str, spawn_proc: Any, host: Any) -> str | None:
        """The preflight of one host that joins `role` after the start (a pool that
        grows, a one-node job in place of a lost node; `host`: a
        `meshrl.procs.pool.Host`), on a proc of its own (`spawn_proc(mesh, slot)`,
        stopped after): its checks and an RDMA read from a host checked before,
        judged against the first allocation's medians. The finding's line (the host
        quarantined, and excluded from SLURM's next allocations), or None."""
        from meshrl.procs.health import judge
        from meshrl.procs.mesh import wait
        from meshrl.procs.preflight_actor import Preflight

        started, key = time.monotonic(), f"{role}/joined"
        procs = spawn_proc(host.mesh, 0)
        try:
            actor = procs.spawn("preflight", Preflight)
            timeout = max(60.0, 20 * self.spec.matmul_s)
            answer = wait(actor.check.call_one(self.spec), f"{role}.preflight", timeout)
            figures, failures = {key: answer["figures"]}, {key: list(answer["failures"])}
            self._rdma({key: (role, 0, actor)}, figures, failures, timeout)
        finally:
            with contextlib.suppress(BaseException):
                procs.stop().get(timeout=10.0)
        name = self._name(key, figures[key])
        by_name = {name: {**figures[key], "role": role}}
        rated = self.meshes.job_cfg.kind not in ("local", "process")
        ratio = self.health.min_ratio if rated else 0.0
        failed = {name: failures[key]} if failures[key] else {}
        findings = judge(by_name, failed, ratio, self.baseline, self.controller)
        took = time.monotonic() - started
        with self.lock:
            self.figures.update(by_name)
            self.seconds.append({"hosts": 1, "s": round(took, 3)})
        log_fault(
            f"preflight of a host joining {role} in {took:.2f}s: {name}: {brief(by_name[name])}"
        )
        if not findings:
            return None
        self._quarantine(findings)
        return findings[0].line()

    def _name(self, key: str, figures: dict) -> str:
        return figures.get("node") or (
            figures.get("host", "?")
            if self.meshes.job_cfg.kind == "local"
            else f"{figures.get('host', '?')}:{key}"
        )

    def _rdma(self, firsts: dict, figures: dict, failures: dict, timeout: float) -> None:
        """Each host reads an RDMA buffer of the next host (of these, or of a role
        checked before when there is only one here)."""
        from meshrl.procs.mesh import RemoteCallError, wait

        keys = list(firsts)
        peers = [firsts[k][2] for k in keys]
        if len(keys) == 1:
            others = [a for r, a in self.actors.items() if r != firsts[keys[0]][0]]
            if not others:
                return
            peers.append(others[0].slice(procs=0))
        try:
            buffers = [
                wait(p.buffer.call_one(RDMA_BYTES), "preflight.buffer", timeout) for p in peers
            ]
        except RemoteCallError as error:
            logger.warning("preflight: no RDMA buffer: %s", error)
            return
        # Each host reads from the next two (where there are): a read is as slow as
        # the slower end, and its best read is what a slow peer cannot spoil.
        for i, key in enumerate(keys):
            sources = {(i + k) % len(buffers) for k in (1, 2)} - {i} or {(i + 1) % len(buffers)}
            reader, best, failed = firsts[key][2], None, None
            for source in sorted(sources):
                try:
                    what = f"{key}.preflight.read"
                    got = wait(reader.read.call_one(buffers[source], RDMA_BYTES), what, timeout)
                except RemoteCallError as error:
                    got = {"failure": f"rdma: {error}"}
                if "failure" in got:
                    failed = got["failure"]
                elif best is None or got["rdma_gb_s"] > best:
                    best = got["rdma_gb_s"]
            if best is not None:
                figures[key]["rdma_gb_s"] = best
            elif failed:
                failures[key].append(failed)

    def _collective(self, role: str, figures: dict, failures: dict, timeout: float) -> None:
        """An all-reduce among the role's procs (more than one, not elastic: those
        form no process group); each host's figure is its slowest proc's."""
        from meshrl.procs.mesh import RemoteCallError, gather, start_each

        meshes = self.meshes
        size = meshes.size(role)
        if role in meshes.elastic or size < 2:
            return
        master = meshes.rendezvous(role)
        args = [(master, rank, size, COLLECTIVE_BYTES) for rank in range(size)]
        try:
            results = gather(
                start_each(self.actors[role], "collective", args), f"{role}.preflight", timeout
            )
        except RemoteCallError as error:
            results = [{"failure": f"collective: {error}"}] * size
        per_host = meshes.counts[role]
        for rank, got in enumerate(results):
            key = f"{role}/{rank // per_host}"
            if key not in figures:
                continue
            if "failure" in got:
                if got["failure"] not in failures[key]:
                    failures[key].append(got["failure"])
                continue
            for name, value in got.items():
                figures[key][name] = min(value, figures[key].get(name, value))

    # --- after a finding --------------------------------------------------------------

    def replace(self, findings: list) -> list[str]:
        """Quarantine the hosts of `findings`; on SLURM, new allocations for their
        roles, excluding them (the roles to check again); elsewhere the one line
        refusing the run."""
        meshes = self.meshes
        roles = []
        for finding in findings:
            role = self.figures.get(finding.host, {}).get("role")
            if role and role not in roles:
                roles.append(role)
        self._quarantine(findings)
        if meshes.job_cfg.kind != "slurm":
            # One machine (or a scheduler meshrl cannot ask to exclude a host): nothing to
            # replace it with.
            raise ConfigError(
                f"config key 'health.preflight': {findings[0].line()}; no other host to "
                "replace it (health.preflight=false skips the checks)"
            )
        from meshrl.procs.slurm_queue import SlurmError

        for role in roles:
            try:
                self.reallocate(role)
            except SlurmError as error:
                raise ConfigError(
                    f"config key 'health.preflight': {findings[0].line()}; no allocation "
                    f"without it could be had ({error})"
                ) from None
        return roles

    def _quarantine(self, findings: list) -> None:
        """Each finding's host quarantined: one console line with its figures, the
        same with every figure in faults.log, and its SLURM node excluded from the
        run's allocations from now on."""
        from meshrl.procs import slurm_faults

        for finding in findings:
            figures = self.figures.get(finding.host, {})
            line = f"preflight: {finding.line()}"
            if finding.host not in self.quarantined:
                self.quarantined[finding.host] = line
                log_fault(f"{line}; quarantined. Its figures: {figures}")
                print(f"{line}; quarantined ({brief(figures)})", flush=True)
            if figures.get("node"):
                slurm_faults.quarantined.add(figures["node"])

    def reallocate(self, role: str) -> None:
        """`role`'s procs (and those of the roles beside it) stopped, its SLURM job
        cancelled and submitted again excluding the quarantined nodes, its procs
        spawned there."""
        meshes = self.meshes
        again = [role, *[r for r, host in meshes.beside.items() if host == role]]
        for name in again:
            old = meshes.by_role.pop(name, None)
            meshes.watches.pop(name, None)
            meshes.pids.pop(name, None)
            if old is None:
                continue
            with contextlib.suppress(BaseException):
                if name in meshes.elastic:
                    old.close()
                else:
                    old.stop().get(timeout=10.0)
        meshes._hosts[role] = meshes.job.reallocate(role)
        for name in again:
            if name in meshes.counts:
                meshes._spawn_procs(name)

    def status(self) -> dict:
        """For status.json: each host's figures, the quarantined hosts, the time taken."""
        with self.lock:
            return {
                "preflight": {"hosts": dict(self.figures), "runs": list(self.seconds)},
                "preflight_quarantined": dict(self.quarantined),
            }


# --- hung procs ----------------------------------------------------------------------


def slurm_place(meshes: Any, role: str, rank: int) -> tuple[str, str] | None:
    """(job id, node) of proc `role[rank]` on a SLURM job, or None."""
    if meshes.job_cfg.kind != "slurm" or meshes.job is None:
        return None
    allocations = meshes.job.allocations
    if role in meshes.elastic:
        group = meshes.by_role.get(role)
        if group is None or rank >= len(group.members):
            return None
        index = group.members[rank].host
        host = group.hosts[index]
        if host.job is not None:  # a joined host: a one-node job of its own
            alloc = next(iter(host.job.allocations.jobs.values()), None)
            return (alloc.job_id, alloc.nodes[0]) if alloc and alloc.nodes else None
    else:
        index = rank // meshes.counts[role]
    alloc = allocations.jobs.get(meshes.beside.get(role, role))
    if alloc is None or index >= len(alloc.nodes):
        return None
    return alloc.job_id, alloc.nodes[index]


def on_hang(
    meshes: Any, python: str, role: str, rank: int, pid: int | None, host: str, silent_s: float
) -> None:
    """A proc of `role` answered no heartbeat for `silent_s`: its stacks (on its
    host: here, or a SLURM job step on its node) into faults.log, the proc killed,
    one console line, and the proc entered as lost for every role in its procs, so
    the call waiting on it fails now and the Supervisor replaces it."""
    import socket
    import subprocess

    from meshrl.procs import proc_pool
    from meshrl.procs.health import hung_line, log_hang, take_stacks
    from meshrl.procs.slurm import job_environment

    if pid is not None and host == socket.gethostname() and not proc_pool.alive(pid):
        return  # it died (a loss, not a hang): its loss's own path replaces it
    place = slurm_place(meshes, role, rank)
    remote = None
    if place is not None:
        job_id, node = place

        def remote(pid: int) -> str:
            done = subprocess.run(
                [
                    "srun",
                    "--overlap",
                    f"--jobid={job_id}",
                    f"--nodelist={node}",
                    "-N1",
                    "-n1",
                    "--quiet",
                    python,
                    "-m",
                    "meshrl.procs.health",
                    "dump",
                    str(pid),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env=job_environment(),
            )
            if done.returncode != 0:
                raise RuntimeError((done.stderr.strip().splitlines() or ["srun failed"])[-1])
            return done.stdout.strip()

        host = f"{host} (SLURM node {node})"
    stacks = take_stacks(pid, host.split(" ")[0], remote)
    line = hung_line(role, rank, silent_s, pid, host)
    log_hang(line, stacks)
    print(line, flush=True)
    now = time.monotonic()
    for name in meshes.roles:
        if meshes.share.get(name, name) == role:
            proc_pool.lost.setdefault(f"{name}[{rank}]", now)
