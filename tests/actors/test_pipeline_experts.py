"""Pipeline and expert parallelism on real trainer meshes (gloo): the gradient of
one batch with PP2 (1F1B), FSDP2 x PP2 (GPipe) and TP2 x PP2 (interleaved, 2
stages a proc) equals the 1-proc gradient, and EP2 of Qwen3-MoE (with DDP and
with FSDP2) the 1-proc MoE's, within 1e-5 relative (and PP2 of Qwen3, whose tied embedding
the first and last stage each hold); three steps end at the
1-proc weights within 1e-4; each layout publishes every parameter once, from
the procs that hold it, into a whole model equal to the trainer's (and a TP2
replica reads its share from a pipeline's stages); a pipelined and an
expert-parallel trainer resume bitwise (DCP) and export a plain HF directory."""

import pytest
import torch

from actors.policy import Policy
from actors.trainer import Trainer
from meshrl.config import ModelConfig, OptimConfig
from meshrl.procs.mesh import RoleMeshes, call_all, call_each, form_groups
from tests.actors.test_invariance import fixed_batch, gradient, grpo_loss, relative_error

pytestmark = [pytest.mark.actors, pytest.mark.timeout(300)]

TIMEOUT = 120
MODEL = ModelConfig(num_layers=4)  # interleaved: 2 stages on each of 2 procs
MOE = ModelConfig(arch="qwen3_moe")
QWEN3 = ModelConfig(arch="qwen3")  # tied embeddings: the last stage holds a copy of stage 0's
ONE = {id(MODEL): "one", id(MOE): "moe_one", id(QWEN3): "qwen3_one"}  # each model's 1-proc
# name: (model, procs, procs that take the same rows, Trainer's layout arguments)
CELLS = {
    "pp": (MODEL, 2, 2, dict(sharding="pp", pp=2, pp_schedule="1f1b")),
    "pp_qwen3": (QWEN3, 2, 2, dict(sharding="pp", pp=2, pp_schedule="1f1b")),
    "fsdp_pp": (MODEL, 4, 2, dict(sharding="fsdp_pp", pp=2, pp_schedule="gpipe")),
    "tp_pp": (MODEL, 4, 4, dict(sharding="fsdp_tp_pp", tp=2, pp=2, pp_schedule="interleaved")),
    "ep": (MOE, 2, 1, dict(sharding="ddp", ep=2)),
    "fsdp_ep": (MOE, 2, 1, dict(sharding="fsdp", ep=2)),
}


@pytest.fixture(scope="module")
def meshes():
    """The 1-proc trainers of each model (and a 1-proc replica) on one proc, each
    layout's trainer on a mesh of its own, and a TP2 replica."""
    meshes = RoleMeshes(
        {"one": 1, **{name: cell[1] for name, cell in CELLS.items()}, "replica": 1, "replica_tp": 1}
    )
    optim = OptimConfig(lr=1e-2)
    try:
        spawned = {
            "one": meshes["one"].spawn(
                "one", Trainer, MODEL, optim, grpo_loss("token-mean"), 10, layout="padded"
            ),
            "moe_one": meshes["one"].spawn(
                "moe_one", Trainer, MOE, optim, grpo_loss("token-mean"), 10, layout="padded"
            ),
            "qwen3_one": meshes["one"].spawn(
                "qwen3_one", Trainer, QWEN3, optim, grpo_loss("token-mean"), 10, layout="padded"
            ),
            "replica_one": meshes["one"].spawn("replica_one", Policy, MODEL),
        }
        for name, (model, _, _, layout) in CELLS.items():
            spawned[name] = meshes[name].spawn(
                f"trainer_{name}",
                Trainer,
                model,
                optim,
                grpo_loss("token-mean"),
                10,
                master=meshes.rendezvous(name),
                pp_microbatches=4,
                replica_tp=2 if name == "pp" else 1,
                **layout,
            )
        spawned["replica"] = meshes["replica"].spawn("replica", Policy, MODEL, tp=2)
        follower = meshes["replica_tp"].spawn("follower", Policy, MODEL, tp=2, leader=False)
        form_groups(spawned["replica"], follower, 1, 2, meshes.rendezvous_each("replica"), TIMEOUT)
        for name, actors in spawned.items():
            call_all(actors, "parameters", what=f"{name}.init", timeout_s=TIMEOUT)
        yield spawned
    finally:
        meshes.stop()


def reference(name: str) -> str:
    return ONE[id(CELLS[name][0])]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_gradient_is_the_one_proc_gradient_at_every_layout(meshes, aggregation):
    for name in (*ONE.values(), *CELLS):
        call_all(meshes[name], "set_loss", grpo_loss(aggregation), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    want = {name: gradient(meshes[name], 1, batch) for name in ONE.values()}
    for name, (_, procs, group, _) in CELLS.items():
        got = gradient(meshes[name], procs, batch, tp=group)
        error = relative_error(got, want[reference(name)])
        assert error < 1e-5, f"{aggregation} on {name}: relative error {error:.2e}"


def test_three_steps_end_at_the_one_proc_weights_and_publish_each_parameter_once(meshes):
    """Runs after the gradients: it moves every trainer's weights."""
    from meshrl.model.models import load_model
    from meshrl.weights.publisher import WeightHandle
    from meshrl.weights.receiver import WeightReceiver

    for name in (*ONE.values(), *CELLS):
        call_all(meshes[name], "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    figures = {}  # each trainer's first step's metrics (summed over micro-batches)
    for _ in range(3):
        for name in ONE.values():
            done = call_each(meshes[name], "train_step", [(batch.shard(0, 1),)], "step", TIMEOUT)
            figures.setdefault(name, done[0])
        for name, (_, procs, group, _) in CELLS.items():
            shards = [(s,) for s in batch.shards(procs, group)]
            done = call_each(meshes[name], "train_step", shards, "step", TIMEOUT)
            # (Each data-parallel rank reports its share: the controller averages them.)
            figures.setdefault(name, {k: sum(d[k] for d in done) / len(done) for k in done[0]})
    for name in CELLS:
        want = figures[reference(name)]
        for key in ("loss/policy", "policy/kl_ref", "policy/clip_fraction", "train/grad_norm"):
            assert abs(figures[name][key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), (
                name,
                key,
                figures[name][key],
                want[key],
            )
    want = {
        name: call_all(meshes[name], "parameters", what=name, timeout_s=TIMEOUT)[0]
        for name in ONE.values()
    }
    for name, (model_cfg, _, _, _) in CELLS.items():
        got = call_all(meshes[name], "parameters", what=name, timeout_s=TIMEOUT)
        assert all(g.keys() == got[0].keys() for g in got)  # every rank: the whole model
        whole = want[reference(name)]
        assert got[0].keys() == whole.keys(), name
        for key in whole:
            error = relative_error(got[0][key], whole[key])
            assert error < 1e-4, f"{key} after 3 steps on {name}: relative error {error:.2e}"
        # The version each proc publishes: every parameter once, from its holders.
        handles = call_all(meshes[name], "publish", what="publish", timeout_s=TIMEOUT)
        pieces = [(p.name, p.start) for h in handles if h for s in h.sources for p in s.pieces]
        assert len(pieces) == len(set(pieces)), name
        model = load_model(model_cfg)
        pulled = WeightReceiver(model).pull(WeightHandle.merge(handles))
        assert pulled.verified, name
        for key, param in model.named_parameters():
            assert torch.equal(param.detach(), got[0][key]), (name, key)


def test_a_tensor_parallel_replica_reads_its_share_from_the_stages(meshes):
    """PP2 -> a TP2 replica: each replica proc reads its half of each split
    parameter from the stage that holds it, no more, and ends equal to the
    trainer."""
    from meshrl.weights.publisher import WeightHandle
    from tests.actors.test_invariance import tp_share

    trainer = meshes["pp"]
    handle = WeightHandle.merge(call_all(trainer, "publish", what="pub", timeout_s=TIMEOUT))
    assert len(handle.sources) == 2  # one per stage
    pulled = call_all(meshes["replica"], "load_weights", handle, what="pull", timeout_s=TIMEOUT)[0]
    # Its split blocks copied, each proc its half; the whole parameters (the stages
    # publish plain tensors) served in place from their slots (zero-copy on one host).
    assert pulled.verified and pulled.bytes_moved == 2 * tp_share(False, MODEL)
    trained = call_all(trainer, "parameters", what="pp", timeout_s=TIMEOUT)[0]
    whole = call_all(meshes["replica"], "parameters", what="replica", timeout_s=TIMEOUT)[0]
    assert all(torch.equal(whole[k], trained[k]) for k in trained)


@pytest.mark.parametrize("name", ["tp_pp", "ep"])
def test_a_pipelined_or_expert_parallel_trainer_resumes_bitwise_and_exports_hf(
    meshes, name, tmp_path
):
    """Two steps from a saved state (DCP: each proc its stage's or experts' part),
    then the state loaded and the same two steps again: the same bits. The
    export is a plain HF directory of the whole model."""
    from transformers import AutoModelForCausalLM

    _, procs, group, _ = CELLS[name]
    trainer = meshes[name]
    call_all(trainer, "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    shards = [(s,) for s in fixed_batch().shards(procs, group)]
    call_all(trainer, "save_state", str(tmp_path / "ckpt"), what="save", timeout_s=TIMEOUT)
    ends = []
    for _ in range(2):
        for _ in range(2):
            call_each(trainer, "train_step", shards, "step", TIMEOUT)
        ends.append(call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0])
        call_all(trainer, "load_state", str(tmp_path / "ckpt"), what="load", timeout_s=TIMEOUT)
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), name
    call_all(trainer, "save", str(tmp_path / "hf"), what="export", timeout_s=TIMEOUT)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    start = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
    for key, param in exported.named_parameters():
        assert torch.equal(param.detach(), start[key]), key
