"""What the `meshrl` subcommands that read a run directory share (`meshrl report`,
`meshrl status`; the command itself is `meshrl.commands`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


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
