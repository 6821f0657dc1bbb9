"""The `meshrl` command. `meshrl eval` and `meshrl serve` spawn actors, so they live
in this, the top layer; `report`, `status` and `export` are the core's (`meshrl.cli`)."""

from __future__ import annotations

import sys

from meshrl import cli

USAGE = (
    f"{cli.USAGE} | meshrl eval MODEL --config FILE [key=value ...]"
    " | meshrl serve MODEL --config FILE [key=value ...]"
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "eval":
        from algorithms.evaluate import main as command

        return command(args[1:])
    if args and args[0] == "serve":
        from algorithms.serve import main as command

        return command(args[1:])
    if not args or args[0] not in cli.COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
