"""Actors on real Monarch procs: generation, training, weight sync, scoring."""

import os
import random
import stat

import pytest
import torch

from actors.environment import Environment
from actors.policy import Policy
from actors.reference import Reference
from actors.trainer import Trainer
from algorithms.grpo import GRPOConfig, GRPOLoss
from meshrl.config import GenerationConfig, ModelConfig, OptimConfig, TaskConfig
from meshrl.envs import make_task
from meshrl.model.tokenizer import build_char_tokenizer
from meshrl.procs.mesh import RemoteCallError, RoleMeshes, call_all, call_each, wait
from meshrl.types import Completions, TrainBatch
from meshrl.weights.publisher import WeightHandle
from tests.conftest import listeners, own_pids

pytestmark = [pytest.mark.actors, pytest.mark.timeout(300)]

TIMEOUT = 120
MODEL = ModelConfig()
GEN = GenerationConfig(max_new_tokens=5)


# The algorithm's own loss hook travels to the trainer procs, as in a run.
grpo_like_loss = GRPOLoss(GRPOConfig())


def spawn_trainer(meshes, **kwargs):
    """A trainer actor on every proc of `meshes["trainer"]` (lr 1e-2, 10 steps)."""
    return meshes["trainer"].spawn(
        "trainer",
        Trainer,
        MODEL,
        OptimConfig(lr=1e-2),
        grpo_like_loss,
        10,
        1.0,
        0,
        meshes.rendezvous("trainer"),
        **kwargs,
    )


@pytest.fixture(scope="module")
def actors():
    meshes = RoleMeshes({"policy": 2, "trainer": 2, "environment": 1, "reference": 1})
    try:
        handles = {
            "trainer": spawn_trainer(meshes),
            # Another seed than the trainer: equality below comes from the sync alone.
            "policy": meshes["policy"].spawn("policy", Policy, MODEL, 7),
            "environment": meshes["environment"].spawn(
                "environment", Environment, TaskConfig(), MODEL
            ),
            "reference": meshes["reference"].spawn("reference", Reference, MODEL, 7),
        }
        handles["meshes"] = meshes
        yield handles
    finally:
        meshes.stop()


def rollout(actors, num_prompts=8):
    tok = build_char_tokenizer()
    prompts = make_task(TaskConfig()).sample(num_prompts, random.Random(0))
    ids = [tok(p.text).input_ids for p in prompts]
    parts = call_each(
        actors["policy"], "generate", [(ids[:4], GEN), (ids[4:], GEN)], "gen", TIMEOUT
    )
    return prompts, Completions.concat(parts, tok.pad_token_id)


def sync(actors):
    handle = WeightHandle.merge(
        call_all(actors["trainer"], "publish", what="publish", timeout_s=TIMEOUT)
    )
    pulled = call_all(actors["policy"], "load_weights", handle, what="load", timeout_s=TIMEOUT)
    assert [p.path for p in pulled] == ["shm", "shm"]  # same host: shared memory
    assert [p.rdma_bytes for p in pulled] == [0, 0] and pulled[0].relay is None
    return handle, [p.version for p in pulled]


def test_weight_sync_is_bitwise_and_versioned(actors):
    handle, versions = sync(actors)
    start_version = handle.version
    assert versions == [start_version, start_version]
    before = call_all(actors["policy"], "parameters", what="params", timeout_s=TIMEOUT)[0]

    prompts, completions = rollout(actors)
    batch = TrainBatch.from_completions(completions, torch.randn(len(completions)))
    metrics = call_each(
        actors["trainer"], "train_step", [(batch.shard(i, 2),) for i in range(2)], "train", TIMEOUT
    )
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)

    handle, versions = sync(actors)
    assert handle.version == start_version + 1
    assert versions == [handle.version] * 2
    trainer_ranks = call_all(actors["trainer"], "parameters", what="params", timeout_s=TIMEOUT)
    replicas = call_all(actors["policy"], "parameters", what="params", timeout_s=TIMEOUT)
    for name, value in trainer_ranks[0].items():
        # data-parallel ranks agree, and every replica equals the trainer bit for bit
        assert torch.equal(value, trainer_ranks[1][name]), name
        for replica in replicas:
            assert torch.equal(value, replica[name]), name
        assert not torch.equal(value, before[name]), f"{name} did not change in the step"
    # and the next rollout reports the version that produced it
    _, completions = rollout(actors)
    assert completions.weight_version == handle.version


def test_generation_matches_reference_logprobs(actors):
    handle, _ = sync(actors)
    call_all(actors["reference"], "load_weights", handle, what="ref load", timeout_s=TIMEOUT)
    _, completions = rollout(actors)
    assert completions.completion_ids.shape[1] <= GEN.max_new_tokens
    batch = TrainBatch.from_completions(completions, torch.zeros(len(completions)))
    ref = wait(actors["reference"].logprobs.call_one(batch, 1.0), "ref", TIMEOUT)
    mask = completions.completion_mask
    assert ref.shape == completions.logprobs.shape
    assert (ref - completions.logprobs).mul(mask).abs().max().item() < 1e-4


def test_actor_metrics_are_reduced_across_procs_once_per_report(actors):
    """`record` inside the policy replicas: one value per key per report, reduced
    across procs (sum, min, max, mean), then nothing until the next calls."""
    meshes = actors["meshes"]
    meshes.report(TIMEOUT)  # start from an empty slate
    _, completions = rollout(actors)  # 4 prompts on each of the 2 replicas
    recorded, procs = meshes.report(TIMEOUT)
    lengths = completions.completion_mask.sum(1)
    assert recorded["policy/completion_tokens"] == lengths.sum().item()  # sum over 2 procs
    assert recorded["policy/longest_completion"] == lengths.max().item()
    assert recorded["policy/shortest_completion"] == lengths.min().item()
    assert 0 < recorded["policy/entropy"] <= torch.log(torch.tensor(100.0)).item()
    assert recorded["time/policy/generate_s"] > 0
    assert {(p["role"], p["rank"]) for p in procs} == {
        ("policy", 0),
        ("policy", 1),
        ("trainer", 0),
        ("trainer", 1),
        ("environment", 0),
        ("reference", 0),
    }
    again, _ = meshes.report(TIMEOUT)
    assert "policy/completion_tokens" not in again


def test_exported_model_generates_what_the_policy_generates(actors, tmp_path):
    """The trainer's HF export (`save_pretrained`, safetensors) holds the weights the
    replicas serve: transformers loads it and samples the same tokens from the same
    seed and prompt as the policy actor."""
    from transformers import AutoModelForCausalLM

    from meshrl.model.generation import sample

    sync(actors)
    call_all(actors["trainer"], "save", str(tmp_path / "final"), what="save", timeout_s=TIMEOUT)
    assert (tmp_path / "final" / "model.safetensors").stat().st_size > 0
    tok = build_char_tokenizer()
    prompt = tok("123>").input_ids
    state = torch.Generator().manual_seed(1234).get_state()
    policy = actors["policy"].slice(procs=0)
    wait(policy.set_rng_state.call_one(state), "rng", TIMEOUT)
    served = wait(policy.generate.call_one([prompt] * 4, GEN), "generate", TIMEOUT)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    generator = torch.Generator().manual_seed(1234)
    ids, logprobs, mask = sample(
        exported,
        torch.tensor([prompt] * 4),
        torch.ones(4, len(prompt)),
        max_new_tokens=GEN.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=generator,
    )
    assert torch.equal(ids, served.completion_ids)
    assert torch.equal(mask, served.completion_mask)
    assert (logprobs - served.logprobs).abs().max().item() < 1e-5


def test_environment_scores_by_the_task(actors):
    tok = build_char_tokenizer()
    prompts = make_task(TaskConfig()).sample(4, random.Random(1))
    right = [
        tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id] for p in prompts
    ]
    wrong = [tok("x", add_special_tokens=False).input_ids for _ in prompts]
    scores = wait(
        actors["environment"].score.call_one(prompts + prompts, right + wrong), "s", TIMEOUT
    )
    assert scores == ([1.0] * 4 + [0.0] * 4, {})


def test_actor_error_names_endpoint_and_cause(actors):
    with pytest.raises(RemoteCallError, match=r"policy\.generate.*failed"):
        wait(actors["policy"].slice(procs=0).generate.call_one([], GEN), "policy.generate", TIMEOUT)
    # the actor keeps serving afterwards
    rollout(actors, num_prompts=8)


def test_meshes_stop_leaves_no_procs(no_stray_procs):
    with RoleMeshes({"policy": 1, "environment": 1}) as meshes:
        env = meshes["environment"].spawn("environment", Environment, TaskConfig(), MODEL)
        assert wait(env.score.call_one([], []), "score", TIMEOUT) == ([], {})
    meshes.stop()  # twice is harmless


def test_critic_mesh_loads_the_backbone_and_fits_returns(actors):
    """A real critic mesh of 2 data-parallel procs: its backbone arrives from the
    trainer's published weights; value steps fit fixed returns; ranks stay equal."""
    from actors.critic import Critic

    meshes = RoleMeshes({"critic": 2})
    try:
        before = set(listeners(own_pids()))
        master = meshes.rendezvous("critic")
        # A run on this host: the group meets at a FileStore in a directory of this
        # uid's, mode 0700; no TCP store listens for it.
        assert set(listeners(own_pids())) <= before
        assert master[0].startswith("file:///") and master[1] == 0
        where = os.path.dirname(master[0][len("file://") :])
        info = os.stat(where)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        critic = meshes["critic"].spawn(
            "critic", Critic, MODEL, OptimConfig(lr=1e-2), 50, 10.0, 3, master
        )
        handle, _ = sync(actors)
        versions = call_all(critic, "load_backbone", handle, what="load", timeout_s=TIMEOUT)
        assert versions == [handle.version] * 2
        trainer_params = wait(actors["trainer"].slice(procs=0).parameters.call_one(), "p", TIMEOUT)
        critic_params = call_all(critic, "parameters", what="params", timeout_s=TIMEOUT)
        for name, value in critic_params[0].items():
            if name.startswith("backbone."):
                assert torch.equal(value, trainer_params["model." + name[len("backbone.") :]])
        assert torch.count_nonzero(critic_params[0]["value_head.weight"]) == 0

        _, completions = rollout(actors)
        batch = TrainBatch.from_completions(completions)
        batch.old_values = torch.cat(
            call_each(
                critic,
                "values",
                [(batch.rows(slice(0, 4)),), (batch.rows(slice(4, 8)),)],
                "values",
                TIMEOUT,
            )
        )
        assert batch.old_values.shape == batch.completion_mask.shape
        assert torch.count_nonzero(batch.old_values) == 0  # zero head: values start at 0
        batch.returns = (
            torch.linspace(-1, 1, batch.completion_mask.numel()).view_as(batch.completion_mask)
            * batch.completion_mask
        )
        losses = []
        for _ in range(30):
            metrics = call_each(
                critic, "train_step", [(batch.shard(i, 2),) for i in range(2)], "train", TIMEOUT
            )
            losses.append(sum(m["loss/value"] for m in metrics) / 2)
        assert losses[-1] < 0.5 * losses[0], losses
        after = call_all(critic, "parameters", what="params", timeout_s=TIMEOUT)
        assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])
    finally:
        meshes.stop()
    assert not os.path.exists(where)  # gone with the run's procs


def test_fsdp_trainer_syncs_full_weights_and_checkpoints_its_shards(
    actors, tmp_path, no_stray_procs
):
    """A trainer of 2 procs sharded with FSDP2: replicas receive the gathered
    weights bitwise; each rank writes its own shards and loads them back exactly."""
    meshes = RoleMeshes({"trainer": 2})
    try:
        trainer = spawn_trainer(meshes, sharding="fsdp")
        _, completions = rollout(actors)
        batch = TrainBatch.from_completions(completions)
        batch.advantages = torch.linspace(-1, 1, len(batch))

        def step():
            return call_each(
                trainer, "train_step", [(batch.shard(i, 2),) for i in range(2)], "train", TIMEOUT
            )

        step()
        # Each rank publishes its own shards; the replicas pull every rank's.
        handles = call_all(trainer, "publish", what="publish", timeout_s=TIMEOUT)
        assert all(h is not None for h in handles)
        handle = WeightHandle.merge(handles)
        call_all(actors["policy"], "load_weights", handle, what="load", timeout_s=TIMEOUT)
        full = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)
        replicas = call_all(actors["policy"], "parameters", what="params", timeout_s=TIMEOUT)
        for params in (full[1], *replicas):
            assert all(torch.equal(params[k], full[0][k]) for k in full[0])

        call_all(trainer, "save_state", str(tmp_path), what="save", timeout_s=TIMEOUT)
        shards = sorted(p.name for p in (tmp_path / "trainer_shards").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]
        step()  # moves the weights and the optimizer on ...
        moved = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
        assert any(not torch.equal(moved[k], full[0][k]) for k in full[0])
        call_all(trainer, "load_state", str(tmp_path), what="load", timeout_s=TIMEOUT)
        restored = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
        assert all(torch.equal(restored[k], full[0][k]) for k in full[0])  # ... and back
        step()  # with the optimizer state restored too, the same step lands on the same weights
        again = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
        assert all(torch.equal(again[k], moved[k]) for k in moved)
    finally:
        meshes.stop()
