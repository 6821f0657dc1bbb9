"""No other local user can reach a run's Monarch channels (issue #66).

Monarch 0.7 serves hosts' backends and procs' callbacks on abstract Unix sockets,
which have no owner or mode; meshrl moves every one into a 0700 directory
(`meshrl.procs.channels`). These tests act for real as uid 65534: listed from
`/proc/net/unix`, each socket a run's processes listen on is connected to, and
the kernel must refuse every connection."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest
from monarch.actor import Actor, endpoint

from meshrl.procs import channels
from meshrl.procs.job import JobConfig
from meshrl.procs.mesh import RoleMeshes, monarch_pids
from tests.conftest import REPO, descendants, own_pids
from tests.support import other_user

pytestmark = [pytest.mark.actors, pytest.mark.timeout(240)]

needs_root = pytest.mark.skipif(
    not other_user.available(), reason="acting as another user needs root and setpriv"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


class Who(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _check_private(pids: set[int]) -> None:
    sockets = other_user.unix_listeners(pids)
    assert sockets, "the run's processes listen on no Unix socket: nothing was checked"
    abstract = [name for name in sockets if name.startswith("@")]
    assert not abstract, f"abstract sockets any local user can connect to: {abstract}"
    for path in sockets:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
    reached = other_user.reached_by_nobody(pids)
    assert reached["sockets"] == [], f"uid 65534 connected to {reached['sockets']}"


@needs_root
@pytest.mark.parametrize("kind", ["local", "process"])
def test_another_user_cannot_connect_to_a_runs_channels(kind, no_stray_procs):
    """A run's controller, its procs (forks of the fork server) and, for `process`,
    its host processes listen only on pathname sockets of mode 0600 in directories
    only their user can enter; uid 65534 connects to none of them."""
    with RoleMeshes({"a": 2}, JobConfig(kind=kind)) as meshes:
        actors = meshes.by_role["a"].spawn("who", Who)
        procs = set(actors.pid.call().get().values())
        ours = descendants(os.getpid()) | (monarch_pids() & own_pids())
        assert procs <= ours
        _check_private(ours)


def test_an_abstract_socket_bound_through_the_hook_lands_in_the_channel_dir(tmp_path):
    """What Monarch binds as `\\0NAME` is `<dir>/NAME`, mode 0600, and a connect to
    `\\0NAME` reaches it; in a process started with the hook preloaded, Python's
    own abstract sockets go the same way."""
    directory = tmp_path / "ch"
    directory.mkdir(mode=0o700)
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX); s.bind('\\0abcXYZ'); s.listen()\n"
        "c = socket.socket(socket.AF_UNIX); c.connect('\\0abcXYZ')\n"
        "print(s.getsockname())\n"
    )
    env = dict(os.environ, LD_PRELOAD=channels.library_path(), MESHRL_CHANNEL_DIR=str(directory))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(directory / "abcXYZ")
    assert stat.S_IMODE(os.stat(directory / "abcXYZ").st_mode) == 0o600


def test_a_process_that_served_monarch_before_the_run_is_refused():
    """A controller in which Monarch already serves (a Monarch call before the run's,
    in a notebook kernel) has abstract sockets open to every user: the run refuses
    to start there, in one line saying why, instead of running exposed."""
    code = (
        "import os\n"
        "os.environ.pop('MESHRL_CHANNEL_DIR', None)\n"
        "from monarch.actor import this_host\n"
        "this_host().spawn_procs(per_host={'procs': 1})\n"
        "from meshrl.procs import channels\n"
        "try:\n"
        "    channels.seal()\n"
        "except channels.ChannelsUnavailable as error:\n"
        "    print('refused:', error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert "refused: Monarch already serves" in out.stdout, out.stdout + out.stderr


@needs_root
def test_monarchs_log_is_its_users_only():
    """Monarch writes its log to /tmp/<user> (a path it fixes): after `seal` that
    directory is 0700 and the log in it unreadable to uid 65534."""
    directory = channels.secure_monarch_log()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    reached = other_user.reached_by_nobody(set(), [directory])
    assert reached["files"] == [], reached


WORKER = """
import os, sys
from meshrl.procs import channels
from meshrl.procs.tls import CA_ENV, RunCA
channels.seal()
RunCA.from_bundle(os.environ.pop(CA_ENV)).install([])
from monarch._rust_bindings.monarch_hyperactor.config import configure
from monarch.actor import run_worker_loop_forever
configure(default_transport="tls://127.0.0.1:0")
print("serving", flush=True)
run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
"""

TLS_CLIENT = """
import socket, ssl, sys
context = ssl.create_default_context(cafile=sys.argv[3])
context.check_hostname = False
if len(sys.argv) > 4:
    context.load_cert_chain(sys.argv[4], sys.argv[5])
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as raw:
        with context.wrap_socket(raw) as tls:
            tls.settimeout(float(sys.argv[2]))
            print("answered" if tls.recv(64) else "closed")
except TimeoutError:
    print("accepted")  # the handshake held: the server waits for the client's first frame
except (ssl.SSLError, OSError) as error:
    print("refused:", error)
"""


def test_a_tls_worker_talks_only_to_holders_of_the_runs_certificates(tmp_path):
    """Monarch's TLS transport with the run's CA (SLURM's workers): a client without a
    certificate, or with one another CA signed, is refused by the worker in the
    handshake; a client with a certificate the run's CA issued is accepted."""
    from meshrl.procs.tls import CA_ENV, RunCA

    ca, rogue = RunCA.create(), RunCA.create()
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, f"tls://127.0.0.1:{port}"],
        env=dict(os.environ, **{CA_ENV: ca.bundle()}),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "serving"
        wait_listening(port)
        files = {}
        for name, authority in (("run", ca), ("rogue", rogue)):
            cert, key = authority.issue([])
            (tmp_path / f"{name}.crt").write_bytes(cert)
            (tmp_path / f"{name}.key").write_bytes(key)
            files[name] = [str(tmp_path / f"{name}.crt"), str(tmp_path / f"{name}.key")]
        (tmp_path / "ca.crt").write_bytes(ca.cert_pem)

        def client(*cert: str) -> str:
            out = subprocess.run(
                [sys.executable, "-c", TLS_CLIENT, str(port), "3", str(tmp_path / "ca.crt"), *cert],
                capture_output=True,
                text=True,
                timeout=60,
            )
            return out.stdout.strip() or out.stderr

        assert "certificate required" in client()
        assert client(*files["rogue"]).startswith("refused:")
        assert client(*files["run"]) == "accepted"
    finally:
        worker.kill()
        worker.wait()
