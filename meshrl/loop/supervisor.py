"""Calls on role meshes with deadlines, retries, respawns and drills.

    sup = Supervisor(run, cfg.faults, state)
    sup.on_respawn("policy", lambda: sync.pull(policy))   # catch a new replica up
    metrics = sup.call_sharded(trainer, "train_step", batch)

Every call has the run's deadline (`run.call_timeout_s`). An exception raised in
an actor is retried `faults.retry_errors` times, then ends the run with the
actor's one-line error. A lost proc has its procs replaced and its actors
spawned again (`Run.respawn`) when the script registered a catch-up for the
role (`on_respawn`); the call is then made again. A role without one (a trainer
or critic: their state lives only in them) raises `RoleLost`, which the loop
handles by going back to a checkpoint (`Checkpointer.rewind`), unless the role's
ranks are replicas of each other (a DDP trainer or critic, `heal_from_peers`):
then its procs are replaced, the new ranks take the state of a surviving one
(`heal`, over RDMA buffers: `meshrl.weights.peer_state`) and the call is made
again; nothing is rewound. Counters and the recovery budget live in the
`LoopState`, so they survive a resume.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

from meshrl.config import ConfigError
from meshrl.loop.run import Role, Run
from meshrl.loop.state import LoopState
from meshrl.procs import proc_pool
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.mesh import (
    RemoteCallError,
    RoleLost,
    call_all,
    gather,
    log_fault,
    start_each,
    wait,
)
from meshrl.types import TrainBatch


class NonFiniteLoss(RuntimeError):
    """Too many steps in a row with a NaN or infinite loss; one line."""


class Supervisor:
    def __init__(self, run: Run, faults: FaultsConfig, state: LoopState):
        self.run, self.faults, self.state = run, faults, state
        self.timeout_s = run.timeout_s if run is not None else 0.0
        self.catch_up: dict[str, Callable[[], None]] = {}
        self.drilled: set[tuple] = set()
        self.killed_at: dict[str, float] = {}  # `role[rank]` -> when a drill killed it
        self.recovery_times: list[dict[str, float]] = []
        """Per recovery: seconds from the kill (a drill's; else from when the loss
        was seen) to seeing it (`detect_s`) and to serving again (`serve_s`); for a
        heal from peers also the heal itself (`heal_s`: staging, new procs, reads)."""
        self.healers: dict[str, tuple[str, ...]] = {}
        self.after_heal: dict[str, Callable[[], None]] = {}

    def on_respawn(self, role: str, catch_up: Callable[[], None] = lambda: None) -> None:
        """Replace `role`'s procs when one dies, then run `catch_up()` to bring its
        new actors to the current state (pull weights, reload a checkpoint)."""
        self.catch_up[role] = catch_up

    def heal_from_peers(
        self, role: str, steps: tuple[str, ...], after: Callable[[], None] = lambda: None
    ) -> None:
        """`role`'s ranks are replicas of each other (DDP): a lost proc is replaced
        and the new ranks take a surviving rank's state (`heal`), not a checkpoint's.
        `steps`: its endpoints that change that state; a call of one that a rank
        completed while another was lost cannot be made again (the lost rank's part
        of it is gone): the checkpoint then. `after()` runs after each heal."""
        self.healers[role] = steps
        self.after_heal[role] = after

    # --- calls ---------------------------------------------------------------------------

    def wait(self, future: Any, what: str) -> Any:
        return wait(future, what, self.timeout_s)

    def call_all(self, role: Role, endpoint: str, *args: Any) -> list:
        """`endpoint(*args)` on every proc of `role`; results in rank order (no retry)."""
        return call_all(
            role, endpoint, *args, what=f"{role.name}.{endpoint}", timeout_s=self.timeout_s
        )

    def call(
        self,
        role: Role,
        endpoint: str,
        args_per_rank: list,
        started: tuple | None = None,
        independent: bool = False,
    ) -> tuple[list, list[int]]:
        """`endpoint` on proc i of `role` with `args_per_rank[i]`, all at once;
        the results in rank order and how often each rank's call was made again
        (a lost proc replaced, a raised error retried). `started`: (futures,
        respawns) of the same call already sent. `independent`: each rank's call
        stands alone (generation, scoring: no collective between the ranks), so
        only the ranks that failed are called again; the others' results are kept."""
        what, errors = f"{role.name}.{endpoint}", 0
        sent = [0 if started is None else 1] * len(args_per_rank)
        done: dict | None = {} if independent else None
        futures, respawns = started or (None, None)
        while True:
            answered: dict = {}  # rank -> result, of this try (a call that stands alone)
            try:
                if futures is None:
                    futures = start_each(role, endpoint, args_per_rank, skip=done or ())
                    respawns = role.respawns
                    sent = [n + (f is not None) for n, f in zip(sent, futures, strict=True)]
                results = gather(futures, what, self.timeout_s, answered if done is None else done)
                return results, [n - 1 for n in sent]
            except RemoteCallError as error:
                futures = None
                if error.stray:
                    self.stray(role, error)
                elif not error.proc_lost:
                    self.retry(error, errors)
                    errors += 1
                elif respawns == role.respawns:  # else: replaced since the call was sent
                    applied = bool(answered) and endpoint in self.healers.get(role.name, ())
                    self.recover(role, error, heal=True, applied=applied)

    def call_sharded(
        self, roles: Role | tuple[Role, ...], endpoint: str, batch: TrainBatch, *args: Any
    ) -> dict:
        """`endpoint(shard, *args)` on every proc of each role, all at once, each proc
        with its data-parallel shard of `batch` (contiguous row blocks); each role's ranks'
        metrics averaged, the roles' merged (a policy and a value step together)."""
        roles = roles if isinstance(roles, tuple) else (roles,)
        shards = {r.name: [(shard, *args) for shard in r.shards(batch)] for r in roles}
        started = [(r, start_each(r, endpoint, shards[r.name]), r.respawns) for r in roles]
        metrics: dict = {}
        for role, futures, respawns in started:
            results, _ = self.call(role, endpoint, shards[role.name], (futures, respawns))
            metrics.update(mean_metrics(results))
        return metrics

    def call_apart(self, batches: dict, endpoint: str, *args: Any) -> dict[str, Any]:
        """`endpoint(shard, *args)` on several roles at once, each on its own batch
        (`batches`: role -> batch; each proc its data-parallel shard): two players'
        trainers stepping together. Per role name, its ranks' metrics averaged, or
        the `RoleLost` it raised: the other roles' calls stand."""
        started = []
        for role, batch in batches.items():
            shards = [(shard, *args) for shard in role.shards(batch)]
            started.append((role, shards, start_each(role, endpoint, shards), role.respawns))
        answers: dict[str, Any] = {}
        for role, shards, futures, respawns in started:
            try:
                results, _ = self.call(role, endpoint, shards, (futures, respawns))
            except RoleLost as lost:
                answers[role.name] = lost
                continue
            answers[role.name] = mean_metrics(results)
        return answers

    def call_rows(self, role: Role, endpoint: str, batch: TrainBatch, *args: Any) -> torch.Tensor:
        """`endpoint` on contiguous row blocks of `batch` over `role`'s procs (as
        even as the rows allow), concatenated in row order (reference and
        trainer log-probs, critic values). The procs of a tensor-parallel group
        take the same block; the first one's answer is kept."""
        tp = getattr(role, "tensor_parallel", 1)
        blocks = torch.arange(len(batch)).tensor_split(role.size // tp)
        calls = [(batch.rows(blocks[i // tp]), *args) for i in range(role.size)]
        parts, _ = self.call(role, endpoint, calls)
        return torch.cat(parts[::tp])

    # --- faults ---------------------------------------------------------------------------

    def retry(self, error: RemoteCallError, tries: int) -> None:
        """Re-raise `error` unless `faults.retry_errors` allows another try."""
        if error.proc_lost or tries >= self.faults.retry_errors:
            raise error
        self.state.count("errors_retried")
        print(f"retrying: {error}", flush=True)

    def recover(
        self, role: Role | str, error: RemoteCallError, heal: bool = False, applied: bool = False
    ) -> None:
        """A proc of `role` was lost: replace the procs and catch the new actors up
        (`on_respawn`), or raise `RoleLost` when the role has no catch-up. `heal`:
        the caller makes its call again, so a role of replicas may be healed from
        its peers (`heal`) instead; `applied`: the failed call changed the
        surviving ranks' state (it cannot be made again: `RoleLost`)."""
        name = role if isinstance(role, str) else role.name
        if not error.proc_lost:
            raise error
        host = self.run.meshes.share.get(name, name)  # a colocated role dies with its host's
        if host not in self.catch_up or name not in self.catch_up:
            if heal and not applied and self.heal(host, error):
                return
            raise RoleLost(error, host)
        self.spend_recovery(name, error)
        started = time.monotonic()
        seen = self._seen(host, started)
        log_fault(f"recovering {name}: {error}")
        for again in self.run.respawn(name):
            self.catch_up[again.name]()
        took = time.monotonic() - started
        self._timed(host, seen)
        log_fault(f"recovered {name} in {took:.1f}s")
        # One console line per recovery; Monarch's failure events are in faults.log.
        print(
            f"recovered {name}: {error.what} lost its proc; replaced and caught up in "
            f"{took:.1f}s (details: {self.run.dir}/faults.log)",
            flush=True,
        )

    def heal(self, host: str, error: RemoteCallError) -> bool:
        """Replace the procs `host` names after one died, the new ranks of each
        role of replicas in them (`heal_from_peers`) taking the state of a rank
        that lives on, the other roles caught up (`on_respawn`). False when that
        cannot be done (a role that is neither, a single rank, no rank that
        answers, a SLURM job that lost a node and is replaced whole: the checkpoint
        then); a failure once the procs are replaced is `RoleLost`."""
        started = time.monotonic()
        share = self.run.meshes.share
        roles = {name: h for name, h in self.run.roles.items() if share.get(name, name) == host}
        healed = [h for name, h in roles.items() if name in self.healers]
        if not healed or any(n not in self.healers and n not in self.catch_up for n in roles):
            return False
        if any(h.size < 2 for h in healed) or not self.run.meshes.keeps_survivors(host):
            return False
        lost = re.search(r"\[(\d+)\]$", error.what)
        staged = {}
        for handle in healed:
            staged[handle.name] = self.survivor(handle, int(lost.group(1)) if lost else None)
            if staged[handle.name] is None:
                return False
        self.spend_recovery(host, error)
        log_fault(f"healing {host} from its peers: {error}")
        seen = self._seen(host, started)

        def handoff(again: list[Role]) -> None:
            for handle in again:
                if handle.name in staged:
                    self.call_all(handle, "take_state", staged[handle.name], self.timeout_s)

        try:
            again = self.run.respawn(host, handoff)
        except RemoteCallError as failed:
            log_fault(f"healing {host} failed: {failed}")
            raise RoleLost(error, host) from failed
        for handle in again:
            if handle.name in staged:
                self.after_heal[handle.name]()
        for handle in again:
            if handle.name not in staged:
                self.catch_up[handle.name]()
        took = time.monotonic() - started
        self._timed(host, seen, heal_s=took)
        ranks = ", ".join(f"{name} from rank {s.rank}" for name, s in staged.items())
        log_fault(f"healed {host} in {took:.1f}s ({ranks})")
        print(
            f"healed {host}: {error.what} lost its proc; procs replaced, state taken from "
            f"the peers ({ranks}) in {took:.1f}s, the call made again "
            f"(details: {self.run.dir}/faults.log)",
            flush=True,
        )
        return True

    @staticmethod
    def _seen(host: str, started: float) -> float:
        """When a proc of `host` was seen gone: by the pid watch, if it saw it
        (before Monarch says so), else `started`."""
        return min(
            (t for k, t in proc_pool.lost.items() if k.startswith(f"{host}[")), default=started
        )

    def _timed(self, host: str, seen: float, **extra: float) -> None:
        """A recovery's `recovery_times` entry: from the kill (a drill's; else from
        when the loss was seen) to seeing it and to serving again, now."""
        killed = [k for k in self.killed_at if k.startswith(f"{host}[")]
        origin = self.killed_at.pop(killed[0]) if killed else seen
        served = time.monotonic() - origin
        self.recovery_times.append(
            {"role": host, "detect_s": seen - origin, "serve_s": served, **extra}
        )

    def survivor(self, role: Role, lost: int | None) -> Any | None:
        """The state of the lowest rank of `role` that answers, packed for the new
        ranks to read (`PeerState.share_state`); None if none does. A rank stuck
        in a collective with the lost one answers once that fails, or never."""
        for rank in range(role.size):
            what = f"{role.name}.share_state[{rank}]"
            if rank == lost or proc_pool.is_lost(what):
                continue
            try:
                return self.wait(role.slice(procs=rank).share_state.call_one(), what)
            except RemoteCallError as error:
                log_fault(f"{what}: {error}")
        return None

    def stray(self, role: Role, error: RemoteCallError) -> None:
        """The call failed on a report about another mesh (`RemoteCallError.stray`).
        Its procs are asked (a proc really gone is recovered as a loss); a role
        that catches up from its peers is asked again, one whose state lives only
        in it (trainer, critic) may have run the call already: `RoleLost`, back to
        a checkpoint, so no step is applied twice."""
        log_fault(f"{error} (a report about a mesh meshrl replaced)")
        self.check_alive(role)
        host = self.run.meshes.share.get(role.name, role.name)
        if host not in self.catch_up or role.name not in self.catch_up:
            raise RoleLost(error, host)

    def check_alive(self, role: Role) -> None:
        """Ask each proc of `role` (its watch) whether it is there; a proc gone is
        recovered as a loss (`recover`: `RoleLost` for a role without catch-up)."""
        own = self.run.meshes.share.get(role.name, role.name)
        watch = self.run.meshes.watches.get(own)
        if watch is None:
            return
        try:
            self.wait(watch.status.call(), f"{role.name}.status")
        except RemoteCallError as error:
            if error.proc_lost:
                self.recover(role, error)
            raise

    def spend_recovery(self, role: str, error: RemoteCallError) -> None:
        """One recovery of the `faults.max_recoveries` budget, or the error."""
        if len(self.state.recoveries) >= self.faults.max_recoveries:
            raise error
        self.state.recoveries.append(f"{role}: {error}")

    def drill(self, step: int) -> None:
        """Drills from `faults:` at the start of `step`, each once (also when a
        rewind brings the loop back over the step): `kill` ends the named procs
        now, as a crash would; `raise_in` makes the named endpoint raise on its
        next call in every proc of the role."""
        # Raises are armed before kills: a role drilled both ways at one step is armed
        # on all its procs, then loses one (arming after would call a dead proc).
        drills = [("raise", role, name) for role, name in self.faults.raises_at(step)]
        drills += [("kill", role, rank) for role, rank in self.faults.kills_at(step)]
        drills += [(kind, role, rank) for role, kind, rank in self.faults.weight_drills_at(step)]
        drills += [
            (f"slow:{factor:g}", role, rank) for role, rank, factor in self.faults.slow_at(step)
        ]
        if self.faults.episode_latency and "environment" in self.run:  # each step: new procs too
            self.call_all(self.run.roles["environment"], "set_latency", self.faults.latency())
        for kind, name, target in drills:
            if (kind, name, target, step) in self.drilled:
                continue
            self.drilled.add((kind, name, target, step))
            if name not in self.run:
                raise ConfigError(f"config key 'faults': this run has no {name} mesh to drill")
            role = self.run.roles[name]
            if kind == "kill":
                role.slice(procs=target).exit_now.call_one()  # never answers
                self.killed_at[f"{name}[{target}]"] = time.monotonic()
                print(f"faults: killed {name}[{target}] at step {step}", flush=True)
            elif kind.startswith("slow:"):
                factor = float(kind.split(":")[1])
                self.wait(role.slice(procs=target).slow_down.call_one(factor), f"{name}.slow_down")
                print(f"faults: {name}[{target}] slowed {factor:g}x from step {step}", flush=True)
            elif kind in ("corrupt", "unmerged", "skip_pull"):
                self.wait(role.slice(procs=target).arm.call_one(kind), f"{name}.arm")
                print(f"faults: {kind} drill armed on {name}[{target}] at step {step}", flush=True)
            else:
                self.call_all(role, "arm_error", target)
                print(f"faults: {name}.{target} will raise at step {step}", flush=True)

    def guard_finite(self, step: int, metrics: dict, newest_checkpoint: str | None) -> None:
        """Count a step whose trainer skipped an update for a NaN or infinite loss
        or gradient; `faults.max_nonfinite_steps` of them in a row stop the run
        (the newest checkpoint holds the last good state)."""
        skipped = any(
            metrics.get(key, 0) > 0
            for key in ("train/nonfinite_skipped", "value/nonfinite_skipped")
        )
        self.state.count("nonfinite_steps", int(skipped))
        counters = self.state.counters
        counters["nonfinite_in_row"] = counters["nonfinite_in_row"] + 1 if skipped else 0
        limit = self.faults.max_nonfinite_steps
        if counters["nonfinite_in_row"] >= limit:
            raise NonFiniteLoss(
                f"steps {step - limit + 1}..{step}: {limit} steps in a row had a NaN or "
                f"infinite loss or gradient and were skipped (faults.max_nonfinite_steps); "
                f"newest checkpoint: {newest_checkpoint}"
            )

    def metrics(self) -> dict[str, int]:
        """The run's fault counters, as every step logs them."""
        counters = self.state.counters
        last = self.recovery_times[-1:]  # the newest recovery's times, once there is one
        return {
            "faults/recoveries": len(self.state.recoveries),
            "faults/errors_retried": counters["errors_retried"],
            "faults/nonfinite_steps": counters["nonfinite_steps"],
            **{
                f"faults/time_to_{k}": r[k]
                for r in last
                for k in ("detect_s", "serve_s", "heal_s")
                if k in r
            },
        }


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over `records` (ranks of a mesh, optimizer steps of a batch)."""
    return {key: sum(r[key] for r in records) / len(records) for key in records[0]}


def merge_optimizer_steps(optimizer_steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one RL step's optimizer steps: means, except `sampling/`
    keys, taken from the first step (before the batch moved the weights)."""
    merged = mean_metrics(optimizer_steps)
    merged.update({k: v for k, v in optimizer_steps[0].items() if k.startswith("sampling/")})
    return merged
