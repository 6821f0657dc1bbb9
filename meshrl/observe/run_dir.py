"""A run directory: made private to its user (`make_private`, `open_private`), and
what the `meshrl` subcommands that read one share (`meshrl report`, `meshrl status`;
the command itself is `meshrl.commands`)."""

from __future__ import annotations

import errno
import json
import os
import stat
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


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def make_private(path: str) -> str:
    """`path` as a directory only its user can enter (mode 0700), whatever the
    umask: so everything a run keeps in it (checkpoints, samples, logs, `final/`)
    is out of other users' reach, as the kernel enforces. Created so if missing
    (its parents as the umask makes them); an existing directory of this user's
    (one they made for the run, a run resumed) is set to 0700. A directory, or a
    link to one, that another uid owns is refused: PermissionError naming it."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
            raise PermissionError(
                errno.EPERM,
                f"run directory {path} is a link owned by uid {link.st_uid}, not this "
                f"user (uid {os.geteuid()}): refused",
            ) from None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise PermissionError(
                errno.EPERM,
                f"run directory {path} is owned by uid {info.st_uid}, not this user "
                f"(uid {os.geteuid()}): refused",
            )
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR:
            os.fchmod(fd, PRIVATE_DIR)
    finally:
        os.close(fd)
    return path


def private_opener(path: str, flags: int) -> int:
    """An `opener` for `open()`: a file it creates is its owner's only (0600)."""
    return os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)


def open_private(path: str, mode: str = "w", **kwargs):
    """`open(path, mode)`, a file it creates being its owner's only (0600)."""
    return open(path, mode, opener=private_opener, **kwargs)  # noqa: SIM115
