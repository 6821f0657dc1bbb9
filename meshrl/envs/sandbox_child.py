"""The sandbox's first code in the fresh interpreter, before the program runs.

`meshrl.envs.sandbox` passes this file's text with `python -I -B -c`, its
settings as the Python literal `SPEC` put in front (json would cost a third of
the interpreter's start); it imports nothing but the standard library. In
order, each step irreversible for everything that follows, forks included:

0. where the run has a mount namespace: a tmpfs of bounded bytes and inodes
   over the scratch directory (main.py copied into it); unprivileged (uid 0 of
   a user namespace) every capability dropped right after;
1. drop to the run's own uid (when started as root);
2. resource limits;
3. no_new_privs, then a seccomp filter: no sockets of any family, no io_uring
   (its ops would go around the filter), no ptrace, mounts, namespaces, BPF,
   perf or keyrings; where the program shares the caller's uid, no chmod,
   chown, utime or xattr changes by path or by descriptor either (Landlock
   does not cover them); without a PID namespace no setsid or setpgid, and
   (shared uid) the calls that reach another process by its number only for
   the program's own (see `_rules` and `meshrl.envs.sandbox`);
4. a Landlock domain: read (no execute) only the allow-list (the Python
   install, system libraries, the task's inputs), everything only inside the
   scratch directory, no TCP bind or connect, no signals and no abstract unix
   sockets across the domain's edge;
5. the audit hook: clear `sandbox: ...` errors for what the kernel refuses
   anyway (a symlink's target judged from the link's directory, chmod/chown/
   xattrs by descriptor refused), with its state in a closure the program
   cannot reach;
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
            "fchmod": 91,
            "fchown": 93,
            "fsetxattr": 190,
            "fremovexattr": 199,
            "setsid": 112,
            "setpgid": 109,
            "prlimit64": 302,
            "sched_setaffinity": 203,
            "sched_setscheduler": 144,
            "sched_setparam": 142,
            "sched_setattr": 314,
            "setpriority": 141,
            "ioprio_set": 251,
            "migrate_pages": 256,
            "move_pages": 279,
            "kill": 62,
            "tkill": 200,
            "tgkill": 234,
            "rt_sigqueueinfo": 129,
            "rt_tgsigqueueinfo": 297,
            "capset": 126,
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
            "fchmod": 52,
            "fchown": 55,
            "fsetxattr": 7,
            "fremovexattr": 16,
            "setsid": 157,
            "setpgid": 154,
            "prlimit64": 261,
            "sched_setaffinity": 122,
            "sched_setscheduler": 119,
            "sched_setparam": 118,
            "sched_setattr": 274,
            "setpriority": 140,
            "ioprio_set": 30,
            "migrate_pages": 238,
            "move_pages": 239,
            "kill": 129,
            "tkill": 130,
            "tgkill": 131,
            "rt_sigqueueinfo": 138,
            "rt_tgsigqueueinfo": 240,
            "capset": 91,
        },
    ),
}
_GENERIC = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "fchmodat2": 452,
    "pidfd_send_signal": 424,
    "setxattrat": 463,
    "removexattrat": 466,
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
    "fchmod",
    "fchown",
    "fsetxattr",
    "fremovexattr",
    "setxattrat",
    "removexattrat",
)
# Without a PID namespace: calls that reach another process by its number.
# Each is allowed only when aimed at the program's first process (0, or its own
# pid); `setpriority` and `ioprio_set` only for one process (not a group or user).
_SELF = (
    "prlimit64",
    "sched_setaffinity",
    "sched_setscheduler",
    "sched_setparam",
    "sched_setattr",
    "migrate_pages",
    "move_pages",
)
# ... and signals, where Landlock cannot scope them (ABI < 6). `kill(0)` and
# `killpg` of its own group stay allowed (the group is the program's: no setsid).
_SIGNALS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")

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


def _rules(spec: dict, self_pid: int) -> tuple[tuple[str, ...], dict[str, list]]:
    """What the filter refuses outright, and the calls allowed only with certain
    arguments: name -> alternatives, each a list of (argument, value) that must
    all match (the low 32 bits: these arguments are ints)."""
    denied = _DENIED
    shared, pidns = spec["shared_uid"], spec.get("pidns", False)
    if shared:
        denied += _METADATA
    if not pidns:
        # The wall limit kills the process group: no way out of it.
        denied += ("setsid", "setpgid")
    rules: dict[str, list] = {}
    if shared and not pidns:
        me = [[(0, 0)], [(0, self_pid)]]
        rules.update({name: me for name in _SELF})
        rules["setpriority"] = [[(0, 0), (1, 0)], [(0, 0), (1, self_pid)]]  # PRIO_PROCESS
        rules["ioprio_set"] = [[(0, 1), (1, 0)], [(0, 1), (1, self_pid)]]  # IOPRIO_WHO_PROCESS
        if spec["landlock"] < 6:
            group = [(0, -self_pid & 0xFFFFFFFF)]
            rules["kill"] = [*me, group]
            rules.update({name: [[(0, self_pid)]] for name in _SIGNALS[1:]})
            denied += ("pidfd_send_signal",)
    return denied, rules


def seccomp(libc: _Libc, machine: str, spec: dict) -> None:
    arch, numbers = _ARCH[machine]
    numbers = {**numbers, **_GENERIC}
    names, rules = _rules(spec, os.getpid())
    denied = sorted({numbers[n] for n in names if n in numbers})
    errno_eperm, allow, kill = 0x00050000 | 1, 0x7FFF0000, 0x80000000
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    # (code, jump if true, jump if false, k); a jump is 0 (next) or a label.
    prog: list[list] = []
    labels: dict[str, int] = {}
    prog += [[ld, 0, 0, 4], [jeq, 0, "kill", arch], [ld, 0, 0, 0]]
    if machine == "x86_64":  # the x32 ABI's numbers would miss the lists below
        prog.append([jge, "eperm", 0, 0x40000000])
    prog += [[jeq, "eperm", 0, number] for number in denied]
    for name, alternatives in sorted(rules.items()):
        if name not in numbers:
            continue
        prog.append([jeq, 0, f"{name}/end", numbers[name]])
        for i, conditions in enumerate(alternatives):
            for arg, value in conditions:
                # struct seccomp_data: nr, arch, ip, then the u64 args (little-endian)
                prog += [[ld, 0, 0, 16 + 8 * arg], [jeq, 0, f"{name}/{i}", value]]
            prog.append([ret, 0, 0, allow])
            labels[f"{name}/{i}"] = len(prog)
        prog.append([ret, 0, 0, errno_eperm])
        labels[f"{name}/end"] = len(prog)
    prog.append([ret, 0, 0, allow])
    labels["eperm"] = len(prog)
    prog.append([ret, 0, 0, errno_eperm])
    labels["kill"] = len(prog)
    prog.append([ret, 0, 0, kill])
    for i, op in enumerate(prog):
        for j in (1, 2):
            if isinstance(op[j], str):
                op[j] = labels[op[j]] - i - 1
                if not 0 <= op[j] < 256:
                    raise ValueError("seccomp: a jump past 255 instructions")
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


def scratch_fs(libc: _Libc, scratch: str, limits: dict, uid: int | None) -> None:
    """A tmpfs of bounded bytes and inodes over the scratch directory, in the
    run's own mount namespace (the parent's view keeps the directory as it was)."""
    options = f"size={limits['bytes']},nr_inodes={limits['inodes']},mode=0700"
    if uid is not None:
        options += f",uid={uid},gid={uid}"
    flags = 2 | 4 | 8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
    result = libc.lib.mount(
        b"tmpfs", scratch.encode(), b"tmpfs", ctypes.c_ulong(flags), options.encode()
    )
    libc.check(result, "mount tmpfs")
    os.chdir(scratch)  # the working directory was the directory under the mount


def drop_capabilities(libc: _Libc, machine: str) -> None:
    """Uid 0 of a user namespace (`unshare --map-root-user`, needed to mount the
    scratch filesystem) keeps no capability: capset(all empty)."""
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0))
    data = ctypes.create_string_buffer(bytes(24))  # 2 x (effective, permitted, inheritable)
    number = {"x86_64": 126, "aarch64": 91}[machine]
    libc.check(libc.lib.syscall(ctypes.c_long(number), header, data), "capset")


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
        "os.link": 2,
        "os.chmod": 1,
        "os.chown": 1,
        "os.setxattr": 1,
        "os.removexattr": 1,
        "os.truncate": 1,
        "os.utime": 1,
        "shutil.rmtree": 1,
        "shutil.move": 2,
    }
    no_import = frozenset(
        {"_ctypes", "_posixsubprocess", "_socket", "_testcapi", "_testinternalcapi"}
    )
    by_fd = frozenset({"os.chmod", "os.chown", "os.setxattr", "os.removexattr"})
    realpath, fsdecode, join, dirname, abspath = (
        os.path.realpath,
        os.fsdecode,
        os.path.join,
        os.path.dirname,
        os.path.abspath,
    )

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
        elif event in by_fd and isinstance(args[0], int):
            raise PermissionError(f"sandbox: {event} by file descriptor is not allowed")
        elif event == "os.symlink":
            # The kernel resolves a relative target from the link's directory.
            target, link = fsdecode(args[0]), fsdecode(args[1])
            if not inside(link) or not inside(join(dirname(abspath(link)), target)):
                raise PermissionError(
                    f"sandbox: os.symlink outside the scratch directory: {link} -> {target}"
                )
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
    with open("main.py") as f:
        source = f.read()
    try:
        libc = _Libc()
        if spec.get("scratch"):
            step = "the scratch filesystem"
            scratch_fs(libc, scratch, spec["scratch"], spec["uid"])
        if spec["uid"] is not None:
            step = "the uid drop"
            os.setgroups([])
            os.setresgid(spec["uid"], spec["uid"], spec["uid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        if spec.get("scratch"):
            with open("main.py", "w") as f:
                f.write(source)
        if spec.get("userns"):
            step = "dropping the user namespace's capabilities"
            drop_capabilities(libc, os.uname().machine)
        step = "resource limits"
        for name, value in spec["limits"]:
            resource.setrlimit(getattr(resource, name), (value, value))
        step = "no_new_privs"
        libc.check(libc.lib.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if spec["seccomp"]:
            step = "seccomp"
            seccomp(libc, os.uname().machine, spec)
        if spec["landlock"]:
            step = "landlock"
            landlock(libc, spec["landlock"], spec["read"], scratch)
    except (OSError, KeyError, ValueError) as error:
        os.write(2, f"sandbox: could not apply {step}: {error}\n".encode())
        os._exit(SETUP_FAILED)
    if spec["audit"]:
        guard(scratch, spec["fork_ok"])
    # The program's own module: `import __main__` finds its globals, not these.
    module = types.ModuleType("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"], sys.argv = module, ["main.py"]
    exec(compile(source, "main.py", "exec"), module.__dict__)


main()
