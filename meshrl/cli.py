"""The `meshrl` command: `meshrl report RUN_DIR`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "report":
        print("usage: meshrl report RUN_DIR", file=sys.stderr)
        return 2
    from meshrl.report import main as report

    return report(args[1:])


if __name__ == "__main__":
    sys.exit(main())
