"""Failures surface at the controller as errors naming the call; nothing hangs."""

import os
import time

import pytest
from monarch.actor import Actor, endpoint

from meshrl.procs.mesh import RemoteCallError, RoleMeshes, wait

pytestmark = [pytest.mark.actors, pytest.mark.timeout(180)]


class Fragile(Actor):
    @endpoint
    def crash(self) -> None:
        os._exit(3)

    @endpoint
    def boom(self) -> None:
        raise ValueError("reward function broke")

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


def test_dead_proc_raises_instead_of_hanging(no_stray_procs):
    with RoleMeshes({"workers": 2}) as meshes:
        workers = meshes["workers"].spawn("fragile", Fragile)
        started = time.monotonic()
        with pytest.raises(RemoteCallError, match=r"workers\.boom failed: ValueError") as info:
            wait(workers.slice(procs=1).boom.call_one(), "workers.boom", timeout_s=60)
        assert not info.value.proc_lost  # an exception in the actor, the proc lives
        with pytest.raises(RemoteCallError, match=r"workers\.crash") as info:
            wait(workers.slice(procs=0).crash.call_one(), "workers.crash", timeout_s=120)
        assert info.value.proc_lost and info.value.role == "workers"
        assert time.monotonic() - started < 60
        # the client survived the fault; the other proc still serves
        assert wait(workers.slice(procs=1).sleep.call_one(0.0), "sleep", 30) == "done"


def test_deadline_names_the_call(no_stray_procs):
    with RoleMeshes({"workers": 1}) as meshes:
        workers = meshes["workers"].spawn("fragile", Fragile)
        with pytest.raises(RemoteCallError, match=r"workers\.sleep did not answer within 1s"):
            wait(workers.sleep.call_one(30.0), "workers.sleep", timeout_s=1)
