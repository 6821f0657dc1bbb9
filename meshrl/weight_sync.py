"""Weight-sync bookkeeping on the controller: the version, its handle, the pulls
in flight, and waiting for them before the next publish.

    handle = sync.publish(trainer)   # trainer.publish: each owning rank writes a slot
    sync.pull(policy, handle)        # policy.load_weights: shm on this host, RDMA across

The bytes move between the actors (`meshrl.weights`); this object only says
when. With `wait=False` (`max_staleness > 0`) pulls are not waited for: each
replica takes the new version after the generation it is running, and the loop
goes on. They are waited for before the next publish, which keeps the slot a
replica may still read intact (double buffering), and a replica lost on the
way is replaced by the supervisor (its catch-up pulls the newest version).
"""

from __future__ import annotations

from typing import Any

from meshrl.mesh import RemoteCallError
from meshrl.run import Role
from meshrl.weights import WeightHandle


class WeightSync:
    def __init__(self, supervisor: Any, wait: bool = True):
        self.sup = supervisor
        self.wait_each = wait
        self.handle: WeightHandle | None = None
        self.published = 0  # versions published by this controller
        self.paths: list[str] = []  # 'shm' or 'rdma', per replica, of the last pull
        self._pulls: tuple[Any, Role, int] | None = None

    @property
    def version(self) -> int:
        return self.handle.version if self.handle is not None else -1

    def publish(self, trainer: Role) -> WeightHandle:
        """Wait for the pulls in flight, then `trainer.publish` on every rank (the
        ranks that own weights write them); returns the merged handle."""
        self.wait()
        handles = self.sup.call_all(trainer, "publish")
        self.handle = WeightHandle.merge(handles)
        self.published += 1
        return self.handle

    def pull(self, replicas: Role, handle: WeightHandle | None = None) -> None:
        """Every replica of `replicas` pulls `handle` (the newest by default);
        waited for unless this sync runs ahead (`wait=False`)."""
        self.wait()
        future = replicas.load_weights.call(handle or self.handle)
        self._pulls = (future, replicas, replicas.respawns)
        if self.wait_each:
            self.wait()

    def catch_up(self, replicas: Role) -> None:
        """A respawned replica mesh takes the current version, now."""
        future = replicas.load_weights.call(self.handle)
        self._collect(future, replicas)

    def wait(self) -> None:
        """Until every replica serves the newest version; a replica lost on the
        way is replaced (and pulls it then)."""
        pulls, self._pulls = self._pulls, None
        if pulls is None:
            return
        future, replicas, respawns = pulls
        try:
            self._collect(future, replicas)
        except RemoteCallError as error:
            if not error.proc_lost:
                raise
            if respawns == replicas.respawns:  # else: replaced (and caught up) since
                self.sup.recover(replicas, error)

    def _collect(self, future: Any, replicas: Role) -> None:
        answers = self.sup.wait(future, f"{replicas.name}.load_weights").items()
        pulled = [value for _, value in answers]
        assert {v for v, _ in pulled} == {self.handle.version}, f"replicas at {pulled}"
        self.paths = [path for _, path in pulled]
