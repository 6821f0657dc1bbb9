"""Precisions of the published weights (`meshrl.weights.precision`): each
precision's sync checked end to end on this host (trainer-side conversion, the
bytes that travel, their checksums, delta and a relay), FP8 block quantization
the same whole or in shards, the FP8 layer's CPU path, the mismatch figure of
the ratio band, and the refusals in one line naming the key."""

import pytest
import torch

from meshrl.config import ConfigError, ModelConfig, PolicyConfig, TrainerConfig
from meshrl.model.losses import mismatch_metrics
from meshrl.model.models import load_model
from meshrl.weights import precision as P
from meshrl.weights.publisher import WeightHandle, WeightPublisher
from meshrl.weights.receiver import WeightReceiver

pytestmark = pytest.mark.unit

WIRES = ("fp32", "bf16", "fp8")


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == P.FP8 else t


@pytest.fixture(scope="module")
def trainer():
    """A float32 model and one publisher per precision (shared memory only)."""
    model = load_model(ModelConfig(), 0)
    names = P.fp8_weight_names(model)
    publishers = [
        WeightPublisher(
            model, rdma=False, parameters=P.source(model.named_parameters, w, names), precision=w
        )
        for w in WIRES
    ]
    yield model, names, publishers
    for publisher in publishers:
        publisher.close()


def test_each_precision_syncs_its_own_bytes_checked_with_delta_and_relay(trainer):
    model, names, publishers = trainer
    receivers = {
        w: WeightReceiver(P.to_precision(load_model(ModelConfig(), 1), w), zero_copy=True)
        for w in WIRES
    }
    for step in range(2):
        with torch.no_grad():  # the second step changes one matrix only (delta)
            params = list(model.parameters()) if step == 0 else [model.lm_head.weight]
            for p in params:
                p.add_(0.01 * torch.randn_like(p))
        handle = WeightHandle.merge([p.publish(step + 1, True, True) for p in publishers])
        assert handle.precisions == list(WIRES)
        sizes = {w: handle.of_precision(w).num_bytes for w in WIRES}
        assert sizes["bf16"] <= 0.51 * sizes["fp32"]
        assert sizes["fp8"] <= 0.27 * sizes["fp32"]  # the head (and norms) stay bf16
        for wire, receiver in receivers.items():
            pulled = receiver.pull(handle, serve=True)
            assert pulled.verified and pulled.precision == wire
            assert pulled.version_bytes == sizes[wire]
            want = dict(P.converted(model.named_parameters(), wire, names))
            for name, param in receiver.params.items():
                assert torch.equal(as_bits(param), as_bits(want[name])), (wire, name)
            # A replica of the same precision pulls from the relay: the same bytes.
            child = WeightReceiver(P.to_precision(load_model(ModelConfig(), 2), wire))
            assert child.pull(pulled.relay).verified
            for name, param in child.params.items():
                assert torch.equal(as_bits(param), as_bits(want[name])), (wire, name)


def test_a_bf16_replica_casts_fp32_bytes_to_the_trainers_bf16(trainer):
    """Where only fp32 was published, a bf16 replica casts what it reads: the same
    values as the trainer's conversion (torch's round to nearest even), more bytes."""
    model, _, publishers = trainer
    handle = publishers[0].publish(7, True, False)
    receiver = WeightReceiver(P.to_precision(load_model(ModelConfig(), 1), "bf16"))
    assert receiver.pull(handle).precision == "fp32"
    for name, param in receiver.params.items():
        assert torch.equal(param, dict(model.named_parameters())[name].to(torch.bfloat16))
    fp8 = WeightReceiver(P.to_precision(load_model(ModelConfig(), 1), "fp8"))
    fp8.owner = "policy[0]"
    with pytest.raises(ValueError, match=r"^policy\[0\]: version 7 was published in fp32, not fp8"):
        fp8.pull(handle)


def test_fp8_blocks_are_the_same_whole_or_in_shards():
    """A shard's blocks, its maxima reduced with the others' (max), quantize to the
    bytes of the whole matrix's: any split, rows or columns."""
    weight = torch.randn(300, 260) * torch.linspace(0.1, 3, 260)
    whole, scale = P.quantize_blocks(weight)
    assert scale.shape == (3, 3)
    error = (P.dequantize_blocks(whole, scale, torch.float32) - weight).abs()
    assert (error <= weight.abs() / 16 + scale.max() * 2**-9).all()  # e4m3: 3 mantissa bits
    for cuts in ([(0, 100), (100, 300)], [(0, 150), (150, 300)]):
        for dim in (0, 1):
            parts = []
            for a, b in cuts:
                b = min(b, weight.size(dim))
                start = (a, 0) if dim == 0 else (0, a)
                parts.append((weight.narrow(dim, a, b - a), start))
            amax = torch.stack([P._block_amax(t, s, tuple(weight.shape)) for t, s in parts])
            reduced = P.scales_of(amax.amax(0))
            assert torch.equal(reduced, scale)
            joined = torch.cat([P.quantize_local(t, reduced, s) for t, s in parts], dim)
            assert torch.equal(joined.view(torch.uint8), whole.view(torch.uint8))


def test_fp8_layer_on_cpu_is_its_dequantized_bf16_matmul():
    linear = torch.nn.Linear(64, 48)
    layer = P.Fp8Linear(linear)
    assert not layer.fp8_matmul  # no FP8 matmul on a CPU
    x = torch.randn(3, 5, 64)
    weight = P.dequantize_blocks(layer.weight, layer.weight_scale)
    want = torch.nn.functional.linear(x.to(torch.bfloat16), weight, layer.bias)
    assert torch.equal(layer(x), want)
    layer.to(torch.float32)  # a model-wide cast leaves the FP8 bytes as they are
    assert layer.weight.dtype == P.FP8 and layer.weight_scale.dtype == torch.float32
    model = P.to_precision(load_model(ModelConfig(), 0), "fp8")
    assert P.precision_of(model) == "fp8"
    assert model.lm_head.weight.dtype == torch.bfloat16  # the head and norms: bf16
    assert model.model.norm.weight.dtype == torch.bfloat16
    # The (untied) embedding table in FP8: each row looked up is its dequantized row.
    table = model.model.embed_tokens
    assert isinstance(table, P.Fp8Embedding) and table.weight.dtype == P.FP8
    ids = torch.tensor([[0, 5, table.num_embeddings - 1]])
    whole = P.dequantize_blocks(table.weight, table.weight_scale)
    assert torch.equal(table(ids), whole[ids])
    # Tied to the head (Qwen2's small sizes), the table is the head's: bf16.
    tied = load_model(ModelConfig(arch="qwen2"), 0)
    assert "model.embed_tokens.weight" not in P.fp8_weight_names(tied)


def test_fp8_matmul_in_blocks_of_a_split_matrix_sums_to_the_whole_ones():
    """The FP8 matmul (`torch._scaled_mm`, which this CPU build runs too) of a
    split layer's blocks, each on the whole matrix's 128 x 128 scale grid from
    where it starts: the row blocks' outputs join to the whole matrix's; the
    column blocks' partial outputs sum to the dequantized matmul within e4m3's
    rounding, as the whole one does (their activations are quantized over the
    tiles each proc holds, so not to the same bits)."""
    torch.manual_seed(0)
    weight = torch.randn(256, 320) * torch.linspace(0.1, 3, 320)
    x = torch.randn(5, 320).to(torch.bfloat16)
    fp8, scale = P.quantize_blocks(weight)
    whole = P._fp8_matmul(x, fp8, scale)
    exact = x.float() @ P.dequantize_blocks(fp8, scale, torch.float32).t()
    assert ((whole - exact).abs() / exact.abs().max()).max() < 0.05
    assert P._column_pieces(96, 96) == [(0, 32, 0), (32, 96, 1)]
    rows = [P._fp8_matmul(x, fp8[a:b], scale, (a, 0)) for a, b in ((0, 96), (96, 256))]
    assert torch.equal(torch.cat(rows, 1), whole)
    cols = [(0, 96), (96, 240), (240, 320)]  # pieces of 96 = 32 + 64, ...
    assert all(P._fp8_shapes_ok(fp8[:, a:b], (0, a)) for a, b in cols)
    parts = [P._fp8_matmul(x[:, a:b], fp8[:, a:b], scale, (0, a)) for a, b in cols]
    assert ((sum(parts) - exact).abs() / exact.abs().max()).max() < 0.05
    assert not P._fp8_shapes_ok(fp8[:, :40], (0, 0))  # _scaled_mm wants 16s


def test_ratio_off_band_counts_the_tokens_outside_0_9_to_1_1():
    sampler = torch.zeros(1, 4)
    trainer = torch.log(torch.tensor([[1.0, 1.05, 1.2, 0.8]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert mismatch_metrics(trainer, sampler, mask)["sampling/ratio_off_band"] == pytest.approx(
        1 / 3
    )


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: TrainerConfig(precision="fp16").validate(), "trainer.precision"),
        (lambda: PolicyConfig(precision="int4").validate(), "policy.precision"),
        (lambda: PolicyConfig(precision="fp8", engine="vllm").validate(), "policy.precision"),
        (
            lambda: PolicyConfig(precision="fp8", dtype="bfloat16").validate(),
            "policy.precision",
        ),
        (
            lambda: TrainerConfig(precision="bf16-mixed").check_precision(
                ModelConfig(dtype="bfloat16")
            ),
            "trainer.precision",
        ),
    ],
)
def test_impossible_precisions_are_refused_in_one_line(make, key):
    with pytest.raises(ConfigError) as error:
        make()
    assert f"'{key}'" in str(error.value) and "\n" not in str(error.value)


def test_impossible_actor_precisions_are_refused_in_one_line():
    for args, key in [
        (("bf16-mixed", ("fp32",), "bfloat16"), "trainer.precision"),
        (("fp32", ("fp4",), "float32"), "policy.precision"),
    ]:
        with pytest.raises(ValueError, match=f"^config key '{key}'"):
            P.check_precisions(*args)


def test_the_old_policy_dtype_still_names_the_precision():
    assert PolicyConfig(dtype="bfloat16").precision_for("float32") == "bf16"
    assert PolicyConfig().precision_for("bfloat16") == "bf16"
    assert PolicyConfig(precision="fp8").precision_for("float32") == "fp8"
    cfg = TrainerConfig()
    assert cfg.published(ModelConfig(), PolicyConfig(precision="fp8")) == ("fp8",)
    assert cfg.published(ModelConfig(), PolicyConfig(precision="fp8"), True) == ("fp8", "fp32")
