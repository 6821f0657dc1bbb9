"""The `meshrl` command: `meshrl report RUN_DIR`, `meshrl status RUN_DIR`,
`meshrl export CHECKPOINT_OR_RUN_DIR OUT_DIR`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

USAGE = "usage: meshrl report RUN_DIR | meshrl status RUN_DIR | meshrl export CHECKPOINT OUT_DIR"


def run_dir_command(
    name: str, argv: list[str] | None, read: Callable[[str], Any], show: Callable[[str, Any], None]
) -> int:
    """`meshrl NAME RUN_DIR`: `read(run_dir)`, then `show(run_dir, what was read)`;
    a missing or unreadable file is one error line (exit 1), bad usage exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: meshrl {name} RUN_DIR", file=sys.stderr)
        return 2
    try:
        content = read(args[0])
    except (OSError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    show(args[0], content)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("report", "status", "export"):
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] == "report":
        from meshrl.report import main as command
    elif args[0] == "status":
        from meshrl.status import main as command
    else:
        from meshrl.export import main as command
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
