"""meshrl's own C code, built once per machine with the system's C compiler.

`$CC`, else `cc`; into `$XDG_CACHE_HOME/meshrl` (default `~/.cache/meshrl`), a
directory that must belong to this user and be writable by no one else;
otherwise into a private temporary directory, once per process. A library's file
name holds a hash of its source, flags, the compiler and the machine, so nodes of
another architecture sharing a home directory build their own. Used by the
weight sync's copy-and-sum kernel (`meshrl.weights.native`) and the channels'
socket hook (`meshrl.procs.channels`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile

CACHE_ENV = "XDG_CACHE_HOME"

_private: str | None = None  # a per-process build directory, removed at exit


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def owned(path: str, kind: int, forbidden: int, follow: bool = False) -> bool:
    """Whether `path` is a file of type `kind` (`stat.S_IFDIR`, `stat.S_IFREG`) of
    this user's, none of the mode bits `forbidden` set (a link is not followed
    unless `follow`)."""
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_IFMT(info.st_mode) == kind
        and info.st_uid == os.getuid()
        and not info.st_mode & forbidden
    )


def _private_dir(path: str) -> bool:
    """Whether `path` is a directory of this user's that no one else can write."""
    return owned(path, stat.S_IFDIR, stat.S_IWGRP | stat.S_IWOTH)


def _cache_dir() -> str:
    """The per-user build cache, or (when it is not private) a per-process one."""
    global _private
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "meshrl")
    with contextlib.suppress(OSError):
        os.makedirs(path, mode=0o700, exist_ok=True)
    if _private_dir(path):
        return path
    if _private is None:
        import atexit

        _private = tempfile.mkdtemp(prefix="meshrl-native-")
        atexit.register(shutil.rmtree, _private, True)
    return _private


def _build(compiler: str, name: str, source: str, flags: list[str]) -> str:
    """The shared library's path, built unless a build of this exact source,
    flags, compiler and machine is there already."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    key = "\0".join([source, " ".join(flags), version, platform.machine(), platform.system()])
    directory = _cache_dir()
    path = os.path.join(directory, f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source_path = os.path.join(work, f"{name}.c")
        with open(source_path, "w") as f:
            f.write(source)
        built = os.path.join(work, f"{name}.so")
        subprocess.run(
            [compiler, *flags, source_path, "-o", built],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.chmod(built, 0o700)
        os.replace(built, path)  # atomic: another proc may build the same at once
    return path


def compile_library(name: str, source: str, flags: list[str]) -> str | None:
    """A shared library of meshrl's own C `source`, built once per machine into the
    private cache (as the copy-and-sum kernel is); None without a compiler or where
    the build fails."""
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        return _build(compiler, name, source, flags)
    except (OSError, subprocess.SubprocessError):
        return None
