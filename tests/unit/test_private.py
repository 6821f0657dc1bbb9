"""Private by default (issue #66): what a run writes (weight slots in /dev/shm, its
run directory) and the sockets it uses are its user's alone, enforced by the
kernel. Each test acts for real as another local user (uid 65534, through
`setpriv`) and asserts the kernel refuses it."""

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

from meshrl.weights import publisher as publisher_module
from meshrl.weights.publisher import WeightPublisher
from meshrl.weights.receiver import WeightReceiver
from tests.support import other_user
from tests.support.other_user import DROP, NOBODY, as_nobody

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PROBE_OPEN = """
import errno, sys
try:
    open(sys.argv[1], sys.argv[2]).close()
except PermissionError:
    sys.exit(13)
sys.exit(0)
"""

needs_root = pytest.mark.skipif(
    not other_user.available(), reason="acting as another user needs root and setpriv"
)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


# --- weight slots in /dev/shm -------------------------------------------------


@needs_root
def test_another_user_cannot_open_a_weight_slot():
    publisher = WeightPublisher(model(), rdma=False)
    try:
        publisher.publish(0)
        for path in publisher.paths:
            for mode in ("rb", "r+b"):
                probe = as_nobody(PROBE_OPEN, path, mode)
                assert probe.returncode == 13, (path, mode, probe.stderr)
            info = os.lstat(path)
            assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    finally:
        publisher.close()


def test_a_slot_name_taken_before_the_publisher_is_refused_untouched(monkeypatch, tmp_path):
    """Another user who creates a file (or a link to one of ours) at a slot's
    name first: the publisher fails instead of writing weights into it, and
    leaves it as it was (today's `open(path, "wb")` truncated and followed it)."""
    target = tmp_path / "mine"
    target.write_bytes(b"keep me")
    fixed = uuid.UUID(int=0x5EC)
    monkeypatch.setattr(publisher_module.uuid, "uuid4", lambda: fixed)
    prefix = f"meshrl-test-{os.getpid()}"
    taken = f"{publisher_module.SHM_DIR}/{prefix}-{fixed.hex[:6]}-slot0"
    os.symlink(target, taken)
    try:
        with pytest.raises(FileExistsError, match="already exists"):
            WeightPublisher(model(), prefix=prefix, rdma=False)
        assert os.path.islink(taken) and target.read_bytes() == b"keep me"
    finally:
        os.unlink(taken)
        with_slot1 = f"{publisher_module.SHM_DIR}/{prefix}-{fixed.hex[:6]}-slot1"
        assert not os.path.exists(with_slot1)


def test_a_replica_maps_only_a_private_slot_of_its_own_user(tmp_path):
    """The receiver opens a slot without following a link (O_NOFOLLOW) and
    takes it only if it is a regular file of this uid with no group or other
    bits: a slot replaced by a link, or opened up to others, is refused."""
    source, replica = model(), torch.nn.Linear(8, 4)
    publisher = WeightPublisher(source, rdma=False)
    try:
        handle = publisher.publish(0)
        path = publisher.paths[handle.sources[0].slot]
        # A link in its place (to a copy with the same bytes): refused, not followed.
        copy = tmp_path / "copy"
        shutil.copy(path, copy)
        os.chmod(copy, 0o600)
        saved = path + ".saved"
        os.rename(path, saved)
        os.symlink(copy, path)
        try:
            with pytest.raises(OSError) as refused:
                WeightReceiver(replica).pull(handle)
            assert refused.value.errno == errno.ELOOP
        finally:
            os.unlink(path)
            os.rename(saved, path)
        os.chmod(path, 0o644)  # readable by others: not a slot this run made
        with pytest.raises(PermissionError, match="not a private file"):
            WeightReceiver(replica).pull(handle)
        os.chmod(path, 0o600)
        assert WeightReceiver(replica).pull(handle).verified
        assert torch.equal(replica.weight, source.weight)
    finally:
        publisher.close()


@needs_root
def test_a_replica_refuses_a_slot_owned_by_another_user():
    source = model()
    publisher = WeightPublisher(source, rdma=False)
    try:
        handle = publisher.publish(0)
        path = publisher.paths[handle.sources[0].slot]
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(PermissionError, match=f"owner uid {NOBODY}"):
            WeightReceiver(torch.nn.Linear(8, 4)).pull(handle)
    finally:
        publisher.close()


# --- run directories ----------------------------------------------------------


@pytest.fixture
def shared_base():
    """A folder every user may enter (as a researcher's `runs/` under a home
    directory readable by others, or /tmp), with the common umask 022."""
    base = tempfile.mkdtemp(prefix="meshrl-private-")
    os.chmod(base, 0o755)
    old = os.umask(0o022)
    try:
        yield base
    finally:
        os.umask(old)
        shutil.rmtree(base, ignore_errors=True)


PROBE_READ = """
import os, sys
refused = 0
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
    except PermissionError:
        refused += 1
print(refused)
"""


@needs_root
def test_another_user_can_read_nothing_in_a_run_directory(shared_base):
    """What a run writes there (metrics, samples, the reward plot, a W&B id, a
    checkpoint, `final/`) is out of another user's reach: the run directory is
    0700 whatever the umask, and the files meshrl makes there are 0600."""
    from meshrl.observe.metrics import RunLogger, make_run_dir

    run_dir = make_run_dir(shared_base, "run", "grpo")
    logger = RunLogger(run_dir, total_steps=2, progress=False)
    for step in range(2):
        logger.log({"step": step, "reward/mean": 0.5})
        logger.log_samples(step, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    logger.plot_reward()
    logger.rewind(1)  # rewrites metrics.jsonl and samples.jsonl
    logger.close()
    os.makedirs(os.path.join(run_dir, "checkpoints", "step_1"))  # as the umask makes it
    with open(os.path.join(run_dir, "checkpoints", "step_1", "trainer.pt"), "wb") as f:
        f.write(b"weights")
    names = ["metrics.jsonl", "samples.jsonl", "reward.png"]
    paths = [
        run_dir,
        *(os.path.join(run_dir, name) for name in names),
        os.path.join(run_dir, "checkpoints"),
        os.path.join(run_dir, "checkpoints", "step_1", "trainer.pt"),
    ]
    probe = as_nobody(PROBE_READ, *paths)
    assert probe.stdout.strip() == str(len(paths)), probe.stderr
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    for name in names:  # and were it opened up, its own files would stay private
        assert stat.S_IMODE(os.stat(os.path.join(run_dir, name)).st_mode) == 0o600, name


def test_an_existing_run_directory_of_this_user_is_made_private(shared_base):
    from meshrl.observe.metrics import make_run_dir

    existing = os.path.join(shared_base, "mine")
    os.mkdir(existing, 0o755)
    assert make_run_dir(shared_base, "mine", "grpo") == existing
    assert stat.S_IMODE(os.stat(existing).st_mode) == 0o700


@needs_root
def test_a_run_directory_another_user_owns_is_refused(shared_base):
    from meshrl.observe.metrics import make_run_dir
    from meshrl.observe.run_dir import make_private

    theirs = os.path.join(shared_base, "theirs")
    os.mkdir(theirs)
    os.chmod(theirs, 0o777)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        make_run_dir(shared_base, "theirs", "grpo")
    assert stat.S_IMODE(os.stat(theirs).st_mode) == 0o777  # left as it was
    # A link another user planted at the run's name, to a folder of ours: refused.
    mine = os.path.join(shared_base, "mine")
    os.mkdir(mine, 0o755)
    planted = os.path.join(shared_base, "planted")
    os.symlink(mine, planted)
    os.lchown(planted, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"a link owned by uid {NOBODY}"):
        make_private(planted)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755


@needs_root
def test_the_final_model_directory_is_private(shared_base):
    """`final/` (and `meshrl export`'s directory) is 0700 whatever the umask."""
    from meshrl.config import ModelConfig
    from meshrl.loop.export import save_hf
    from meshrl.model.models import load_model

    cfg = ModelConfig()
    out = os.path.join(shared_base, "final")
    save_hf(load_model(cfg, seed=0), cfg, out)
    probe = as_nobody(PROBE_READ, out, os.path.join(out, "config.json"))
    assert probe.stdout.strip() == "2", probe.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700


# --- the fork server's client -------------------------------------------------

LISTENER = """
import os, select, socket, sys, tempfile
folder = tempfile.mkdtemp(prefix="not-meshrl-")  # this (other) user's, mode 0700
path = os.path.join(folder, "socket")
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen(8)
print(path, flush=True)
received = accepted = 0
conns = []
done = False
while not done:  # until stdin closes: count the connections and the bytes sent
    ready, _, _ = select.select([listener, sys.stdin, *conns], [], [], 30)
    if not ready or sys.stdin in ready:
        # What is pending still counts (a loaded machine may have let a client
        # connect, or send, before this process ran again): one last look, no wait.
        done = True
        ready, _, _ = select.select([listener, *conns], [], [], 0)
    for s in ready:
        if s is listener:
            conns.append(listener.accept()[0])
            accepted += 1
        else:
            data = s.recv(1 << 20)
            received += len(data)
            if not data:
                conns.remove(s)
print(accepted, received, flush=True)
"""


@pytest.fixture
def strangers_socket():
    """A Unix socket another user (uid 65534) listens at, in a directory of its
    own; yields (path, stop) where stop() ends it and returns (connections
    accepted, bytes received)."""
    listener = subprocess.Popen(
        [*DROP, sys.executable, "-c", LISTENER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    path = listener.stdout.readline().strip()

    def stop() -> tuple[int, int]:
        listener.stdin.close()
        accepted, received = map(int, listener.stdout.readline().split())
        listener.wait(timeout=30)
        return accepted, received

    try:
        yield path, stop
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def run_client(path: str) -> subprocess.CompletedProcess:
    """The fork server's client as Monarch starts it, pointed at `path` the way a
    shared server is named (MESHRL_FORK_SERVER)."""
    from meshrl.procs import zygote

    client = subprocess.Popen(
        [sys.executable, "-S", zygote.__file__, "connect", path],
        env={**os.environ, zygote.SHARED_ENV: path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # (one that sent its request waits for an answer that never comes)
        out, err = client.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
    return subprocess.CompletedProcess(client.args, client.returncode, out, err)


@needs_root
def test_the_fork_server_client_sends_nothing_to_another_users_socket(strangers_socket):
    """MESHRL_FORK_SERVER pointing at a socket another user listens at, in a
    directory it owns: the client refuses before it connects (the directory is
    not this user's) and the listener receives nothing, neither the client's
    environment nor its descriptors (before: its whole environment)."""
    path, stop = strangers_socket
    client = run_client(path)
    accepted, received = stop()
    assert (accepted, received) == (0, 0)
    assert client.returncode == 1
    lines = client.stderr.strip().splitlines()
    assert len(lines) == 1 and "MESHRL_FORK_SERVER" in lines[0] and path in lines[0], lines
    assert "owned by uid 65534" in lines[0]


@needs_root
def test_the_fork_server_client_checks_who_listens(strangers_socket, tmp_path):
    """A socket in a directory of this user's (0700) that leads to a listener of
    another uid (here through a link): the client checks the peer's uid
    (SO_PEERCRED) after connecting and sends nothing."""
    path, stop = strangers_socket
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o700)
    os.symlink(path, folder / "socket")
    client = run_client(str(folder / "socket"))
    accepted, received = stop()
    assert accepted == 1 and received == 0
    assert client.returncode == 1
    lines = client.stderr.strip().splitlines()
    assert len(lines) == 1 and "MESHRL_FORK_SERVER" in lines[0], lines
    assert "served by uid 65534" in lines[0]


@needs_root
def test_a_run_refuses_a_shared_fork_server_of_another_user(strangers_socket, monkeypatch):
    """The controller checks MESHRL_FORK_SERVER the same way before any proc
    starts: one error line naming it and the path."""
    from meshrl.procs import zygote

    path, stop = strangers_socket
    monkeypatch.setenv(zygote.SHARED_ENV, path)
    with pytest.raises(zygote.UntrustedServer, match="MESHRL_FORK_SERVER") as refused:
        zygote.server()
    assert path in str(refused.value) and "\n" not in str(refused.value)
    assert stop() == (0, 0)


# --- torch.distributed's store: a run on this host ------------------------------

STORE_PROBE = """
import os, sys
where, path = sys.argv[1], sys.argv[2]
for what, attempt in [
    ("list", lambda: os.listdir(where)),
    ("read", lambda: open(path, "rb").close()),
    ("write", lambda: open(path, "r+b").close()),
    ("create", lambda: open(os.path.join(where, "planted"), "xb").close()),
]:
    try:
        attempt()
        print(what, "allowed")
    except PermissionError:
        print(what, "refused")
"""


@needs_root
def test_another_user_cannot_reach_a_local_process_groups_store():
    """A process group whose ranks all run on this host meets at a FileStore in a
    directory of its own, mode 0700 (`private_store`, what `Rendezvous` gives a
    local or process job): a process of another uid can neither list the directory
    nor open the store to read or rewrite what the ranks exchange (gloo's
    addresses), nor plant a file beside it; the kernel refuses each. (Across hosts
    the store is still a TCPStore, with no credential: `serve_store`.)"""
    import torch.distributed as dist

    from meshrl.procs.parallel import FILE_STORE, private_store, remove_private_store

    address = private_store()
    path = address[len(FILE_STORE) :]
    where = os.path.dirname(path)
    try:
        store = dist.FileStore(path, 1)
        key = f"default_pg/0//{uuid.uuid4().hex}"
        store.set(key, "rank 0's address")
        info = os.stat(where)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        probe = as_nobody(STORE_PROBE, where, path)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split("\n")[:4] == [
            "list refused",
            "read refused",
            "write refused",
            "create refused",
        ], probe.stdout
        assert store.get(key) == b"rank 0's address"
        assert os.listdir(where) == ["store"]
        del store
    finally:
        remove_private_store(address)
    assert not os.path.exists(where)
