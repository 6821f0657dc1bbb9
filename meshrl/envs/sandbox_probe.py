"""What the sandbox can enforce on this machine: `probe` and `Isolation`.

Split from `meshrl.envs.sandbox`, which applies what this finds; like it,
standard library only.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Run uids for a root caller: one per run, far above any account's.
_UID_BASE = 0x3F000000
# No network; a mount namespace (the scratch directory becomes a tmpfs of
# bounded size there); a PID namespace whose processes all die with its first
# one, which dies with `unshare` (--kill-child): nothing the code forks outlives
# the run. Unprivileged, `--map-root-user` lets the child mount the tmpfs; it
# then drops every capability before anything else.
NAMESPACES = ("--net", "--mount", "--pid", "--fork", "--kill-child", "--")
USERNS = ("--user", "--map-root-user")
MINIMUM = ("files", "network")
HOW_TO = {
    "files": "Landlock (Linux >= 5.13 with 'landlock' in the lsm= boot list)",
    "network": "a network namespace (run as root, or allow unprivileged user namespaces: "
    "sysctl kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0)"
    " or seccomp filters (CONFIG_SECCOMP_FILTER)",
}


@dataclass(frozen=True)
class Isolation:
    """What a run gets on this machine (`probe`)."""

    landlock_abi: int = 0
    seccomp: bool = False
    python: str = sys.executable
    """The interpreter programs run under."""
    python_paths: tuple[str, ...] = ()
    """Its install: what Landlock lets a program read besides the system's."""
    launcher: tuple[str, ...] = ()
    """The command prefix that enters new network, mount and PID namespaces, or ()."""
    run_uid: bool = False
    """Each run gets a uid of its own (the caller is root)."""
    audit_hook: bool = True

    @property
    def in_force(self) -> tuple[str, ...]:
        names = []
        if self.landlock_abi:
            names.append(f"landlock-v{self.landlock_abi}")
        if self.seccomp:
            names.append("seccomp")
        if self.launcher:
            names += ["netns", "pidns", "scratch-tmpfs"]
        if self.run_uid:
            names.append("run-uid")
        names.append("rlimits")
        if self.audit_hook:
            names.append("audit-hook")
        return tuple(names)

    @property
    def missing(self) -> tuple[str, ...]:
        """Which of the minimum (files, network) this machine cannot enforce."""
        have = {"files": self.landlock_abi >= 1, "network": self.seccomp or bool(self.launcher)}
        return tuple(name for name in MINIMUM if not have[name])


def _landlock_abi() -> int:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
        return max(int(libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), 1)), 0)
    except (OSError, AttributeError):
        return 0


def _seccomp_filters() -> bool:
    try:
        actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        return False
    return "errno" in actions and os.uname().machine in ("x86_64", "aarch64")


@functools.cache
def probe(without: frozenset[str] = frozenset()) -> Isolation:
    """What this kernel and user allow, minus the mechanisms named in `without`
    ("landlock", "seccomp", "namespaces", "audit_hook": for tests that prove
    what each one contains on its own; "landlock_scopes": Landlock ABI 5 at
    most, as on kernels before 6.12, whose Landlock cannot scope signals)."""
    launcher: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if unshare and "namespaces" not in without:
        prefix = (unshare, *NAMESPACES) if os.geteuid() == 0 else (unshare, *USERNS, *NAMESPACES)
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        launcher = prefix if ok else ()
    python, python_paths = _interpreter(os.geteuid() == 0)
    return Isolation(
        python=python,
        python_paths=python_paths,
        landlock_abi=0
        if "landlock" in without
        else min(_landlock_abi(), 5)
        if "landlock_scopes" in without
        else _landlock_abi(),
        seccomp="seccomp" not in without and _seccomp_filters(),
        launcher=launcher,
        run_uid=os.geteuid() == 0,
        audit_hook="audit_hook" not in without,
    )


class SandboxUnavailable(RuntimeError):
    """The kernel cannot give programs the minimum isolation here."""


# Run as the interpreter's first code in `_interpreter`: drop to the run uid
# (when root), import what the sandbox needs, and say where the install lies.
_INSTALL = (
    "import os, sys\n"
    "if os.geteuid() == 0:\n"
    "    os.setgroups([]); os.setresgid(%(uid)d, %(uid)d, %(uid)d); os.setresuid(%(uid)d, %(uid)d, %(uid)d)\n"
    "import ctypes, datetime, json, resource\n"
    "print(json.dumps(sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,"
    " os.path.realpath(sys.executable)})))"
)


@functools.cache  # probe() runs once per `without`; the interpreter is the same
def _interpreter(run_uid: bool) -> tuple[str, tuple[str, ...]]:
    """An interpreter the program's uid can run, and the paths of its install
    (Landlock's read list). This one, unless the run uid cannot read it (an
    install under root's home): then a system Python of the same version."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable]
    if run_uid:
        for folder in ("/usr/bin", "/usr/local/bin"):
            candidates += [f"{folder}/{version}", f"{folder}/python3"]
    for python in candidates:
        try:
            probe = subprocess.run(
                [python, "-I", "-B", "-c", _INSTALL % {"uid": _UID_BASE}],
                capture_output=True,
                text=True,
                timeout=30,
                cwd="/",
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return python, tuple(json.loads(probe.stdout))
    raise SandboxUnavailable(
        f"sandbox: no Python interpreter here that an unprivileged uid can run (tried {candidates})"
    )
