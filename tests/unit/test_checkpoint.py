"""Checkpoints: atomic, the last K kept, and `export` naming what is missing."""

import os
from types import SimpleNamespace

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop import checkpoint, export
from meshrl.loop.checkpoint import CheckpointConfig, Checkpointer, CheckpointError


@pytest.mark.unit
def test_commit_is_atomic_and_keeps_the_last_k(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        partial = checkpoint.begin(run, step)
        (tmp_path / "checkpoints" / os.path.basename(partial) / "trainer.pt").write_text("x")
        checkpoint.commit(partial, keep=2)
    assert [checkpoint.step_of(p) for p in checkpoint.complete(checkpoint.root(run))] == [4, 6]
    # A crash while writing step 8: its partial directory is never taken as a checkpoint.
    checkpoint.begin(run, 8)
    assert checkpoint.step_of(checkpoint.latest(run)) == 6
    assert checkpoint.latest(str(tmp_path / "none")) is None
    with pytest.raises(ConfigError, match="checkpoint.resume"):
        load_config(GRPOConfig, None, [f"checkpoint.resume={tmp_path}/checkpoints/step_00000008"])


@pytest.mark.unit
def test_export_names_what_is_missing_in_one_line(tmp_path, capsys):
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither a run directory nor a checkpoint" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "has no complete checkpoint (set checkpoint.every" in capsys.readouterr().err
    # A run without checkpoints whose final model is saved: that is the HF directory.
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert f"already an HF directory: {tmp_path / 'final'}" in capsys.readouterr().err
    assert export.main([str(tmp_path)]) == 2
    assert not (tmp_path / "out").exists()


def _save(run: str, step: int, keep: int) -> str:
    """A checkpoint of `step` the way `Checkpointer.save` lays it out: role files
    (one in a subdirectory, as FSDP shards are), then `commit`."""
    partial = checkpoint.begin(run, step)
    os.makedirs(os.path.join(partial, "trainer_shards"))
    for name in ("trainer.pt", "trainer_shards/0.distcp", "policy_rng_0.pt", "loop.pt"):
        with open(os.path.join(partial, name), "wb") as f:
            f.write(f"{name} after step {step}\n".encode() * 64)
    return checkpoint.commit(partial, keep)


@pytest.mark.unit
def test_every_part_is_on_disk_before_complete_and_the_rename_after(tmp_path, monkeypatch):
    """Pure logic (a power loss cannot be simulated): os.fsync is recorded, by the
    path its descriptor names then, and whether COMPLETE existed yet."""
    run = os.path.realpath(tmp_path)
    _save(run, 2, keep=1)
    synced: list[tuple[str, bool]] = []
    fsync = os.fsync

    def record(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        committed = any(
            os.path.exists(os.path.join(run, "checkpoints", d, "COMPLETE"))
            for d in (".partial_step_00000004", "step_00000004")
        )
        synced.append((path, committed))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    final = _save(run, 4, keep=1)
    partial = os.path.join(run, "checkpoints", ".partial_step_00000004")
    before = {path for path, committed in synced if not committed}
    parts = ["trainer.pt", "trainer_shards/0.distcp", "policy_rng_0.pt", "loop.pt", "MANIFEST.json"]
    for part in [*parts, "trainer_shards", ""]:
        assert os.path.join(partial, part).rstrip("/") in before, (part, synced)
    # After the rename (the descriptor names the committed directory): it, its parent
    # and the run directory, before the older checkpoint is dropped.
    after = [path for path, committed in synced if committed]
    assert after[:2] == [f"{partial}/COMPLETE", partial], synced
    assert after[2:5] == [final, os.path.dirname(final), run], synced
    assert not os.path.exists(os.path.join(run, "checkpoints", "step_00000002"))


@pytest.mark.unit
def test_a_checkpoint_without_its_manifest_or_a_file_is_not_intact(tmp_path):
    run = str(tmp_path)
    older, newer = _save(run, 2, keep=2), _save(run, 4, keep=2)
    os.remove(os.path.join(newer, "MANIFEST.json"))  # COMPLETE left: a deletion cut short
    assert "MANIFEST.json is missing" in checkpoint.problem(newer)
    assert checkpoint.latest(run) == older
    os.remove(os.path.join(older, "trainer_shards", "0.distcp"))
    assert "0.distcp cannot be read" in checkpoint.problem(older)
    assert checkpoint.latest(run) is None


class Crash(BaseException):
    """The controller dies here (in-process stand-in; the drill kills a real one)."""


@pytest.mark.unit
def test_a_prune_cut_short_leaves_no_half_checkpoint_that_counts(tmp_path, monkeypatch):
    run = str(tmp_path)
    _save(run, 2, keep=1)
    rmtree = checkpoint.shutil.rmtree

    def cut_short(path, ignore_errors=False):
        # The deletion of step 2 gets as far as its manifest and a role file.
        if "step_00000002" in path and os.path.isdir(path):
            os.remove(os.path.join(path, "MANIFEST.json"))
            os.remove(os.path.join(path, "trainer.pt"))
            raise Crash
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", cut_short)
    with pytest.raises(Crash):
        _save(run, 4, keep=1)
    monkeypatch.undo()
    for path in checkpoint.complete(checkpoint.root(run)):  # counted: whole, or found damaged
        assert checkpoint.problem(path) or os.path.isfile(os.path.join(path, "trainer.pt")), path
    newest = os.path.join(run, "checkpoints", "step_00000004")
    assert checkpoint.latest(run) == newest
    # Should the newest be lost too, nothing half-deleted is taken in its place.
    with open(os.path.join(newest, "loop.pt"), "r+b") as f:
        f.write(b"X")
    assert checkpoint.latest(run) is None, checkpoint.complete(checkpoint.root(run))
    # The next commit finishes the deletion.
    _save(run, 6, keep=1)
    assert os.listdir(checkpoint.root(run)) == ["step_00000006"]


def _rot(path: str) -> None:
    """Bits of `trainer.pt` change where only a hash sees it (a disk's decay): after
    its last hash found it intact and settled, its fingerprint stays the same."""
    with open(os.path.join(path, "trainer.pt"), "r+b") as f:
        f.write(b"X")
    checkpoint._hashed[os.path.abspath(path)] = (checkpoint._fingerprint(path), True, "")


@pytest.mark.unit
def test_a_checkpoint_is_hashed_again_each_time_it_is_read(tmp_path):
    run = str(tmp_path)
    older, newer = _save(run, 2, keep=2), _save(run, 4, keep=2)
    assert checkpoint.latest(run) == newer and checkpoint.problem(newer) == ""
    # Changed through the file system after it was checked (same size, manifest
    # untouched): seen by every look.
    with open(os.path.join(newer, "trainer.pt"), "r+b") as f:
        f.write(b"X")
    assert checkpoint.latest(run) == older
    assert "SHA-256 differs" in checkpoint.problem(newer)
    # Changed where only a hash sees it: a restore, and a rewind's choice, hash again.
    _save(run, 6, keep=2)
    newest = os.path.join(run, "checkpoints", "step_00000006")
    _rot(newest)
    assert checkpoint.latest(run) == newest  # a look (a message) takes the last hash's word
    assert checkpoint.latest(run, rehash=True) is None  # step 4's bytes changed too
    assert "trainer.pt is not the file that was written" in checkpoint.problem(newest)
    _rot(newest)
    with pytest.raises(CheckpointError, match="cannot restore .*trainer.pt is not the file"):
        Checkpointer(None, None, [], CheckpointConfig()).restore(newest)


@pytest.mark.unit
def test_a_rewind_hashes_the_checkpoint_it_goes_back_to(tmp_path):
    import torch

    run = str(tmp_path)
    for step in (2, 4):
        partial = checkpoint.begin(run, step)
        torch.save({"loop": {"step": step}, "sizes": {}}, os.path.join(partial, "loop.pt"))
        with open(os.path.join(partial, "trainer.pt"), "wb") as f:
            f.write(b"weights" * 64)
        checkpoint.commit(partial, keep=2)
    newer = os.path.join(run, "checkpoints", "step_00000004")
    _rot(newer)
    ledger = SimpleNamespace(generated=0, trained=0, drop=lambda reason, n: None)
    state = SimpleNamespace(step=5, ahead=[], ledger=ledger)
    state.load_state_dict = lambda loop, restore, counts: setattr(state, "step", loop["step"])
    fake = SimpleNamespace(dir=run, respawn=lambda role: None, report=lambda: None)
    ckpt = Checkpointer(fake, state, [], CheckpointConfig(every=2))
    supervisor = SimpleNamespace(spend_recovery=lambda role, error: None)
    lost = SimpleNamespace(role="trainer")
    assert ckpt.rewind(lost, supervisor, SimpleNamespace(rewind=lambda step: None), 1) == 2


@pytest.mark.unit
def test_a_look_each_step_does_not_hash_an_unchanged_checkpoint(tmp_path, monkeypatch):
    """The loop names the newest checkpoint every step (`latest`): an unchanged
    one is not hashed again for it."""
    run = str(tmp_path)
    newest = _save(run, 2, keep=1)
    monkeypatch.setattr(checkpoint, "RACY_NS", 0)  # its files changed long enough ago
    assert checkpoint.latest(run) == newest
    hashed = []
    sha256 = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda *a, **k: hashed.append(a) or sha256(*a, **k))
    for _ in range(3):
        assert checkpoint.latest(run) == newest
    assert hashed == []
    assert checkpoint.problem(newest) == "" and len(hashed) == 4  # a read hashes each file
