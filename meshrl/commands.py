"""The core's `meshrl` subcommands: `meshrl report RUN_DIR`, `meshrl status RUN_DIR`,
`meshrl profile RUN_DIR [--steps N]`, `meshrl scale RUN_DIR role=N ...`,
`meshrl export CHECKPOINT_OR_RUN_DIR OUT_DIR`. The whole `meshrl` command, with
`eval` and `serve`, which spawn actors, is the top layer's (`algorithms.commands`)."""

from __future__ import annotations

import sys

USAGE = (
    "usage: meshrl report RUN_DIR | meshrl status RUN_DIR | meshrl profile RUN_DIR [--steps N]"
    " | meshrl scale RUN_DIR role=N ... | meshrl export CHECKPOINT OUT_DIR"
)
COMMANDS = ("report", "status", "profile", "scale", "export")
"""The core's commands; `meshrl eval` and `meshrl serve` are the top layer's."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] == "report":
        from meshrl.observe.report import main as command
    elif args[0] == "status":
        from meshrl.observe.status import main as command
    elif args[0] == "profile":
        from meshrl.observe.profile import main as command
    elif args[0] == "scale":
        from meshrl.loop.elastic import main as command
    else:
        from meshrl.loop.export import main as command
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
