"""`python -m algorithms.X --config FILE key=value ... [--debug]`: every
algorithm's command line (`main`, re-exported by `algorithms.base`)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Any

from meshrl.config import ConfigError, parse_cli
from meshrl.procs.mesh import debugging, one_line
from meshrl.procs.zygote import fast_exit


def main(algorithm: type, schema: type, argv: list[str] | None = None) -> int:
    """`python -m algorithms.X --config FILE key=value ... [--debug]` for any algorithm.

    A failure prints one line, `error: ...`; `--debug` (or MESHRL_DEBUG=1) adds
    the full traceback, the remote one included.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or debugging()
    if debug:  # the procs spawned from here on see it too: every detail on the console
        os.environ["MESHRL_DEBUG"] = "1"
    cfg = parse_cli(schema, [a for a in args if a != "--debug"])
    # A scheduler's SIGTERM (preemption, scancel) stops the run like Ctrl-C: at
    # once outside the loop; inside it the run's own `StopRequest` takes over.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        algorithm(cfg).run()
    except KeyboardInterrupt as stop:
        if debug:
            traceback.print_exc()
        print(f"interrupted: {stop or 'every proc stopped'}", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the CLI's last word: one line, not a wall
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(error)}", file=sys.stderr)
        if not debug:
            print("(run again with --debug for the full traceback)", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0


def run_main(algorithm: type, schema: type) -> None:
    """`main` as a program's entry point (`if __name__ == "__main__"`): the process
    ends as soon as the run has (`fast_exit`: exit hooks run and streams are
    flushed; the interpreter's teardown of torch's modules, about a second of CPU,
    is skipped)."""
    fast_exit(main(algorithm, schema))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
