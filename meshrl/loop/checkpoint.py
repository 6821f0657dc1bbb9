"""Checkpoints of a whole RL run, written atomically, the last K kept.

A checkpoint is a directory `<run dir>/checkpoints/step_<NNNNNNNN>/` holding one
file per stateful role (the trainer's model, optimizer and schedule, the
reference's frozen weights, the critic's model and optimizer), each policy
replica's sampling generator (`policy_rng_<rank>.pt`) and the controller's
`loop.pt` (the next step, its random generators, the prompts and batches in
flight). It is assembled under a temporary name and
renamed into place only when every part is written, with a `COMPLETE` marker
last, so a crash while writing leaves the previous checkpoint as the newest
valid one.

It is durable before it counts (`commit`): every file and directory of it is
fsynced before `COMPLETE` is written, `COMPLETE` and its directory entry before
the rename, and the checkpoint's directory, `checkpoints/` and the run directory
after it, so a power loss cannot leave a committed checkpoint over data that
never reached the disk. An old checkpoint is dropped by renaming it out of the
`step_*` names first (`.deleting_step_*`, the rename made durable) and then
deleting it, so a crash mid-delete never leaves a half-deleted one counted.

A checkpoint cannot run code and proves its bytes:

- Every file is read with `torch.load(weights_only=True)` (tensors and plain
  containers: `meshrl.model.files`, where the roles' parts are written and read
  too). The loop's state is written in that form (`to_plain`: prompts
  and batches as tagged dicts, arrays as tensors). A file that holds anything
  else is refused in one line naming it. FSDP shards' index (torch's DCP
  `.metadata`, a pickle) is read by an unpickler that builds only DCP's own
  metadata classes (`meshrl.procs.parallel.safe_reader`).
- `MANIFEST.json` (written before `COMPLETE`) holds each file's size and
  SHA-256. A checkpoint is hashed against it each time it is restored (a
  resume, a rewind: `problem`), whatever was found before; one without a
  manifest is damaged. `latest()` skips a damaged one and says so, so
  `resume=auto` and a rewind fall back to the newest intact checkpoint (a
  look that reads nothing, e.g. a message naming the newest, takes the last
  hash's word while no file of the checkpoint changed since).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from meshrl.config import ConfigError
from meshrl.model.files import CheckpointError, read

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
DELETING = ".deleting_"
"""Prefix an old checkpoint is renamed to before it is deleted: never counted."""


_NAME = re.compile(r"^step_(\d{8})$")


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints; 0 writes none."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    resume: str = ""
    """'' starts fresh; 'auto' continues from the newest complete checkpoint in
    the run directory (fresh if there is none); or a checkpoint directory."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("config key 'checkpoint.every': must be >= 0")
        if self.keep < 1:
            raise ConfigError("config key 'checkpoint.keep': must be >= 1")
        if self.resume not in ("", "auto"):
            if not os.path.isfile(os.path.join(self.resume, COMPLETE)):
                raise ConfigError(
                    f"config key 'checkpoint.resume': {self.resume} is not a complete checkpoint"
                )
            damage = problem(self.resume)
            if damage:
                raise ConfigError(f"config key 'checkpoint.resume': {damage}")


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def begin(run_dir: str, step: int) -> str:
    """A fresh temporary directory to write the checkpoint after `step` steps into."""
    path = os.path.join(root(run_dir), f".partial_step_{step:08d}")
    shutil.rmtree(path, ignore_errors=True)  # a previous attempt that crashed
    os.makedirs(path)
    return path


def _sha256(path: str, sync: bool = False) -> str:
    """The file's SHA-256; `sync`: and its bytes flushed to the disk (fsync)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def fsync_dir(path: str) -> None:
    """Make the entries of directory `path` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: str) -> list[str]:
    """Every file under `directory`, relative to it."""
    found = []
    for where, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(where, n), directory) for n in names]
    return sorted(found)


def write_manifest(directory: str) -> None:
    """`MANIFEST.json`: the size and SHA-256 of every file under `directory`.
    Each file is fsynced as it is hashed (whoever wrote it), then the manifest,
    then every directory under `directory` and itself: all of it is on the disk
    before `COMPLETE` is written."""
    files = {
        name: {
            "bytes": os.path.getsize(os.path.join(directory, name)),
            "sha256": _sha256(os.path.join(directory, name), sync=True),
        }
        for name in _files(directory)
        if name not in (MANIFEST, COMPLETE)
    }
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for where, _, _ in os.walk(directory, topdown=False):  # subdirectories, then itself
        fsync_dir(where)


def problem(path: str, rehash: bool = True) -> str:
    """'' when every file the checkpoint's manifest lists has its size and SHA-256;
    else one line naming the first file that does not. A checkpoint without a
    manifest (its deletion cut short, or from before manifests) is damaged.

    `rehash` (what reads a checkpoint next): every file hashed now. Else (`latest`
    choosing one, or naming it in a message, as the loop does every step) the
    answer of its last hash in this process stands while nothing of it changed
    through the file system since (`_fingerprint`); what only a hash sees (bits
    rotting on the disk) waits for the next read."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return f"{manifest} is missing (the checkpoint is incomplete)"
    key, before = os.path.abspath(path), _fingerprint(path)
    if not rehash and key in _hashed and _hashed[key][0] == before and _hashed[key][1]:
        return _hashed[key][2]
    damage = _check(path, manifest)
    _remember(key, before, _fingerprint(path), damage)
    return damage


_hashed: dict[str, tuple] = {}
"""checkpoint -> (its `_fingerprint` when last hashed, settled, what the hash found)."""

RACY_NS = 2_000_000_000
"""A file changed less than this before it was hashed could change again without
its ctime moving (timestamps are coarse; a file server's clock is another): its
checkpoint is hashed again at the next look."""


def _fingerprint(path: str) -> tuple:
    """What changes when the checkpoint at `path` changes through the file system:
    its manifest's text, and each listed file's device, inode, size, mtime and
    ctime (None when missing). A write, truncation, replacement or deletion moves
    ctime, which cannot be set back."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            text = f.read()
        names = sorted(json.loads(text)["files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return (None,)
    return (text, *_stats(path, names))


def _stats(path: str, names: list[str]) -> tuple:
    found = []
    for name in names:
        try:
            s = os.stat(os.path.join(path, name))
            found.append((name, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
        except OSError:
            found.append((name, None))
    return tuple(found)


def _remember(key: str, before: tuple, after: tuple, damage: str) -> None:
    """What a hash of the checkpoint at `key` found, kept only if nothing of it
    changed while it was hashed (`before`, `after`); settled (taken as it is by
    `latest` while unchanged) once its files were last changed `RACY_NS` before
    (a missing one stays missing until the fingerprint changes)."""
    if before != after or after == (None,):
        _hashed.pop(key, None)
        return
    now = time.time_ns()
    settled = all(len(s) == 2 or s[-1] < now - RACY_NS for s in after[1:])
    _hashed[key] = (after, settled, damage)


def _check(path: str, manifest: str) -> str:
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{manifest} is unreadable ({type(error).__name__}: {error})"
    for name, want in sorted(files.items()):
        full = os.path.join(path, name)
        try:
            size = os.path.getsize(full)
            if size != want["bytes"]:
                return f"{full} has {size} bytes, {want['bytes']} were written"
            if _sha256(full) != want["sha256"]:
                return f"{full} is not the file that was written (SHA-256 differs)"
        except OSError as error:
            return f"{full} cannot be read ({error.strerror or error})"
    return ""


_PLAIN = "__meshrl__"


def to_plain(value: Any) -> Any:
    """`value` as tensors and plain containers, for `read` to take back
    (`from_plain`): prompts and batches (`meshrl.types`) as tagged dicts, numpy
    arrays and pictures as tensors."""
    import numpy as np
    import torch

    from meshrl import types

    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_plain(v) for v in value)
    if is_dataclass(value) and getattr(types, type(value).__name__, None) is type(value):
        fields_ = {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
        return {_PLAIN: type(value).__name__, "fields": fields_}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) or (hasattr(value, "mode") and hasattr(value, "tobytes")):
        return {_PLAIN: "ndarray", "tensor": torch.from_numpy(np.array(value))}
    return value


def from_plain(value: Any) -> Any:
    """What `to_plain` wrote, as it was (a picture comes back as an array)."""
    from meshrl import types

    if isinstance(value, list | tuple):
        return type(value)(from_plain(v) for v in value)
    if not isinstance(value, dict):
        return value
    kind = value.get(_PLAIN)
    if kind is None:
        return {k: from_plain(v) for k, v in value.items()}
    if kind == "ndarray":
        return value["tensor"].numpy()
    cls = getattr(types, kind, None)
    if not (isinstance(cls, type) and is_dataclass(cls)):
        raise CheckpointError(f"the loop state names an unknown kind of value: {kind!r}")
    return cls(**from_plain(value["fields"]))


def commit(partial: str, keep: int) -> str:
    """Write the manifest, mark `partial` complete, move it into place, drop all
    but the newest `keep`. Each stage is durable before the next begins: every
    file and directory of `partial` before `COMPLETE`, `COMPLETE` before the
    rename, the rename (the checkpoint's directory, `checkpoints/` and the run
    directory fsynced) before an older checkpoint is dropped (`_drop`)."""
    names = [n for n in _files(partial) if n not in (MANIFEST, COMPLETE)]
    before = _stats(partial, names)
    write_manifest(partial)
    with open(os.path.join(partial, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    checkpoints = os.path.dirname(partial)
    final = os.path.join(checkpoints, os.path.basename(partial)[len(".partial_") :])
    # One written before at this step (another trajectory): out of the way, deleted below.
    before = [_rename_away(final)] if os.path.exists(final) else []
    os.replace(partial, final)
    fsync_dir(final)
    fsync_dir(checkpoints)
    fsync_dir(os.path.dirname(os.path.abspath(checkpoints)))  # `checkpoints/` itself
    # Its digests were just taken from these bytes: `latest` need not hash it again
    # while nothing of it changes (a restore and a rewind do).
    after = _fingerprint(final)
    _remember(os.path.abspath(final), (after[0], *before), after, "")
    kept = set(complete(checkpoints)[-keep:]) | {final}
    old = [os.path.join(checkpoints, n) for n in sorted(os.listdir(checkpoints))]
    _drop(
        [p for p in old if _NAME.match(os.path.basename(p)) and p not in kept],
        # and deletions an earlier crash cut short
        before + [p for p in old if os.path.basename(p).startswith(DELETING)],
    )
    return final


def _rename_away(path: str) -> str:
    """Checkpoint `path` under a name that never counts (`.deleting_step_*`)."""
    gone = os.path.join(os.path.dirname(path), DELETING + os.path.basename(path))
    shutil.rmtree(gone, ignore_errors=True)  # an earlier deletion cut short
    os.rename(path, gone)
    return gone


def _drop(paths: list[str], renamed: list[str]) -> None:
    """Delete the checkpoints at `paths`, and those `renamed` away already: each
    renamed out of the `step_*` names first and the renames made durable before
    anything is deleted, so no crash or power loss while deleting leaves a
    half-deleted checkpoint that counts."""
    gone = [_rename_away(path) for path in paths]
    if gone:
        fsync_dir(os.path.dirname(gone[0]))
    for path in dict.fromkeys(renamed + gone):
        shutil.rmtree(path, ignore_errors=True)


def complete(checkpoints: str) -> list[str]:
    """Complete checkpoint directories under `checkpoints`, oldest first."""
    if not os.path.isdir(checkpoints):
        return []
    found = [
        os.path.join(checkpoints, name)
        for name in os.listdir(checkpoints)
        if _NAME.match(name) and os.path.isfile(os.path.join(checkpoints, name, COMPLETE))
    ]
    return sorted(found)


def latest(run_dir: str, rehash: bool = False) -> str | None:
    """The newest complete and intact checkpoint of a run, or None. A damaged
    one (a file that is not what its manifest says) is skipped, and said so
    (printed and in the run's faults.log) once. `rehash`: each one hashed now,
    for a caller that reads it next; else one hashed before in this process and
    unchanged since is taken as it was found (`problem`)."""
    for path in reversed(complete(root(run_dir))):
        damage = problem(path, rehash)
        if not damage:
            return path
        if damage not in _said:
            _said.add(damage)
            from meshrl.procs.faultlog import log_fault

            message = f"checkpoint {path} is damaged, skipped: {damage}"
            print(message, flush=True)
            log_fault(message)
    return None


_said: set[str] = set()


def step_of(path: str) -> int:
    """Steps done when the checkpoint at `path` was written."""
    return int(_NAME.match(os.path.basename(path.rstrip("/"))).group(1))


class Checkpointer:
    """Checkpoints of a run: every stateful role's part and the controller's
    `LoopState`, committed atomically every `checkpoint.every` steps; resume
    from one, and go back to the newest after a lost trainer (`rewind`).

    `roles`: the stateful roles; each has `save_state(directory)` and
    `load_state(directory)` endpoints and writes its own files (e.g.
    `trainer.pt`). `after_restore()` runs after the roles are restored (publish
    the restored weights to the replicas). `collector` (a `Collector`, when the
    loop generates ahead) saves and restores the batches of `LoopState.ahead`;
    `queue`, the rollout queue of work by pull (`meshrl.loop.dispatch.Dispatcher`),
    is saved settled in `LoopState.data`, loaded after a restore and dropped on a
    rewind. `recover` (`Supervisor.recover`): a role that lost a proc while it
    saved (a policy replica's node) is recovered and asked again; without it the
    loss ends the run. Sizes of `same_size` roles must match the checkpoint's (a replica's sampling
    stream is its own), unless the role is elastic: its samples' seeds are the
    controller's, so a run may resume with another pool size."""

    def __init__(
        self,
        run,
        state,
        roles: list,
        cfg: CheckpointConfig,
        after_restore=None,
        collector=None,
        same_size: tuple[str, ...] = (),
        subdirs: dict[str, str] | None = None,
        queue: Any = None,
        recover: Any = None,
    ):
        self.run, self.state, self.cfg = run, state, cfg
        self.roles = [r for r in roles if r is not None]
        self.after_restore, self.collector, self.same_size = after_restore, collector, same_size
        self.subdirs = subdirs or {}  # role name -> its files' subdirectory (two trainers)
        self.queue, self.recover = queue, recover
        self.saved_at = -1

    def latest(self, rehash: bool = False) -> str | None:
        return latest(self.run.dir, rehash)

    def _each_role(self, endpoint: str, directory: str, roles: list | None = None) -> None:
        from meshrl.procs.mesh import RemoteCallError, call_all

        for role in self.roles if roles is None else roles:
            target = os.path.join(directory, self.subdirs.get(role.name, ""))
            os.makedirs(target, exist_ok=True)
            for attempt in range(2):  # again once, after recovering a lost proc
                try:
                    call_all(
                        role,
                        endpoint,
                        target.rstrip(os.sep),
                        what=f"{role.name}.{endpoint}",
                        timeout_s=self.run.timeout_s,
                    )
                    break
                except RemoteCallError as error:
                    if attempt or not error.proc_lost or self.recover is None:
                        raise
                    # RoleLost for a role it can neither catch up nor heal from peers
                    self.recover(role, error, heal=True)

    def load_roles(self, path: str, roles: list) -> None:
        """Restore only `roles` from the checkpoint at `path`, the loop's state
        and every other role as they are (one player of several after its
        trainer was lost)."""
        self._each_role("load_state", path, roles)

    def rewind_roles(self, lost, supervisor, roles: list, samples_per_step: int = 0) -> int:
        """A proc of `lost.role` died during step `state.step`: replace its procs and
        restore only `roles` (one player's trainer of several) from the newest
        checkpoint, the loop's state and every other role as they are; returns the
        checkpoint's step. Those roles' `samples_per_step` a step trained since then,
        and this step's, count as dropped (`trainer_rewind`), as in `rewind`.
        Without a checkpoint, `lost` is raised again."""
        path = self.latest(rehash=True)
        if path is None:
            raise lost  # no checkpoint (checkpoint.every = 0)
        supervisor.spend_recovery(lost.role, lost)
        print(f"recovering {lost.role} from {path}: {lost}", flush=True)
        self.run.respawn(lost.role)
        self.load_roles(path, roles)
        back_to, step = step_of(path), self.state.step
        self._undo(step, back_to, samples_per_step)
        return back_to

    def _undo(self, step: int, back_to: int, samples_per_step: int, in_flight: int = 0) -> None:
        """The ledger after going back from step `step` (under way, not trained) to
        the checkpoint after `back_to` steps: the samples trained in between, this
        step's and `in_flight` generated ahead are dropped (`trainer_rewind`)."""
        ledger = self.state.ledger
        ledger.trained -= (step - back_to) * samples_per_step
        ledger.drop("trainer_rewind", (step + 1 - back_to) * samples_per_step + in_flight)

    def after_step(self) -> None:
        """After each step (`meshrl.loop.steps.Steps` calls it): a checkpoint every
        `checkpoint.every` steps, and one when Ctrl-C or SIGTERM asked to stop, if
        checkpoints are on and this step has none yet (`Steps` then stops). When the
        scheduler gave notice that procs of the run will be killed (SLURM: a
        preemption, a requeue, the time limit near), a checkpoint now, whatever
        `checkpoint.every` says; a job warned of its time limit is then requeued
        (the run goes on when SLURM starts it again: `meshrl.procs.slurm`)."""
        notices = self.run.meshes.scheduler_notices()
        if notices and self.saved_at != self.state.step:
            from meshrl.procs.mesh import log_fault

            path = self.save()
            said = ", ".join(f"{mesh} job {reason}" for mesh, reason in notices)
            if path is not None:
                log_fault(f"checkpoint {path} written on SLURM's notice ({said})")
                print(f"SLURM: {said}: checkpoint {path} written", flush=True)
        for mesh, reason in notices:
            if reason == "warning":
                self.run.meshes.requeue(mesh)
        done, stop = self.state.step, self.run.stop_request.requested
        due = self.cfg.every and (done % self.cfg.every == 0 or stop)
        if due and self.saved_at != done:
            self.save()

    def save(self) -> str | None:
        """Write the checkpoint after `state.step` steps; its path. A part that cannot
        be written (full disk, unwritable directory) stops the run with one line; the
        previous checkpoint stays the newest valid one. None: a stateful role was lost
        while saving (the next step rewinds)."""
        import torch

        from meshrl.procs.mesh import RemoteCallError, RoleLost, log_fault, one_line

        done, collector = self.state.step, self.collector
        # Generation under way for the next steps is part of the state: collected
        # now and saved, so a resumed run trains on exactly these samples.
        for batch in self.state.ahead if collector else ():
            collector.collect(batch)
        if self.queue is not None:
            self.state.data["rollout_queue"] = self.queue.save()
        loop = self.state.state_dict(collector.save if collector else None)
        try:
            partial = begin(self.run.dir, done)
            self._each_role("save_state", partial)
            sizes = {role.name: role.size for role in self.roles}
            torch.save({"loop": to_plain(loop), "sizes": sizes}, f"{partial}/loop.pt")
            path = commit(partial, self.cfg.keep)
        except (OSError, RemoteCallError) as error:
            if isinstance(error, RoleLost):
                # A role whose state lives only in its procs (trainer, critic) was lost
                # while saving: this checkpoint cannot be written. The next step's call
                # to it finds it gone and rewinds to the newest one (`rewind`).
                shutil.rmtree(partial, ignore_errors=True)
                log_fault(f"checkpoint after step {done} not written: {one_line(error)}")
                return None
            if isinstance(error, RemoteCallError) and error.proc_lost:
                raise
            raise CheckpointError(
                f"checkpoint after step {done} could not be written: {one_line(error)} "
                f"(newest valid checkpoint: {self.latest()})"
            ) from error
        self.saved_at = done
        return path

    def restore(self, path: str, counts: bool = True, checked: bool = False) -> int:
        """Every role's state and the loop's from the checkpoint at `path`; returns
        its step. `counts=False` keeps the ledger and counters (a rewind). The
        checkpoint is hashed against its manifest first, unless `checked`: the
        caller just did (`rewind`, by `latest`)."""
        damage = "" if checked else problem(path)
        if damage:
            raise CheckpointError(f"cannot restore {path}: {damage}")
        saved = read(f"{path}/loop.pt")
        saved["loop"] = from_plain(saved["loop"])
        for role in self.roles:
            elastic = role.name in self.run.meshes.elastic  # seeds are the samples', not its
            if (
                role.name in self.same_size
                and not elastic
                and saved["sizes"].get(role.name) != role.size
            ):
                raise ConfigError(
                    f"config key 'placement.{role.name}': the checkpoint {path} has "
                    f"{saved['sizes'].get(role.name)} {role.name} procs, this run {role.size}"
                )
        self._each_role("load_state", path)
        if self.after_restore is not None:
            self.after_restore()
        restore_batch = self.collector.restore if self.collector else None
        self.state.load_state_dict(saved["loop"], restore_batch, counts=counts)
        if self.queue is not None:
            self.queue.load(self.state.data.get("rollout_queue"))
        self.saved_at = self.state.step
        return self.state.step

    def resume(self) -> int | None:
        """With `checkpoint.resume`: restore the run's checkpoint and return its
        step; else None (a fresh run)."""
        if self.run.resume_from is None:
            return None
        step = self.restore(self.run.resume_from)
        print(f"resumed from {self.run.resume_from} at step {step}", flush=True)
        return step

    def rewind(self, lost, supervisor, log, samples_per_step: int) -> int:
        """A proc of a role whose state lives only in it (trainer, critic) died
        during step `state.step`: replace its procs, restore every role from the
        newest checkpoint and return its step, where the loop continues. Samples
        of the steps undone, and those generated ahead, count as dropped."""
        path = self.latest(rehash=True)  # hashed now: `restore` does not hash it again
        if path is None:
            raise lost  # no checkpoint (checkpoint.every = 0)
        supervisor.spend_recovery(lost.role, lost)
        print(f"recovering {lost.role} from {path}: {lost}", flush=True)
        self.run.respawn(lost.role)
        ledger, step = self.state.ledger, self.state.step
        in_flight = 0
        for batch in self.state.ahead:  # generation for the steps being undone
            in_flight += len(batch)
            ledger.generated += 0 if batch.counted else len(batch)
        self.state.ahead = []
        if self.queue is not None:  # generated for the steps being undone
            self.queue.drop_all("trainer_rewind")
        back_to = self.restore(path, counts=False, checked=True)
        self.run.report()  # actors' metrics of the undone steps belong to no step
        log.rewind(back_to)
        # Steps back_to .. step-1 were trained and are undone; step's samples never were.
        self._undo(step, back_to, samples_per_step, in_flight)
        return back_to
