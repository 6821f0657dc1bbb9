"""What every loop does around a step, so that a loop's body holds only the
step's own work (its mesh calls):

    with Steps(run, state, log, ckpt, end=cfg.steps, before=sup.drill) as steps:
        for step in steps:
            with log.timer("step"):
                ...  # generate, score, train, publish
            log.step({"step": step, ...})

- Ctrl-C and SIGTERM ask the run to stop (`Run.stop_request`, caught while the
  steps run): the step under way finishes first.
- Before each step, `before(step)`: the `faults:` drills due, pool sizes due.
- `StepLog.begin_step` opens the step: its timers start over, and the profiler
  starts when one was asked for (`meshrl profile RUN_DIR`).
- A step counts once the body has logged it (`StepLog.step`): the step counter
  moves on, then `Checkpointer.after_step` writes a checkpoint when one is due.
  A step the body did not log (undone by `Checkpointer.rewind`, which sets
  `state.step` back) does not count: the next step is `state.step` again.
- A stop asked for ends the steps after that checkpoint with KeyboardInterrupt
  ("stopped after N steps; checkpoint ..."), which the command line turns into
  exit status 130.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Steps:
    """The steps `state.step` .. `end - 1` of one call of a loop (see the module doc)."""

    def __init__(
        self,
        run: Any,
        state: Any,
        log: Any,
        ckpt: Any,
        end: int,
        before: Callable[[int], None] | None = None,
    ):
        self.run, self.state, self.log, self.ckpt = run, state, log, ckpt
        self.end, self.before = end, before
        self._catching: Any = None

    def __enter__(self) -> Steps:
        self._catching = self.run.stop_request.catching()
        self._catching.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._catching.__exit__(*exc)

    def __iter__(self) -> Iterator[int]:
        state, log = self.state, self.log
        while state.step < self.end:
            step = state.step
            if self.before is not None:
                self.before(step)
            log.begin_step(step)
            yield step
            if log.next_step != step + 1:  # not logged: undone by a rewind
                continue
            state.step += 1
            self.ckpt.after_step()
            if self.run.stop_request.requested:
                saved = f"; checkpoint {self.ckpt.latest()}" if self.ckpt.cfg.every else ""
                raise KeyboardInterrupt(f"stopped after {state.step} steps{saved}")
