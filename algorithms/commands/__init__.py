"""Every command-line entry point, in one place:

- `meshrl ...` (`main` here; `python -m algorithms.commands ...` too): `eval` (eval.py)
  and `serve` (serve.py) spawn actors, so they live in this, the top layer; `report`,
  `status`, `profile`, `scale` and `export` are the core's (`meshrl.commands`);
- `python -m algorithms.<algorithm> --config FILE key=value ...`: train.py's `main`,
  which every algorithm's module calls;
- `python -m algorithms.commands.config_reference`: the docs/config/ tables."""

from __future__ import annotations

import sys

from meshrl import commands as core

USAGE = (
    f"{core.USAGE} | meshrl eval MODEL --config FILE [key=value ...]"
    " | meshrl serve MODEL --config FILE [key=value ...]"
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "eval":
        from algorithms.commands.eval import main as command

        return command(args[1:])
    if args and args[0] == "serve":
        from algorithms.commands.serve import main as command

        return command(args[1:])
    if not args or args[0] not in core.COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return core.main(args)
