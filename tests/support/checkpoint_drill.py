"""The crash drill of tests/unit/test_checkpoint_drill.py, run as its own process:
`python -m tests.support.checkpoint_drill <directory> <keep> <results.json>`.

For each point K of a save (every role file written, directory made, fsync,
rename, and each file and directory a prune deletes), a forked controller starts
the save of step 6 over a run holding the checkpoints of steps 2 and 4 (the last
`keep` of them) and dies (`os._exit`, no cleanup, nothing flushed) just before
point K. This process then resumes as `checkpoint.resume=auto` does
(`checkpoint.latest`), checks what it would read, and saves the next checkpoint
as the resumed run would. What it found, per point, goes to `results.json`.

Real fsyncs are skipped (counted as points all the same): a process that dies
keeps what it wrote in the page cache, so they change nothing here, and they are
what makes the drill slow. That they are called, and in which order, is
tests/unit/test_checkpoint.py's `test_every_part_is_on_disk_before_complete_...`.
"""

from __future__ import annotations

import json
import os
import sys

from meshrl.loop import checkpoint

KILLED = 97
FILES = (
    "trainer.pt",
    "trainer_shards/__0_0.distcp",
    "trainer_shards/.metadata",
    "policy_rng_0.pt",
    "policy_rng_1.pt",
    "loop.pt",
)


def content(name: str, step: int) -> bytes:
    return f"{name} after step {step}\n".encode() * 50


class Points:
    """Counts the points of a save; dies just before point `die_at` (1-based)."""

    def __init__(self, die_at: int | None, log: list[str] | None = None):
        self.n, self.die_at, self.log = 0, die_at, log

    def __call__(self, label: str) -> None:
        self.n += 1
        if self.n == self.die_at:
            os._exit(KILLED)
        if self.log is not None:
            self.log.append(label)

    def install(self) -> None:
        """Every call that changes what is on disk becomes a point (in this process)."""

        def wrap(name, label):
            real = getattr(os, name)

            def point(*args, **kwargs):
                self(label(*args, **kwargs))
                return real(*args, **kwargs)

            setattr(os, name, point)

        wrap("mkdir", lambda path, *a, **k: f"mkdir {os.path.basename(path)}")
        wrap("rename", lambda a, b, **k: f"rename {os.path.basename(a)} {os.path.basename(b)}")
        wrap("replace", lambda a, b, **k: f"replace {os.path.basename(a)} {os.path.basename(b)}")
        wrap("unlink", lambda path, **k: f"unlink {where(path, k)}")
        wrap("rmdir", lambda path, **k: f"rmdir {where(path, k)}")
        os.fsync = lambda fd: self(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")


def where(path, kwargs) -> str:
    """`path` with the directory of its `dir_fd` (shutil.rmtree's calls)."""
    if kwargs.get("dir_fd") is not None:
        path = os.path.join(os.readlink(f"/proc/self/fd/{kwargs['dir_fd']}"), path)
    return path


def save(run: str, step: int, keep: int, point=lambda label: None) -> str:
    """What `Checkpointer.save` does on disk: each role writes its files into the
    partial directory, then `commit` (manifest, COMPLETE, rename, prune)."""
    partial = checkpoint.begin(run, step)
    for name in FILES:
        point(f"write {name}")
        if not os.path.isdir(os.path.dirname(os.path.join(partial, name))):
            os.makedirs(os.path.dirname(os.path.join(partial, name)))
        with open(os.path.join(partial, name), "wb") as f:
            f.write(content(name, step))
    return checkpoint.commit(partial, keep)


def whole(path: str) -> bool:
    """The checkpoint at `path` holds every file its save wrote, as written."""
    step = checkpoint.step_of(path)
    for name in FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                if f.read() != content(name, step):
                    return False
        except OSError:
            return False
    return True


def drill(directory: str, keep: int) -> list[dict]:
    os.fsync = lambda fd: None  # see the module's docstring
    # The points of one save, counted in a controller that does not die.
    labels: list[str] = []
    read, write = os.pipe()
    if os.fork() == 0:
        run = os.path.join(directory, "count")
        save(run, 2, keep), save(run, 4, keep)
        points = Points(None, labels)
        points.install()
        save(run, 6, keep, points)
        os.write(write, json.dumps(labels).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        labels = json.loads(f.read())
    os.wait()
    committed = labels.index("replace .partial_step_00000006 step_00000006") + 1
    results = []
    for k in range(1, len(labels) + 2):  # and once past the last point: not killed
        run = os.path.join(directory, f"k{k}")
        save(run, 2, keep), save(run, 4, keep)
        pid = os.fork()
        if pid == 0:
            points = Points(k)
            points.install()
            save(run, 6, keep, points)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        # Resumed: what `checkpoint.resume=auto` continues from.
        newest = checkpoint.latest(run)
        counted = checkpoint.complete(checkpoint.root(run))
        result = {
            "point": k,
            "stage": labels[k - 1] if k <= len(labels) else "(none: the save ended)",
            "killed": os.waitstatus_to_exitcode(status) == KILLED,
            "resumed_from": newest and checkpoint.step_of(newest),
            "expected": 6 if k > committed else 4,
            "resumed_whole": bool(newest) and whole(newest),
            # Counted as intact but not what its save wrote (a half-deleted one).
            "false_intact": [
                os.path.basename(p) for p in counted if not checkpoint.problem(p) and not whole(p)
            ],
        }
        # The resumed run goes on and saves its next checkpoint.
        if newest is not None:
            after = checkpoint.step_of(newest) + 2
            save(run, after, keep)
            result["next_saved"] = checkpoint.step_of(checkpoint.latest(run)) == after
            result["left"] = sorted(os.listdir(checkpoint.root(run)))
        results.append(result)
    return results


if __name__ == "__main__":
    directory, keep, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    results = drill(directory, keep)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
