"""No other local user can reach a run's Monarch channels (issue #66).

Monarch 0.7 serves hosts' backends and procs' callbacks on abstract Unix sockets,
which have no owner or mode; meshrl moves every one into a 0700 directory
(`meshrl.procs.channels`). These tests act for real as uid 65534: listed from
`/proc/net/unix`, each socket a run's processes listen on is connected to, and
the kernel must refuse every connection."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

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
        actors = meshes.meshes["a"].spawn("who", Who)
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
