"""Acting as another local user (uid 65534, through `setpriv`) against a running run:
which of its sockets that user can connect to, which of its files it can read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from meshrl.procs.channels import socket_inodes

NOBODY = 65534
DROP = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")


def available() -> bool:
    """Whether this process can act as another user (root, with setpriv)."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def as_nobody(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -c code args` as uid 65534 (no groups), from `/`."""
    return subprocess.run(
        [*DROP, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


def unix_listeners(pids: set[int]) -> list[str]:
    """Every Unix stream socket one of `pids` listens on, as `/proc/net/unix` names
    it: `@name` for an abstract socket, the path for a pathname one."""
    inodes, found = socket_inodes(pids), []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            parts = line.split()
            # Flags 00010000: accepting connections (listening).
            if len(parts) >= 8 and parts[6] in inodes and int(parts[3], 16) & 0x10000:
                found.append(parts[7])
    return found


PROBE = r"""
import json, os, socket, sys
wanted = json.loads(sys.stdin.read())
connected, read = [], []
for name in wanted["sockets"]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect("\0" + name[1:] if name.startswith("@") else name)
        connected.append(name)
    except OSError:
        pass
    finally:
        s.close()
for path in wanted["files"]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        read.append(path)
    except OSError:
        pass
for path in wanted["dirs"]:
    try:
        os.listdir(path)
        read.append(path)
    except OSError:
        pass
print(json.dumps({"sockets": connected, "files": read}))
"""


def reached_by_nobody(pids: set[int], paths: list[str] = ()) -> dict[str, list[str]]:
    """What uid 65534 reaches of a run: the Unix sockets its processes `pids` listen
    on that it can connect to, and the files and directories under `paths` (walked
    here, as this user) it can read or list."""
    files, dirs = [], []
    for root in paths:
        for where, subdirs, names in os.walk(root):
            dirs.append(where)
            files += [os.path.join(where, n) for n in names]
            dirs += [
                os.path.join(where, d) for d in subdirs if os.path.islink(os.path.join(where, d))
            ]
    wanted = {"sockets": unix_listeners(pids), "files": files, "dirs": dirs}
    probe = subprocess.run(
        [*DROP, sys.executable, "-c", PROBE],
        input=json.dumps(wanted),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout)


TLS_PROBE = r"""
import socket, ssl, sys
host, port = sys.argv[1], int(sys.argv[2])
context = ssl.create_default_context()
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE  # an intruder takes any server; it has no certificate
try:
    with socket.create_connection((host, port), timeout=10) as raw:
        with context.wrap_socket(raw) as tls:
            tls.sendall(b"\0" * 64)
            tls.settimeout(10)
            data = tls.recv(64)
            print("answered" if data else "closed")
except (ssl.SSLError, OSError) as error:
    print("refused:", error)
"""


def tls_without_certificate(host: str, port: int) -> str:
    """What uid 65534 sees when it talks TLS, with no client certificate, to `host:port`
    and sends a few bytes: `refused: ...` (the server's alert), `closed`, or `answered`."""
    probe = as_nobody(TLS_PROBE, host, str(port))
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip()
