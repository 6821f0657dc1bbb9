"""Same math at any placement and layout: one fixed batch, the gradient of one
optimizer step under trainer 1 / 2 procs, DDP / FSDP2 / tensor parallelism (2
procs) / FSDP2 x tensor parallelism (2 x 2 procs), micro-batches 1 / 2,
critic 1 / 2 procs, and batch layouts padded / tree / packed
(`trainer.layout`: padded against tree), on real trainer and critic meshes (gloo). Each must equal
the single-proc padded gradient within 1e-5 relative (float sums in another
order), for every loss aggregation, the KL term, the value loss and the DPO loss. The end-to-end variant (placement
through the whole loop) is in tests/e2e/test_e2e.py."""

import tempfile

import pytest
import torch

from actors.critic import Critic
from actors.policy import Policy
from actors.trainer import Trainer
from algorithms.dpo import DPOConfig, DPOLoss
from algorithms.grpo import GRPOConfig, GRPOLoss
from meshrl.config import ModelConfig, OptimConfig, PolicyConfig
from meshrl.model.losses import AGGREGATIONS
from meshrl.procs.mesh import RoleMeshes, call_all, call_each, form_groups
from meshrl.types import TrainBatch

pytestmark = [pytest.mark.actors, pytest.mark.timeout(300)]

TIMEOUT = 120
MODEL = ModelConfig()
QWEN3 = ModelConfig(arch="qwen3")
TOLERANCE = 1e-5


def grpo_loss(aggregation: str) -> GRPOLoss:
    """GRPO's loss with `aggregation`, clip-higher and a KL term."""
    return GRPOLoss(GRPOConfig(loss_aggregation=aggregation, kl_coef=0.1, clip_high=0.28))


def dpo_loss_hook() -> DPOLoss:
    return DPOLoss(DPOConfig(beta=0.5))


def fixed_batch(rows: int = 8, prompt: int = 3, completion: int = 6) -> TrainBatch:
    """Two groups of 4 rows, each sharing a prompt (3 and 2 tokens: left
    padding), completions of very different lengths (1 to 6 counted tokens), a
    ratio away from 1 (old log-probs perturbed), per-row advantages and
    reference log-probs."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 6, 2, 5, 6, 1, 3, 4])[:rows]
    mask = (torch.arange(completion) < lengths.unsqueeze(1)).float()
    ids = torch.randint(3, 30, (rows, prompt + completion), generator=g)
    ids[:, :prompt] = ids[torch.arange(rows) // 4 * 4, :prompt]  # groups of 4
    prompt_mask = torch.ones(rows, prompt)
    prompt_mask[4:, 0] = 0  # the second group's prompt is a token shorter
    ids[4:, 0] = 0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.cat([prompt_mask, mask], 1),
        completion_mask=mask,
        old_logprobs=-3.5 + 0.3 * torch.randn(rows, completion, generator=g),
        advantages=torch.randn(rows, generator=g),
        ref_logprobs=-3.5 + 0.3 * torch.randn(rows, completion, generator=g),
        old_values=0.1 * torch.randn(rows, completion, generator=g),
        returns=torch.randn(rows, completion, generator=g),
    )


@pytest.fixture(scope="module")
def meshes():
    """Trainers: 1 proc, padded; 2 procs DDP with 2 micro-batches, tree; 2 procs
    FSDP2, tree (packed is checked in-process, tests/unit/test_packing.py); 2 procs
    TP, tree; 2 x 2 procs FSDP2 x TP, padded, 2 micro-batches; Qwen3 on 1 proc and
    on 2 TP procs (its per-head norms). Critics: 1 proc (beside the 1-proc
    trainer), padded; 2 procs with 2 micro-batches, tree. Two TP2 policy replicas
    (the second pulls from the first's relay) and a 1-proc one; an fp8 TP2
    replica and an fp8 1-proc one."""
    meshes = RoleMeshes(
        {
            "one": 1,
            "ddp": 2,
            "fsdp": 2,
            "critic": 2,
            "tp": 2,
            "fsdp_tp": 4,
            "replica": 1,
            "replica_tp": 1,
            "relayed": 1,
            "relayed_tp": 1,
            "tp_qwen3": 2,
            "fp8": 1,
            "fp8_tp": 1,
        }
    )
    optim = OptimConfig(lr=1e-2)
    try:

        def trainer(mesh, model=MODEL, name=None, **kw):
            return meshes[mesh].spawn(
                name or f"trainer_{mesh}",
                Trainer,
                model,
                optim,
                grpo_loss("token-mean"),
                10,
                master=meshes.rendezvous(mesh),
                **kw,
            )

        def critic(mesh, **kw):
            return meshes[mesh].spawn(
                f"critic_{mesh}", Critic, MODEL, optim, 10, 0.2, 0, meshes.rendezvous(mesh), **kw
            )

        # Made at once: four process groups meet on this host together (each at a
        # store its rank 0's proc holds from the start: no two can share a port).
        spawned = {
            "one": trainer("one", layout="padded"),
            "ddp": trainer("ddp", micro_batches=2, layout="tree"),
            "fsdp": trainer("fsdp", sharding="fsdp", layout="tree", replica_tp=2),
            "tp": trainer("tp", sharding="tp", tp=2, layout="tree", replica_tp=2),
            "fsdp_tp": trainer("fsdp_tp", sharding="fsdp_tp", tp=2, micro_batches=2),
            "qwen3_one": trainer("one", QWEN3, "trainer_qwen3"),
            "qwen3_tp": trainer("tp_qwen3", QWEN3, sharding="tp", tp=2),
            "critic_one": critic("one", layout="padded"),
            "critic_two": critic("critic", micro_batches=2, layout="tree"),
        }
        # Two policy replicas split over 2 procs each (leader and follower), and one
        # of 1 proc.
        fp8 = PolicyConfig(precision="fp8")
        for name, policy_cfg in (("replica", None), ("relayed", None), ("fp8", fp8)):
            spawned[name] = meshes[name].spawn(name, Policy, MODEL, 0, policy_cfg, tp=2)
            follower = meshes[f"{name}_tp"].spawn(
                f"{name}_follower", Policy, MODEL, 0, policy_cfg, tp=2, leader=False
            )
            form_groups(spawned[name], follower, 1, 2, meshes.rendezvous_each(name), TIMEOUT)
        spawned["replica_one"] = meshes["one"].spawn("replica_one", Policy, MODEL)
        spawned["fp8_one"] = meshes["one"].spawn("fp8_one", Policy, MODEL, 0, fp8)
        for name, actors in spawned.items():
            call_all(actors, "parameters", what=f"{name}.init", timeout_s=TIMEOUT)
        yield spawned
    finally:
        meshes.stop()


TP = {"tp": 2, "fsdp_tp": 2}  # procs per tensor-parallel group
PROCS = {"one": 1, "ddp": 2, "fsdp": 2, "tp": 2, "fsdp_tp": 4}
PLACEMENTS = ("ddp", "fsdp", "tp", "fsdp_tp")


def gradient(actors, procs: int, batch: TrainBatch, rows=None, tp: int = 1) -> torch.Tensor:
    """The gradient the mesh would step with, every data-parallel rank given its
    shard (the `tp` procs of a tensor-parallel group the same one), flattened."""
    dp = procs // tp
    shards = [
        (batch.shard(i // tp, dp, None if rows is None else rows(i // tp)),) for i in range(procs)
    ]
    grads = call_each(actors, "gradients", shards, "gradients", TIMEOUT)
    assert all(g.keys() == grads[0].keys() for g in grads)
    for g in grads[1:]:  # every rank holds the same, reduced gradient
        assert all(torch.equal(g[k], grads[0][k]) for k in g)
    return torch.cat([grads[0][k].flatten() for k in sorted(grads[0])])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert want.norm() > 0
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_gradient_is_the_same_at_any_placement(meshes, aggregation):
    for name in ("one", *PLACEMENTS):
        call_all(
            meshes[name], "set_loss", grpo_loss(aggregation), what="set_loss", timeout_s=TIMEOUT
        )
    batch = fixed_batch()
    want = gradient(meshes["one"], 1, batch)
    for name in PLACEMENTS:
        error = relative_error(gradient(meshes[name], PROCS[name], batch, tp=TP.get(name, 1)), want)
        assert error < TOLERANCE, f"{aggregation} on {name}: relative error {error:.2e}"


def test_qwen3_gradient_is_the_same_with_tensor_parallelism(meshes):
    """Qwen3 normalises q and k per head: on 2 TP procs each normalises its own
    heads, and the norms' gradients are summed over the procs."""
    batch = fixed_batch()
    want = gradient(meshes["qwen3_one"], 1, batch)
    error = relative_error(gradient(meshes["qwen3_tp"], 2, batch, tp=2), want)
    assert error < TOLERANCE, f"qwen3 on tp: relative error {error:.2e}"


def test_dpo_gradient_is_the_same_at_any_placement(meshes):
    for name in ("one", *PLACEMENTS):
        call_all(meshes[name], "set_loss", dpo_loss_hook(), what="set_loss", timeout_s=TIMEOUT)
    batch = fixed_batch()  # rows [chosen; rejected] of the same 4 pairs
    batch.paired = True  # (so the 2 micro-batches of DDP keep pairs whole)
    half = len(batch) // 2
    ranks_pairs = [[0, 1, 3], [2]]  # whole pairs per rank, unevenly: 3 and 1

    def uneven(i: int) -> torch.Tensor:
        return torch.tensor(ranks_pairs[i] + [p + half for p in ranks_pairs[i]])

    want = gradient(meshes["one"], 1, batch)
    for name in PLACEMENTS:
        tp = TP.get(name, 1)
        rows = uneven if PROCS[name] // tp == 2 else None  # one data-parallel rank: all rows
        error = relative_error(gradient(meshes[name], PROCS[name], batch, rows, tp), want)
        assert error < TOLERANCE, f"dpo on {name}: relative error {error:.2e}"


def test_value_gradient_is_the_same_with_one_or_two_critic_procs(meshes):
    batch = fixed_batch()
    # The value head starts at 0 (no gradient reaches the backbone): one step on
    # one proc first, then the 2-proc critic loads the same weights.
    call_each(meshes["critic_one"], "train_step", [(batch,)], "train", TIMEOUT)
    with tempfile.TemporaryDirectory() as directory:
        call_all(meshes["critic_one"], "save_state", directory, what="save", timeout_s=TIMEOUT)
        call_all(meshes["critic_two"], "load_state", directory, what="load", timeout_s=TIMEOUT)
    batch.returns = batch.returns.flip(0)  # another target than the step above
    want = gradient(meshes["critic_one"], 1, batch)
    error = relative_error(gradient(meshes["critic_two"], 2, batch), want)
    assert error < TOLERANCE, f"value loss on 2 critic procs: relative error {error:.2e}"


BF16_MIXED_TOLERANCE = 2e-2
"""bf16-mixed's tolerance: its matmuls round to bfloat16 (8 significant bits, a
unit roundoff of 2**-9 = 2e-3), and a placement rounds other partial products
(tensor parallelism splits each matmul; micro-batches and shards split the
rows), so each layer's activations differ by a few roundoffs and the gradient
by about ten; 1e-5 is float32's."""


def test_bf16_mixed_gradient_is_the_same_at_any_placement(meshes):
    """trainer.precision=bf16-mixed: the gradient at every placement (DDP, FSDP2,
    TP, FSDP2 x TP) equals the 1-proc bf16-mixed one within its tolerance, and
    is within it of float32's too (float32 master weights: the same step)."""
    names = ("one", *PLACEMENTS)
    for name in names:
        call_all(meshes[name], "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    fp32 = gradient(meshes["one"], 1, batch)
    try:
        for name in names:
            call_all(meshes[name], "set_precision", "bf16-mixed", what="bf16", timeout_s=TIMEOUT)
        want = gradient(meshes["one"], 1, batch)
        assert 0 < relative_error(want, fp32) < BF16_MIXED_TOLERANCE  # bf16 did compute
        for name in PLACEMENTS:
            got = gradient(meshes[name], PROCS[name], batch, tp=TP.get(name, 1))
            error = relative_error(got, want)
            assert error < BF16_MIXED_TOLERANCE, f"bf16-mixed on {name}: {error:.2e}"
    finally:
        for name in names:
            call_all(meshes[name], "set_precision", "fp32", what="fp32", timeout_s=TIMEOUT)


def test_a_sharded_trainer_publishes_the_one_proc_bf16_and_fp8_bytes(meshes):
    """FSDP2 x TP (2 x 2 procs) publishes each precision's bytes equal to the
    1-proc trainer's (fp8: every shard quantized on the whole matrix's 128 x 128
    grid, its block maxima reduced over the ranks), each checked as it is pulled."""
    from meshrl.model.models import load_model
    from meshrl.weights.precision import to_precision
    from meshrl.weights.publisher import WeightHandle
    from meshrl.weights.receiver import WeightReceiver

    wires = ("fp32", "bf16", "fp8")
    held = {}
    try:
        for name in ("one", "fsdp_tp"):
            call_all(meshes[name], "set_precision", "fp32", wires, what="wires", timeout_s=TIMEOUT)
            handle = WeightHandle.merge(
                call_all(meshes[name], "publish", what="publish", timeout_s=TIMEOUT)
            )
            assert handle.precisions == list(wires)
            for wire in ("bf16", "fp8"):
                receiver = WeightReceiver(to_precision(load_model(MODEL, 1), wire))
                assert receiver.pull(handle).verified
                held[name, wire] = {k: p.detach().clone() for k, p in receiver.params.items()}
    finally:
        for name in ("one", "fsdp_tp"):
            call_all(
                meshes[name], "set_precision", "fp32", ("fp32",), what="fp32", timeout_s=TIMEOUT
            )
    for wire in ("bf16", "fp8"):
        for key, want in held["one", wire].items():
            got = held["fsdp_tp", wire][key]
            assert got.dtype == want.dtype and torch.equal(
                got.view(torch.uint8), want.view(torch.uint8)
            ), (wire, key)


def test_tensor_parallel_steps_end_where_one_proc_does_and_sync_whole_weights(meshes):
    """Three optimizer steps on 2 tensor-parallel procs end at the 1-proc
    trainer's weights; the version they publish (each rank its blocks, as the
    reshard plan says) pulls into a whole model equal to them. Runs last: it
    moves the 1-proc trainer's weights."""
    from meshrl.model.models import load_model
    from meshrl.procs.reshard import Layout, sources
    from meshrl.procs.tensor_parallel import parameter_styles
    from meshrl.weights.publisher import WeightHandle
    from meshrl.weights.receiver import WeightReceiver

    for name in ("one", "tp"):
        call_all(meshes[name], "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    for _ in range(3):
        call_each(meshes["one"], "train_step", [(batch.shard(0, 1),)], "step", TIMEOUT)
        call_each(meshes["tp"], "train_step", [(batch.shard(0, 1),)] * 2, "step", TIMEOUT)
    want = call_all(meshes["one"], "parameters", what="one", timeout_s=TIMEOUT)[0]
    got = call_all(meshes["tp"], "parameters", what="tp", timeout_s=TIMEOUT)[0]
    assert got.keys() == want.keys()
    start = call_all(meshes["fsdp"], "parameters", what="fsdp", timeout_s=TIMEOUT)[0]
    for name in want:
        assert not torch.equal(want[name], start[name]) or "norm" in name, name  # they moved
        error = relative_error(got[name], want[name])
        assert error < 1e-4, f"{name} after 3 tp steps: relative error {error:.2e}"

    model = load_model(MODEL)
    styles = parameter_styles(model)
    assert {"colwise", "rowwise", "replicate"} == set(styles.values())
    for name, tp, whole in (("tp", 2, got), ("fsdp_tp", 2, None)):
        if whole is None:
            whole = call_all(meshes[name], "parameters", what=name, timeout_s=TIMEOUT)[0]
        handles = call_all(meshes[name], "publish", what="publish", timeout_s=TIMEOUT)
        layout = Layout.named(name, PROCS[name], tp)
        published: dict[str, dict[int, tuple]] = {}
        for rank, source in enumerate(h.sources[0] for h in handles):
            for piece in source.pieces:
                published.setdefault(piece.name, {})[rank] = piece.block
        for key, param in model.named_parameters():  # the blocks the plan says, by their owners
            want_blocks = sources(layout, tuple(param.shape), styles[key])
            assert published[key] == want_blocks, (name, key)
        pulled = WeightReceiver(model).pull(WeightHandle.merge(handles))
        assert pulled.verified
        for key, param in model.named_parameters():
            assert torch.equal(param.detach(), whole[key]), (name, key)


def tp_share(replicated: bool = True, model_cfg: ModelConfig = MODEL) -> int:
    """The bytes one proc of a TP2 replica of `model_cfg` holds: half of each split
    parameter, and with `replicated` the rest whole."""
    from meshrl.model.models import load_model
    from meshrl.procs.tensor_parallel import parameter_styles

    model = load_model(model_cfg)
    styles = parameter_styles(model)
    return sum(
        p.numel() * p.element_size() // (1 if styles[name] == "replicate" else 2)
        for name, p in model.named_parameters()
        if replicated or styles[name] != "replicate"
    )


def test_a_tensor_parallel_replica_reads_its_share_and_samples_the_one_proc_tokens(meshes):
    """An FSDP2 trainer of 2 procs publishes its row blocks in the parts a TP2
    replica's procs hold (a row block of a row-split layer in two column parts):
    the replica's leader copies its half of each split parameter and no more,
    and, with the same seeds, samples the tokens a 1-proc replica of the same
    version samples."""
    from meshrl.config import GenerationConfig
    from meshrl.weights.publisher import WeightHandle

    trainer = meshes["fsdp"]
    call_all(trainer, "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    call_each(trainer, "train_step", [(batch.shard(i, 2),) for i in range(2)], "step", TIMEOUT)
    handle = WeightHandle.merge(call_all(trainer, "publish", what="pub", timeout_s=TIMEOUT))
    pulled = call_all(meshes["replica"], "load_weights", handle, what="pull", timeout_s=TIMEOUT)[0]
    call_all(meshes["replica_one"], "load_weights", handle, what="pull", timeout_s=TIMEOUT)
    assert pulled.verified and pulled.version == handle.version
    assert pulled.bytes_moved == 2 * tp_share()  # each of its 2 procs its share, no more
    trained = call_all(trainer, "parameters", what="fsdp", timeout_s=TIMEOUT)[0]
    whole = call_all(meshes["replica"], "parameters", what="replica", timeout_s=TIMEOUT)[0]
    assert all(torch.equal(whole[k], trained[k]) for k in trained)

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    generation = GenerationConfig(max_new_tokens=10)
    seeds = [101, 202, 303]
    got = call_all(
        meshes["replica"], "generate", prompts, generation, seeds, what="gen", timeout_s=TIMEOUT
    )[0]
    want = call_all(
        meshes["replica_one"], "generate", prompts, generation, seeds, what="gen", timeout_s=TIMEOUT
    )[0]
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert (got.logprobs - want.logprobs).abs().max() < 1e-5


def test_a_tensor_parallel_replica_relays_its_blocks_to_the_next(meshes):
    """A relay made of a TP2 replica (`weights.fanout` with `placement.policy_tp`):
    its two procs publish the blocks they hold, its leader alone the whole
    parameters, and the leader answers with their handles merged. Another TP2
    replica pulls from it: each proc reads its own blocks and nothing else, checked
    against the relay's sums, and ends bitwise equal to the trainer; a 1-proc
    replica pulls the whole model from the same relay (every parameter once)."""
    from meshrl.weights.publisher import WeightHandle

    trainer = meshes["fsdp"]
    call_all(trainer, "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    batch = fixed_batch()
    call_each(trainer, "train_step", [(batch.shard(i, 2),) for i in range(2)], "step", TIMEOUT)
    handle = WeightHandle.merge(call_all(trainer, "publish", what="pub", timeout_s=TIMEOUT))
    relay = call_all(
        meshes["replica"], "load_weights", handle, True, what="relay pull", timeout_s=TIMEOUT
    )[0].relay
    assert relay is not None and relay.version == handle.version
    pieces = [(p.name, p.start) for s in relay.sources for p in s.pieces]
    assert len(pieces) == len(set(pieces)) and len(relay.sources) == 2  # leader, follower
    pulled = call_all(meshes["relayed"], "load_weights", relay, what="pull", timeout_s=TIMEOUT)[0]
    assert pulled.verified and pulled.version == handle.version
    # Its split blocks copied, each proc its half; the whole parameters served in
    # place from the relay leader's slot (zero-copy on one host).
    assert pulled.bytes_moved == 2 * tp_share(replicated=False)
    trained = call_all(trainer, "parameters", what="fsdp", timeout_s=TIMEOUT)[0]
    for name in ("relayed", "replica_one"):
        if name == "replica_one":
            call_all(meshes[name], "load_weights", relay, what="pull", timeout_s=TIMEOUT)
        got = call_all(meshes[name], "parameters", what=name, timeout_s=TIMEOUT)[0]
        assert all(torch.equal(got[k], trained[k]) for k in trained), name


def test_an_fp8_tensor_parallel_replica_reads_its_share_relays_and_samples_as_one_proc(meshes):
    """FP8 replicas split with tensor parallelism. The FSDP2 trainer publishes
    fp8 in the parts of a TP2 replica: its procs each read their half of every
    split FP8 matrix and the rest whole, and no more. Its relay gives a 1-proc fp8 replica the bytes
    a receiver of the trainer's version holds, and the TP2's own, gathered, equal
    them; with the same seeds both sample the same tokens (the column-split
    layers' partial outputs are summed in float32: log-probs within bf16's
    rounding)."""
    from meshrl.config import GenerationConfig
    from meshrl.model.models import load_model
    from meshrl.procs.tensor_parallel import parameter_styles
    from meshrl.weights.precision import to_precision
    from meshrl.weights.publisher import WeightHandle
    from meshrl.weights.receiver import WeightReceiver

    trainer, tp, one = meshes["fsdp"], meshes["fp8"], meshes["fp8_one"]
    call_all(trainer, "set_precision", "fp32", ("fp32", "fp8"), what="wires", timeout_s=TIMEOUT)
    try:  # (back to fp32 only once read: that closes the fp8 slots)
        handle = WeightHandle.merge(call_all(trainer, "publish", what="pub", timeout_s=TIMEOUT))
        pulled = call_all(tp, "load_weights", handle, True, what="pull", timeout_s=TIMEOUT)[0]
        held = WeightReceiver(to_precision(load_model(MODEL, 1), "fp8"))
        assert held.pull(handle).verified
    finally:
        call_all(trainer, "set_precision", "fp32", ("fp32",), what="fp32", timeout_s=TIMEOUT)
    assert pulled.verified and pulled.precision == "fp8"
    styles = parameter_styles(load_model(MODEL, 1))  # the trainer's plan, by HF name
    share = {
        name: p.numel()
        * p.element_size()
        // (1 if styles.get(name, "replicate") == "replicate" else 2)
        for name, p in held.params.items()
    }
    assert pulled.version_bytes == 2 * sum(share.values())
    # The block scales are whole, float32 and on this host: served in place from
    # the trainer's slot (zero-copy), not copied.
    scales = sum(n for name, n in share.items() if name.endswith("_scale"))
    assert pulled.bytes_moved == 2 * (sum(share.values()) - scales)
    want = {k: p.detach().view(torch.uint8) for k, p in held.params.items()}
    call_all(one, "load_weights", pulled.relay, what="relayed", timeout_s=TIMEOUT)
    for name, actors in (("tp2", tp), ("one", one)):
        got = call_all(actors, "parameters", what=name, timeout_s=TIMEOUT)[0]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k].view(torch.uint8), want[k]) for k in want), name
    prompts, seeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [101, 202, 303]
    generation = GenerationConfig(max_new_tokens=10)
    got, want = (
        call_all(actors, "generate", prompts, generation, seeds, what="gen", timeout_s=TIMEOUT)[0]
        for actors in (tp, one)
    )
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert (got.logprobs - want.logprobs).abs().max() < 0.02  # 0.0025 measured


def test_a_bf16_mixed_trainer_resumes_bitwise(meshes):
    """bf16-mixed keeps its whole state in float32 (weights, optimizer, schedule):
    two steps from a saved state, then the state loaded and the same two steps
    again, end at the same bits. The 1-proc trainer ends where it began."""
    one = meshes["one"]
    call_all(one, "set_loss", grpo_loss("token-mean"), what="loss", timeout_s=TIMEOUT)
    call_all(one, "set_precision", "bf16-mixed", what="bf16", timeout_s=TIMEOUT)
    batch = fixed_batch()
    with tempfile.TemporaryDirectory() as start:
        try:
            call_all(one, "save_state", start, what="save", timeout_s=TIMEOUT)
            runs = []
            for _ in range(2):
                call_all(one, "load_state", start, what="load", timeout_s=TIMEOUT)
                for _ in range(2):
                    call_each(one, "train_step", [(batch.shard(0, 1),)], "step", TIMEOUT)
                runs.append(call_all(one, "parameters", what="one", timeout_s=TIMEOUT)[0])
            first, again = runs
            assert all(torch.equal(first[k], again[k]) for k in first)
            assert all(p.dtype == torch.float32 for p in first.values())
        finally:
            call_all(one, "load_state", start, what="back", timeout_s=TIMEOUT)
            call_all(one, "set_precision", "fp32", what="fp32", timeout_s=TIMEOUT)
