"""Monarch's channels, private to the run's user: `seal()` before Monarch serves.

Monarch 0.7 serves each host's backend, and each proc's bootstrap callback, on an
abstract Unix socket (`unix:@<random name>`; hyperactor's `ChannelAddr::any(Unix)`
draws the name, and no setting changes it). An abstract socket has no owner and
no mode: any process of any user on the machine can connect to it (its name is
in the world-readable `/proc/net/unix` and in Monarch's log), and through a
host's backend send messages that its router delivers to the host's agent, which
spawns procs and actors as the run's user. The kernel scopes abstract names by
network namespace only, which a notebook's kernel cannot enter.

So meshrl moves them into the file system. A few lines of C (compiled once per
machine, `meshrl.procs.compiled`) take the place of `bind` and
`connect` for Monarch's own code: an abstract address `\\0NAME` becomes
`<channel dir>/NAME`, a pathname socket in a directory made by `mkdtemp`
(mode 0700, this user's), and every Unix socket Monarch binds by path is made
0600. The kernel then refuses any other user before it connects (the
directory's search permission, the socket's write permission). Two ways in:

- this process (a controller, a SLURM worker, a forked proc): the entries of
  Monarch's extension for `bind` and `connect` in its global offset table are
  pointed at the C functions (`hook_process`), before Monarch binds anything;
- every process started from here (procs, process-job hosts, the fork
  server): `LD_PRELOAD` of the same library, and `MESHRL_CHANNEL_DIR`.

What travels between hosts (SLURM, Kubernetes) is TCP: `meshrl.procs.tls`
authenticates both ends of each connection with the run's own certificates.
Monarch's log (`/tmp/<user>/monarch_log.log`, a path Monarch fixes) is kept in
a directory only its user can open, and capped (`secure_monarch_log`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable

from meshrl.procs import compiled

DIR_ENV = "MESHRL_CHANNEL_DIR"
LIB_ENV = "MESHRL_CHANNEL_LIB"
OPEN_ENV = "MESHRL_OPEN_CHANNELS"  # "1": leave Monarch's abstract sockets as they are

LOG_CAP_BYTES = 64 << 20
"""Monarch's log is moved aside (one older copy kept) when a run starts or ends
with it past this size: it appends every proc's events and never rotates."""

SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

/* 1: an abstract AF_UNIX address (sun_path[0] == 0) rewritten into `out` as
   $MESHRL_CHANNEL_DIR/NAME; 0: any other address, left as it is; -1: a name that
   cannot be a file name there. */
static int rewrite(const struct sockaddr *addr, socklen_t len, struct sockaddr_un *out) {
    const char *dir = getenv("MESHRL_CHANNEL_DIR");
    size_t head = offsetof(struct sockaddr_un, sun_path);
    if (dir == NULL || dir[0] != '/' || addr == NULL || addr->sa_family != AF_UNIX
        || len <= head + 1)
        return 0;
    const char *path = ((const struct sockaddr_un *)addr)->sun_path;
    if (path[0] != 0) return 0;
    size_t name_len = len - head - 1, dir_len = strlen(dir);
    if (dir_len + 1 + name_len + 1 > sizeof(out->sun_path)) return -1;
    for (size_t i = 0; i < name_len; i++)
        if (path[1 + i] == '/' || path[1 + i] == 0) return -1;
    memset(out, 0, sizeof(*out));
    out->sun_family = AF_UNIX;
    memcpy(out->sun_path, dir, dir_len);
    out->sun_path[dir_len] = '/';
    memcpy(out->sun_path + dir_len + 1, path + 1, name_len);
    return 1;
}

int meshrl_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    struct sockaddr_un un;
    int kind = rewrite(addr, len, &un);
    if (kind < 0) { errno = EINVAL; return -1; }
    const struct sockaddr *target = kind ? (const struct sockaddr *)&un : addr;
    socklen_t target_len = kind ? (socklen_t)sizeof(un) : len;
    long done = syscall(SYS_bind, fd, target, target_len);
    if (done == 0 && target->sa_family == AF_UNIX
        && target_len > offsetof(struct sockaddr_un, sun_path) + 1) {
        const struct sockaddr_un *bound = (const struct sockaddr_un *)target;
        if (bound->sun_path[0] != 0) {
            char name[sizeof(bound->sun_path) + 1];
            size_t n = target_len - offsetof(struct sockaddr_un, sun_path);
            memcpy(name, bound->sun_path, n);
            name[n] = 0;
            chmod(name, 0600);  /* connecting takes write permission: the owner's only */
        }
    }
    return (int)done;
}

int meshrl_connect(int fd, const struct sockaddr *addr, socklen_t len) {
    struct sockaddr_un un;
    int kind = rewrite(addr, len, &un);
    if (kind < 0) { errno = EINVAL; return -1; }
    if (kind) return (int)syscall(SYS_connect, fd, &un, (socklen_t)sizeof(un));
    return (int)syscall(SYS_connect, fd, addr, len);
}

/* The names LD_PRELOAD interposes in the processes a run starts. */
int bind(int fd, const struct sockaddr *addr, socklen_t len)
    __attribute__((alias("meshrl_bind")));
int connect(int fd, const struct sockaddr *addr, socklen_t len)
    __attribute__((alias("meshrl_connect")));
"""


class ChannelsUnavailable(RuntimeError):
    """Monarch's channels cannot be made private in this process."""


_lock = threading.Lock()
_hooked: str | None = None  # the extension whose table points at the library
_made: str | None = None  # the channel directory this process made (removed at exit)


def library_path() -> str:
    """The compiled library (built on first use); ChannelsUnavailable without a compiler."""
    path = os.environ.get(LIB_ENV)
    if path and compiled.owned(path, stat.S_IFREG, stat.S_IWGRP | stat.S_IWOTH, follow=True):
        return path
    path = compiled.compile_library("channels", SOURCE, ["-O2", "-shared", "-fPIC"])
    if path is None:
        raise ChannelsUnavailable(
            "Monarch's local channels cannot be made private: no C compiler ($CC or cc) "
            "to build meshrl's socket hook. Install one (Debian: apt install gcc), or set "
            f"{OPEN_ENV}=1 to run with channels any local user can connect to"
        )
    return path


def private_dir(path: str) -> bool:
    """Whether `path` is a directory of this user's that no one else can enter."""
    return compiled.owned(path, stat.S_IFDIR, 0o077)


def channel_dir() -> str:
    """The directory the run's Unix sockets live in: the inherited one where it is
    private, else a new one (removed when this process exits)."""
    global _made
    inherited = os.environ.get(DIR_ENV)
    if inherited and private_dir(inherited):
        return inherited
    if _made is None or not private_dir(_made):
        # Short: a socket's path must fit in 108 bytes (the names are 24 characters).
        _made = tempfile.mkdtemp(prefix="meshrl-ch-", dir="/tmp")
        atexit.register(shutil.rmtree, _made, True)
    return _made


def _elf_entries(path: str, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Offsets (from the load base) of the global offset table's entries for the
    dynamic symbols `names` in the ELF64 shared object at `path`."""
    import numpy as np

    def read(f, offset: int, size: int) -> bytes:
        f.seek(offset)
        return f.read(size)

    with open(path, "rb") as f:
        header = read(f, 0, 64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ChannelsUnavailable(f"{path}: not a little-endian ELF64 shared object")
        shoff = int.from_bytes(header[0x28:0x30], "little")
        shnum = int.from_bytes(header[0x3C:0x3E], "little")
        section_dtype = np.dtype(
            [
                ("name", "<u4"),
                ("type", "<u4"),
                ("flags", "<u8"),
                ("addr", "<u8"),
                ("offset", "<u8"),
                ("size", "<u8"),
                ("link", "<u4"),
                ("info", "<u4"),
                ("align", "<u8"),
                ("entsize", "<u8"),
            ]
        )
        sections = np.frombuffer(read(f, shoff, shnum * section_dtype.itemsize), section_dtype)
        dynsym_index = next(i for i, s in enumerate(sections) if s["type"] == 11)  # SHT_DYNSYM
        dynsym = sections[dynsym_index]
        strtab = sections[dynsym["link"]]
        symbol_dtype = np.dtype(
            [
                ("name", "<u4"),
                ("info", "u1"),
                ("other", "u1"),
                ("shndx", "<u2"),
                ("value", "<u8"),
                ("size", "<u8"),
            ]
        )
        symbols = np.frombuffer(read(f, int(dynsym["offset"]), int(dynsym["size"])), symbol_dtype)
        strings = read(f, int(strtab["offset"]), int(strtab["size"]))
        wanted = {}
        for name in names:
            key, at = b"\0" + name.encode() + b"\0", 0
            while (at := strings.find(key, at)) >= 0:  # every copy of the name in the table
                for index in np.nonzero(symbols["name"] == at + 1)[0].tolist():
                    wanted[index] = name
                at += 1
        rela_dtype = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
        found: dict[str, list[int]] = {name: [] for name in names}
        for section in sections:
            if section["type"] != 4 or section["link"] != dynsym_index:
                continue  # SHT_RELA against .dynsym only
            rows = np.frombuffer(read(f, int(section["offset"]), int(section["size"])), rela_dtype)
            kinds = rows["info"] & np.uint64(0xFFFFFFFF)
            symbol_of = rows["info"] >> np.uint64(32)
            for index, name in wanted.items():
                # R_X86_64_GLOB_DAT (6) and R_X86_64_JUMP_SLOT (7): a pointer to the function
                hits = rows["offset"][(symbol_of == index) & ((kinds == 6) | (kinds == 7))]
                found[name].extend(int(h) for h in hits)
        return found


def _mapping(path: str) -> tuple[int, list[tuple[int, int, str]]]:
    """The load base of `path` in this process and its mappings (start, end, perms)."""
    real = os.path.realpath(path)
    base, spans = None, []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                spans.append((start, end, parts[1]))
                if int(parts[2], 16) == 0 and base is None:
                    base = start
    if base is None:
        raise ChannelsUnavailable(f"{real} is not mapped in this process")
    return base, spans


def _point(address: int, target: int, spans: list[tuple[int, int, str]]) -> None:
    """Write the pointer `target` at `address`, a read-only page made writable for it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = address & ~(mmap.PAGESIZE - 1)
    perms = next(p for start, end, p in spans if start <= address < end)
    restore = (1 if "r" in perms else 0) | (2 if "w" in perms else 0) | (4 if "x" in perms else 0)
    if libc.mprotect(page, mmap.PAGESIZE, 1 | 2) != 0:
        raise ChannelsUnavailable(f"mprotect: {os.strerror(ctypes.get_errno())}")
    ctypes.c_void_p.from_address(address).value = target
    libc.mprotect(page, mmap.PAGESIZE, restore)


def hook_process() -> None:
    """Point Monarch's `bind` and `connect` in this process at the library (it loads
    Monarch's extension if it is not loaded yet). Idempotent."""
    global _hooked
    with _lock:
        import monarch._rust_bindings as bindings

        extension = bindings.__file__
        if _hooked == extension:
            return
        lib = ctypes.CDLL(library_path())
        entries = _elf_entries(extension, ("bind", "connect"))
        if not entries["bind"] or not entries["connect"]:
            raise ChannelsUnavailable(f"{extension}: no bind/connect entries to hook")
        base, spans = _mapping(extension)
        for name in ("bind", "connect"):
            target = ctypes.cast(getattr(lib, f"meshrl_{name}"), ctypes.c_void_p).value
            for offset in entries[name]:
                _point(base + offset, target, spans)
        _hooked = extension


def hooked() -> bool:
    return _hooked is not None


def socket_inodes(pids: Iterable[int | str]) -> set[str]:
    """The inodes of every socket the processes `pids` hold open (`"self"`: this one)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        found.add(link[len("socket:[") : -1])
    return found


def abstract_sockets(pid: int | str = "self") -> list[str]:
    """The abstract Unix socket names that process `pid` holds open (from
    `/proc/net/unix` and its descriptors): what any local user could connect to."""
    inodes, names = socket_inodes([pid]), []
    with open(f"/proc/{pid}/net/unix") as table:
        next(table)
        for line in table:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("@"):
                names.append(parts[7])
    return names


def seal() -> str | None:
    """Make the Monarch channels of this process and of every process it starts
    private to this user (see the module doc); returns the channel directory, or
    None where `MESHRL_OPEN_CHANNELS=1` asked to leave them open. Call before Monarch
    serves anything: ChannelsUnavailable if it already serves an abstract socket."""
    if os.environ.get(OPEN_ENV) == "1":
        return None
    directory = channel_dir()
    library = library_path()
    os.environ[DIR_ENV] = directory
    os.environ[LIB_ENV] = library
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split() if p and p != library]
    os.environ["LD_PRELOAD"] = " ".join([library, *preload])
    first = not hooked()
    hook_process()
    secure_monarch_log()
    # Once hooked, Monarch binds no abstract socket here: what is there already was
    # served before (a Monarch call before the run's in this process).
    served = abstract_sockets() if first else []
    if served:
        raise ChannelsUnavailable(
            f"Monarch already serves {len(served)} abstract socket(s) in this process "
            f"({served[0]}, ...), open to every local user: start meshrl's run before any "
            "other Monarch call in this process (a fresh Python or notebook kernel)"
        )
    return directory


def monarch_log_dir() -> str:
    """Where Monarch 0.7 writes its log: `/tmp/<user name>` (fixed in its code)."""
    import pwd

    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = "monarch"
    return f"/tmp/{user or 'monarch'}"


def secure_monarch_log(cap_bytes: int = LOG_CAP_BYTES) -> str:
    """Make Monarch's log directory this user's only (0700; refused where another
    user owns it) and move a log past `cap_bytes` aside; returns the directory."""
    directory = monarch_log_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ChannelsUnavailable(
            f"{directory}, where Monarch writes its log, is not a directory of this user's "
            "(another user made it first?): remove it, then start again"
        )
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)
    log = os.path.join(directory, "monarch_log.log")
    with contextlib.suppress(FileNotFoundError):
        os.chmod(log, 0o600)
        if os.path.getsize(log) > cap_bytes:
            os.replace(log, log + ".1")
    return directory
