"""Weight-sync bookkeeping on the controller: the version, its handle, the pulls
in flight, and waiting for them before the next publish.

    handle = sync.publish(trainer)   # trainer.publish: each owning rank writes a slot
    sync.pull(policy, handle)        # policy.load_weights: shm on this host, RDMA across

The bytes move between the actors (`meshrl.weights.publisher`); this object only says
when, and from where. Replicas on the trainer's host copy out of its shared
memory. The others form a relay tree (`plan`, fan-out `weights.fanout`): only
its first level reads from the trainer; each replica that has pulled a
version serves it to up to `fanout` others from its own slots, and a
replica's host-mates copy it out of that replica's shared memory. So the
trainer's egress per publish is at most `fanout` copies of the model, however
many replicas there are. A relay lost on the way is routed around: its
children pull from its own source instead, the step goes on, and the
supervisor replaces the lost proc afterwards. `fanout: 0` is the star: every
replica reads from the trainer.

With `wait=False` (`max_staleness > 0`) a one-level pull is not waited for:
each replica takes the new version after the generation it is running, and
the loop goes on. (A tree's levels wait for each other: a relay serves only
what it holds.) Pulls are waited for before the next publish, which keeps
the slot a replica may still read intact (double buffering), and a replica
lost on the way is replaced by the supervisor (its catch-up pulls the newest
version).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.config import ConfigError
from meshrl.loop.run import Role
from meshrl.procs import proc_pool
from meshrl.procs.mesh import RemoteCallError, RoleLost, log_fault, wait
from meshrl.weights.publisher import WeightHandle
from meshrl.weights.receiver import Pulled

SOURCE_CHECK_S = 0.5
"""How often a pull's wait looks whether its source was seen gone (`_wait_pull`)."""


@dataclass
class WeightsConfig:
    """How published weights reach the policy replicas (meshrl/loop/weight_sync.py)."""

    fanout: int = 2
    """Relay tree fan-out: off the trainer's hosts, each replica that has pulled a
    version serves it to up to this many others, so only `fanout` replicas read
    from the trainer. 0: every replica reads from the trainer (a star). Replicas
    on the trainer's host always copy from its shared memory; with one replica,
    or `fanout` or fewer off the trainer's host, nothing relays (one level)."""
    relay_timeout_s: int = 30
    """Seconds a replica's RDMA reads from a relay may take before that relay
    counts as lost and the replica pulls from the relay's own source instead."""
    verify: bool = True
    """Each published version carries a checksum per parameter (shard), taken by
    the trainer; every replica checks its parameters against them after each
    pull, and a mismatch, or a replica on another version, stops the run
    naming the replica and the version. Costs a read of the model on each
    side (benchmarks/weight_sync.py measures it)."""
    delta: bool = False
    """Delta sync: the trainer compares each parameter (shard) byte for byte with
    the version it published last and writes only what changed; a replica that
    holds an earlier version of it reads only the pieces changed since (RDMA) or
    copies only those (shared memory), and a new replica, or one whose last pull
    failed, takes all. Lossless: every piece is checked against the trainer's
    checksums as before. Pays off when few parameters change (LoRA, frozen
    parts); with full fine-tuning the comparison costs a read of the model on
    the trainer. `weights/bytes_moved` is logged either way."""

    def validate(self) -> None:
        if self.fanout < 0:
            raise ConfigError(
                "config key 'weights.fanout': must be >= 0 (0: every replica reads the trainer)"
            )
        if self.relay_timeout_s <= 0:
            raise ConfigError("config key 'weights.relay_timeout_s': must be > 0")


class WeightSyncError(RuntimeError):
    """A replica does not serve the version it pulled (one line, naming it)."""


Level = list[tuple[int, int | None]]
"""One level of a relay tree: (replica rank, the rank it pulls from; None: the trainer)."""


def plan(hosts: list[str | None], source_hosts: set[str], fanout: int) -> list[Level]:
    """The relay tree for replicas whose hosts are `hosts` (None: not known yet),
    as levels to pull in order.

    Level 1: every replica on a trainer host (shared memory) and the first
    `fanout` of the others; each replica of a later level pulls from one of
    the level before. Off the trainer's hosts one replica per host (its
    leader) joins the tree; the leader's host-mates pull from it (shared
    memory) one level below it. `fanout` 0: everyone pulls from the trainer.
    """
    if fanout <= 0:
        return [[(rank, None) for rank in range(len(hosts))]]
    first: Level = []
    leaders: list[int] = []
    mates: dict[int, list[int]] = {}  # leader -> its host-mates
    leader_of: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        if host is not None and host in source_hosts:
            first.append((rank, None))
        elif host is not None and host in leader_of:
            mates[leader_of[host]].append(rank)
        else:
            leaders.append(rank)
            mates[rank] = []
            if host is not None:
                leader_of[host] = rank
    # Leader i pulls from the trainer (i < fanout) or from leader i // fanout - 1:
    # a complete fanout-ary tree, breadth first, so every level is as full as can be.
    depth = {}
    levels: list[Level] = [first]
    for i, rank in enumerate(leaders):
        parent = None if i < fanout else leaders[i // fanout - 1]
        depth[rank] = 0 if parent is None else depth[parent] + 1
        while len(levels) <= depth[rank] + 1:
            levels.append([])
        levels[depth[rank]].append((rank, parent))
        levels[depth[rank] + 1].extend((mate, rank) for mate in mates[rank])
    return [level for level in levels if level]


class WeightSync:
    def __init__(
        self,
        supervisor: Any,
        wait: bool = True,
        fanout: int = 0,
        relay_timeout_s: int = 30,
        verify: bool = True,
        delta: bool = False,
        before_pull: Callable[[], None] | None = None,
    ):
        self.sup = supervisor
        self.wait_each = wait
        self.fanout = fanout
        self.relay_timeout_s = relay_timeout_s
        self.verify = verify
        self.delta = delta
        self.bytes_moved = 0  # bytes copied or read into the replicas, last pull
        self.replica_bytes = 0  # one version's bytes in the replicas' precision, last pull
        self.verified = 0  # replicas whose parameters matched the checksums, last pull
        self.handle: WeightHandle | None = None
        self.serving: WeightHandle | None = None
        """What the replicas were last sent (`pull`): a replacement takes it, not a
        version published since and not pulled yet (work by pull generates the
        groups drawn before a pull with the version they were drawn at)."""
        self.published = 0  # versions published by this controller
        self.published_at: dict[int, int] = {}  # trainer version -> which publish it was
        self.paths: list[str] = []  # 'shm' or 'rdma', per replica, of the last pull
        self.egress_bytes = 0  # bytes read from the trainer's procs over RDMA, last pull
        self.depth = 0  # hops from the trainer to the farthest replica, last pull
        self.rerouted = 0  # pulls that went to another source, their relay lost
        self._hosts: dict[int, str] = {}  # replica rank -> host
        self._hosts_of: tuple = ()  # (respawns, resizes) of the mesh those hosts are of
        self._pulls: tuple[Any, Role, int] | None = None
        self._sending = threading.RLock()
        self.source: Role | None = None  # the trainer role of the newest publish
        self.before_pull: Callable[[], None] = before_pull or (lambda: None)
        """Runs as `pull` begins: what was sent with the old weights is handed out
        first (work by pull: `meshrl.loop.dispatch.Dispatcher.hand_out`)."""

    @property
    def version(self) -> int:
        return self.handle.version if self.handle is not None else -1

    def publish(self, trainer: Role) -> WeightHandle:
        """Wait for the pulls in flight, then `trainer.publish` on every rank (the
        ranks that own weights write them); returns the merged handle."""
        self.wait()
        for attempt in range(2):
            try:
                handle = self._publish_on(trainer)
                break
            except RemoteCallError as error:
                # A trainer proc lost here, not in its train step (a SLURM job killed
                # after its checkpoint): healed from its peers and published again, or
                # `RoleLost`, and the loop rewinds to the checkpoint.
                if not error.proc_lost or attempt:
                    raise
                self.sup.recover(trainer, error, heal=True)
        self.handle = handle
        self.source = trainer
        self.published += 1
        self.published_at[self.handle.version] = self.published
        for old in [v for v in self.published_at if v < self.handle.version - 64]:
            del self.published_at[old]  # (only versions still under way are asked)
        return self.handle

    def republish(self, trainer: Role) -> None:
        """After `trainer` was healed (`Supervisor.heal`): its new procs publish the
        version the replicas hold, so a replica replaced later pulls it from there.
        Not a new version: nothing is pulled, no count moves."""
        if self.handle is None or self.source is not trainer:
            return
        served = self.serving is not None and self.serving.version == self.handle.version
        self.handle = self._publish_on(trainer)
        # An older version served lived in the replaced procs' slots: gone.
        self.serving = self.handle if served else None

    def _publish_on(self, trainer: Role) -> WeightHandle:
        """`trainer.publish` on every rank, the owners' handles merged."""
        handles = self.sup.call_all(trainer, "publish", self.verify, self.delta)
        return WeightHandle.merge(handles)

    def pull(self, replicas: Role, handle: WeightHandle | None = None) -> None:
        """Every replica of `replicas` pulls `handle` (the newest by default): all
        at once from the trainer when the tree has one level (waited for unless
        this sync runs ahead, `wait=False`), else level by level."""
        self.before_pull()
        self.wait()
        with self._sending:  # not between a recovery's catch-up send and its check
            self.serving = handle or self.handle
            future = self._send(replicas, self.serving)
            # Standbys (`faults.standby`) take each version too, unwaited: one that is
            # still booting takes it late, and the pull as it replaces a replica makes sure.
            for spare in getattr(getattr(replicas, "actors", None), "spares", list)():
                spare.load_weights.call_one(handle or self.handle)
        if future is not None:
            self._pulls = (future, replicas, replicas.respawns)
            if self.wait_each:
                self.wait()

    def catch_up(self, replicas: Role) -> None:
        """A respawned replica mesh takes the version the replicas were last sent
        (`serving`), now. (A recovery in the pull queue's thread may run it while the
        loop sends a pull: the two take turns, `_sending`.)"""
        with self._sending:
            self._pulls = None
            future = self._send(replicas, self.serving or self.handle)
            if future is not None:
                self._collect(future, replicas)

    @classmethod
    def from_config(
        cls,
        supervisor: Any,
        cfg: WeightsConfig,
        wait: bool = True,
        before_pull: Callable[[], None] | None = None,
    ) -> WeightSync:
        return cls(
            supervisor, wait, cfg.fanout, cfg.relay_timeout_s, cfg.verify, cfg.delta, before_pull
        )

    def _send(self, replicas: Role, handle: WeightHandle) -> Any | None:
        """A relay tree is pulled now, level by level (None); one level is one call
        to the whole mesh, returned as its future."""
        try:
            levels = self.plan(replicas, handle)
        except RemoteCallError as error:  # a replica lost before its host was known
            if not error.proc_lost:
                raise
            self.sup.recover(replicas, error)  # its catch-up pulls the version
            return None
        if len(levels) == 1:
            return replicas.load_weights.call(handle)
        self._pull_tree(replicas, handle, levels)
        return None

    def plan(self, replicas: Role, handle: WeightHandle) -> list[Level]:
        """This pull's tree over `replicas` (`plan`). Their hosts are asked once per
        mesh (`host_id`), when a tree is possible, so that host-mates are never
        made relays of each other; a respawned or grown mesh is asked again."""
        of = (replicas.respawns, getattr(replicas, "resizes", 0))
        if self._hosts_of != of:
            self._hosts, self._hosts_of = {}, of
        size = replicas.size
        if 0 < self.fanout < size and len(self._hosts) < size:
            answers = self.sup.wait(replicas.host_id.call(), f"{replicas.name}.host_id")
            self._hosts = dict(enumerate(host for _, host in answers.items()))
        hosts = [self._hosts.get(rank) for rank in range(size)]
        return plan(hosts, {s.host for s in handle.sources}, self.fanout)

    def wait(self) -> None:
        """Until every replica serves the newest version; a replica lost on the
        way is replaced (and pulls it then)."""
        pulls, self._pulls = self._pulls, None
        if pulls is None:
            return
        future, replicas, respawns = pulls
        for attempt in range(2):
            try:
                self._collect(future, replicas)
                return
            except RoleLost:  # the source's (a trainer proc seen gone): not a replica's loss
                raise
            except RemoteCallError as error:
                if not error.proc_lost and not attempt and "timed out" in str(error):
                    # A transfer that timed out (RDMA's TCP fallback): its source may
                    # be dying before supervision says so (a SLURM job's kill). Pull
                    # once more: it completes, or the loss surfaces and is handled.
                    log_fault(f"{replicas.name}.load_weights timed out, pulling again: {error}")
                    if self.source is not None:
                        # Its source lost with its node: the reads wait out the
                        # transport's timeout, by when supervision knows. Asked
                        # now, the loss surfaces (the loop goes back to its
                        # checkpoint) instead of a second pull from the dead procs.
                        self.sup.check_alive(self.source)
                    future = self._send(replicas, self.handle)
                    if future is None:
                        return
                    continue
                if not error.proc_lost:
                    raise
                if respawns == replicas.respawns:  # else: replaced (and caught up) since
                    self.sup.recover(replicas, error)
                return

    def _wait_pull(self, future: Any, what: str) -> Any:
        """A pull's answer, as `Supervisor.wait`; and when its source's procs are seen
        gone meanwhile (a SLURM node lost: `proc_pool.lost`), their loss is handled at
        once (`check_alive`). The reads from them would wait out the transport's own
        timeout first: two minutes on RDMA's TCP fallback, seen on SLURM."""
        source = self.source
        if source is None:
            return self.sup.wait(future, what)
        deadline = time.monotonic() + self.sup.timeout_s
        while True:
            try:
                return wait(future, what, SOURCE_CHECK_S)
            except RemoteCallError as error:
                if not error.timed_out:
                    raise
            if time.monotonic() > deadline:
                timeout = self.sup.timeout_s
                raise RemoteCallError(
                    f"{what} did not answer within {timeout:g}s", what, timed_out=True
                )
            if proc_pool.lost and proc_pool.is_lost(source.name):  # any rank of it
                self.sup.check_alive(source)  # raises: the source's loss, recovered there

    def _collect(self, future: Any, replicas: Role) -> None:
        answers = self._wait_pull(future, f"{replicas.name}.load_weights").items()
        pulled = dict(enumerate(value for _, value in answers))  # in rank order
        self._account(pulled, {rank: 1 for rank in pulled}, set(pulled), replicas.name)

    def _pull_tree(self, replicas: Role, handle: WeightHandle, levels: list[Level]) -> None:
        """Pull level by level, each replica from its parent's relay handle. A
        parent lost before its children pulled, or under them, is routed around:
        they pull from its source (up to the trainer). A proc lost on the way is
        replaced once the tree is done (its catch-up pulls the version)."""
        serving = {parent for level in levels for _, parent in level if parent is not None}
        served: dict[int | None, WeightHandle] = {None: handle}  # rank -> its relay handle
        source_of: dict[int, int | None] = {}  # rank -> the rank it pulled from
        pulled: dict[int, Pulled] = {}
        depth: dict[int | None, int] = {None: 0}
        lost: RemoteCallError | None = None
        what = f"{replicas.name}.load_weights"
        for number, level in enumerate(levels):
            started = []
            for rank, parent in level:
                source = self._live(parent, served, source_of)
                started.append((rank, source, self._start(replicas, rank, served, source, serving)))
            for rank, source, future in started:
                while True:
                    try:
                        pulled[rank] = self._wait_pull(future, f"{what}[{rank}]")
                        break
                    except RoleLost:  # the trainer's, seen while waiting: not this replica's
                        raise
                    except RemoteCallError as error:
                        if error.proc_lost:  # this replica is gone: its children go around it
                            lost = lost or error
                            break
                        if source is None:  # the trainer's own slots failed: a real error
                            raise
                        # Its source was lost under it: again from that source's source,
                        # and no one else is sent to that relay.
                        log_fault(f"relay {replicas.name}[{source}] failed {rank}'s pull: {error}")
                        served.pop(source, None)
                        source = self._live(source, served, source_of)
                        future = self._start(replicas, rank, served, source, serving)
                source_of[rank] = source
                if rank in pulled:
                    depth[rank] = depth[source] + 1
                    if pulled[rank].relay is not None:
                        served[rank] = pulled[rank].relay
            self.after_level(number, replicas)
        self._account(pulled, depth, {r for r, s in source_of.items() if s is None}, replicas.name)
        if lost is not None:
            self.sup.recover(replicas, lost)

    def _live(self, parent: int | None, served: dict, source_of: dict) -> int | None:
        """`parent`, or, when it serves nothing (lost, or it failed a pull), the
        nearest source above it that does (None: the trainer)."""
        source = parent
        while source is not None and source not in served:
            source = source_of.get(source)
        if source != parent:
            self.rerouted += 1
        return source

    def _start(
        self, replicas: Role, rank: int, served: dict, source: int | None, serving: set[int]
    ) -> Any:
        """`rank` pulls from `source`'s handle, and relays it if others pull from it.
        Reads from a relay have `relay_timeout_s`; from the trainer, the receiver's own."""
        timeout_s = None if source is None else self.relay_timeout_s
        return replicas.slice(procs=rank).load_weights.call_one(
            served[source], rank in serving, timeout_s
        )

    def after_level(self, number: int, replicas: Role) -> None:
        """Called after each level of a relay tree has pulled (for drills and tests)."""

    def _account(
        self, pulled: dict[int, Pulled], depth: dict, from_trainer: set[int], name: str
    ) -> None:
        sent = (self.serving or self.handle).version
        for rank, p in sorted(pulled.items()):
            if p.version != sent:
                raise WeightSyncError(
                    f"{name}[{rank}] serves version {p.version} after pulling version {sent}"
                )
            if self.verify and not p.verified:
                raise WeightSyncError(
                    f"{name}[{rank}] did not verify version {sent} against the trainer's checksums"
                )
        self.verified = sum(p.verified for p in pulled.values())
        self.bytes_moved = sum(p.bytes_moved for p in pulled.values())
        # One version's bytes in the replicas' own precision (each replica's the same).
        self.replica_bytes = max((p.version_bytes for p in pulled.values()), default=0)
        self.paths = [pulled[rank].path for rank in sorted(pulled)]
        self.egress_bytes = sum(pulled[rank].rdma_bytes for rank in from_trainer if rank in pulled)
        self.depth = max((depth[rank] for rank in pulled), default=0)
