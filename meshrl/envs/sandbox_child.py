"""The sandbox's first code in the fresh interpreter, before the program runs.

`meshrl.envs.sandbox` passes this file's text with `python -I -B -c`, its
settings as the Python literal `SPEC` put in front (json would cost a third of
the interpreter's start); it imports nothing but the standard library. In
order, each step irreversible for everything that follows, forks included:

1. drop to the run's own uid (when started as root);
2. resource limits;
3. no_new_privs, then a seccomp filter: no sockets of any family, no io_uring
   (its ops would go around the filter), no ptrace, mounts, namespaces, BPF,
   perf or keyrings; where the program shares the caller's uid, no chmod,
   chown, utime or xattr changes by path either (Landlock does not cover them);
4. a Landlock domain: read (no execute) only the allow-list (the Python
   install, system libraries, the task's inputs), everything only inside the
   scratch directory, no TCP bind or connect, no signals and no abstract unix
   sockets across the domain's edge;
5. the audit hook: clear `sandbox: ...` errors for what the kernel refuses
   anyway, with its state in a closure the program cannot reach;
6. the program, as `__main__`.

A step the parent asked for that fails ends the run (exit status 111, the
reason on stderr): a program never runs with less isolation than its result
reports.
"""

import ctypes
import os
import resource
import struct
import sys
import types

SETUP_FAILED = 111

# Syscall numbers that differ between the architectures (the rest are generic).
_ARCH = {
    "x86_64": (
        0xC000003E,
        {
            "socket": 41,
            "ptrace": 101,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "chroot": 161,
            "setns": 308,
            "unshare": 272,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "chmod": 90,
            "fchmodat": 268,
            "chown": 92,
            "lchown": 94,
            "fchownat": 260,
            "utime": 132,
            "utimes": 235,
            "futimesat": 261,
            "utimensat": 280,
            "setxattr": 188,
            "lsetxattr": 189,
            "removexattr": 197,
            "lremovexattr": 198,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "socket": 198,
            "ptrace": 117,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "chroot": 51,
            "setns": 268,
            "unshare": 97,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "fchmodat": 53,
            "fchownat": 54,
            "utimensat": 88,
            "setxattr": 5,
            "lsetxattr": 6,
            "removexattr": 14,
            "lremovexattr": 15,
        },
    ),
}
_GENERIC = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "fchmodat2": 452,
    "landlock_create_ruleset": 444,
    "landlock_add_rule": 445,
    "landlock_restrict_self": 446,
}
_DENIED = (
    "socket",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "setns",
    "unshare",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "process_vm_readv",
    "process_vm_writev",
)
_METADATA = (
    "chmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
    "setxattr",
    "lsetxattr",
    "removexattr",
    "lremovexattr",
)

# Landlock rights by ABI version (linux/landlock.h).
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # execute, write, read, truncate, ioctl
_READ = 4 | 8  # read file, read dir
_NET_TCP = 1 | 2  # bind, connect
_SCOPES = 1 | 2  # abstract unix sockets, signals


class _Libc:
    def __init__(self):
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.syscall.restype = ctypes.c_long

    def check(self, result: int, what: str) -> int:
        if result < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")
        return result

    def syscall(self, name: str, *args) -> int:
        return self.check(self.lib.syscall(ctypes.c_long(_GENERIC[name]), *args), name)


def seccomp(libc: _Libc, machine: str, shared_uid: bool) -> None:
    arch, numbers = _ARCH[machine]
    numbers = {**numbers, **_GENERIC}
    names = _DENIED + (_METADATA if shared_uid else ())
    denied = sorted({numbers[n] for n in names if n in numbers})
    errno_eperm, allow, kill = 0x00050000 | 1, 0x7FFF0000, 0x80000000
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI's numbers would miss the list below
        prog.append((jge, len(denied) + 1, 0, 0x40000000))
    for i, number in enumerate(denied):
        prog.append((jeq, len(denied) - i, 0, number))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, errno_eperm)]
    code = b"".join(struct.pack("HBBI", *op) for op in prog)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog)
    # prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog)
    libc.check(libc.lib.prctl(22, 2, fprog_buffer, 0, 0), "seccomp")


def landlock(libc: _Libc, abi: int, read: list[str], scratch: str) -> None:
    fs = _FS_RIGHTS[max(v for v in _FS_RIGHTS if v <= abi)]
    attr = struct.pack("QQQ", fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall("landlock_create_ruleset", attr, ctypes.c_size_t(size), 0)
    for path, rights in [*((p, _READ) for p in read), (scratch, fs)]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # an allowed path this machine lacks
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        # struct landlock_path_beneath_attr is packed: u64 rights, s32 fd.
        rule = struct.pack("=Qi", rights & fs, fd)
        libc.syscall("landlock_add_rule", ctypes.c_int(ruleset), 1, rule, 0)
        os.close(fd)
    libc.syscall("landlock_restrict_self", ctypes.c_int(ruleset), 0)
    os.close(ruleset)


def guard(scratch: str, fork_ok: bool) -> None:
    """The convenience layer: readable refusals. Its state lives in this
    closure, reachable from no module, and the introspection that could find it
    (gc's object walks, rebinding a function's code) is refused with the rest."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    blocked = (
        "socket.",
        "ctypes.",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "subprocess.",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    )
    path_events = {
        "os.rename": 2,
        "os.remove": 1,
        "os.rmdir": 1,
        "os.mkdir": 1,
        "os.symlink": 2,
        "os.link": 2,
        "os.chmod": 1,
        "os.chown": 1,
        "os.truncate": 1,
        "os.utime": 1,
        "shutil.rmtree": 1,
        "shutil.move": 2,
    }
    no_import = frozenset(
        {"_ctypes", "_posixsubprocess", "_socket", "_testcapi", "_testinternalcapi"}
    )
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an open descriptor: its opening was checked
        real = realpath(fsdecode(path))
        return real == scratch or real.startswith(scratch + "/")

    def hook(event: str, args: tuple) -> None:
        if event == "os.fork" and not fork_ok:
            raise PermissionError("sandbox: os.fork is not allowed")
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in no_import:
            raise ImportError(f"sandbox: module {args[0]} is not allowed")
        if event == "object.__setattr__" and args[1] in ("__code__", "__closure__"):
            raise PermissionError(f"sandbox: setting {args[1]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if realpath(fsdecode(path)).startswith("/proc/"):
                raise PermissionError(f"sandbox: /proc is not readable here: {path}")
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing outside the scratch directory: {path}")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the scratch directory: {path}")

    sys.addaudithook(hook)


SPEC: dict = globals().get("SPEC", {})  # set by the parent in front of this text


def main() -> None:
    spec = SPEC
    scratch = os.path.realpath(os.getcwd())
    step = "setup"
    try:
        if spec["uid"] is not None:
            step = "the uid drop"
            os.setgroups([])
            os.setresgid(spec["uid"], spec["uid"], spec["uid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        step = "resource limits"
        for name, value in spec["limits"]:
            resource.setrlimit(getattr(resource, name), (value, value))
        libc = _Libc()
        step = "no_new_privs"
        libc.check(libc.lib.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if spec["seccomp"]:
            step = "seccomp"
            seccomp(libc, os.uname().machine, spec["shared_uid"])
        if spec["landlock"]:
            step = "landlock"
            landlock(libc, spec["landlock"], spec["read"], scratch)
    except (OSError, KeyError, ValueError) as error:
        os.write(2, f"sandbox: could not apply {step}: {error}\n".encode())
        os._exit(SETUP_FAILED)
    with open("main.py") as f:
        source = f.read()
    if spec["audit"]:
        guard(scratch, spec["fork_ok"])
    # The program's own module: `import __main__` finds its globals, not these.
    module = types.ModuleType("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"], sys.argv = module, ["main.py"]
    exec(compile(source, "main.py", "exec"), module.__dict__)


main()
