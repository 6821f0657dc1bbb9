"""Precisions of the published weights: what a replica serves in, made on the
trainer's side before the bytes travel (`meshrl.weights.publisher`).

- `fp32`: the trainer's parameters as they are.
- `bf16`: each floating parameter rounded to bfloat16 (round to nearest even,
  torch's cast): half the bytes.
- `fp8`: each decoder linear layer's weight, and the input embedding table
  when it is not the output head's too, as `torch.float8_e4m3fn` with one
  float32 scale per 128 x 128 block (`BLOCK`), published as two pieces, `<name>`
  and `<name>_scale`; everything else (norms, biases, the output head and an
  embedding table tied to it, MoE expert tensors, a vision tower) in bfloat16. A
  quarter of a matrix's bytes plus 4 bytes per 16,384 weights. The table is a
  lookup (each token reads one row, dequantized; no matmul sums its rounding),
  while the head makes the logits the sampler draws from, so the head keeps
  bfloat16; with both in bfloat16 a model's bytes stay above 0.27 of fp32's
  until its embeddings are under a tenth of its weights (a 70B model's; an 8B's
  are 13 %: 0.283). The 128 x 128 weight blocks
  are DeepSeek-V3's fine-grained FP8 scheme (arXiv 2412.19437, section 3.3:
  "128x128 weight blocks", activations per 1 x 128 tile), also the
  `weight_block_size: [128, 128]` of the FP8 checkpoints vLLM and SGLang serve.
  A block's scale is its largest magnitude over 448, e4m3's largest finite
  value, so no weight saturates.

A sharded trainer (FSDP2, tensor parallelism) quantizes its own block of each
matrix against the same global 128 x 128 grid, its blocks' largest magnitudes
reduced (max) over every rank first, so the bytes equal those of the whole
matrix quantized on one proc (`quantize_blocks`), whatever the layout.

On the replica (`Fp8Linear`): on a CUDA device of compute capability >= 8.9
the matmul runs in FP8 (`torch._scaled_mm`, one call per 128-column block of
the weight with per-row activation scales over that block, 1 x 128 tiles);
elsewhere, the CPU included, each layer dequantizes its weight to bfloat16
before a bfloat16 matmul: the same weights, no speed gain. A tensor-parallel
replica's `Fp8Linear`s split themselves (`split_tensor_parallel`): each proc
holds its block of the FP8 weight, read on the whole matrix's scale grid from
where it starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp8")
"""`policy.precision`'s values: what the replicas hold and the trainer publishes."""
TRAINER_PRECISIONS = ("fp32", "bf16-mixed")
"""`trainer.precision`'s values."""
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
SCALE_SUFFIX = "_scale"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
"""Each precision's dtype for the parameters that are not FP8 matrices."""
FROM_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
"""`model.dtype` / the old `policy.dtype` values as precisions."""


def precision_of(model: torch.nn.Module) -> str:
    """The precision a model's parameters are in: fp8 when it has FP8 weights,
    bf16 when its floating parameters are bfloat16, else fp32."""
    dtypes = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    if FP8 in dtypes:
        return "fp8"
    return "bf16" if dtypes == {torch.bfloat16} else "fp32"


def fp8_weight_names(model: torch.nn.Module) -> set[str]:
    """The HF names of the weights an fp8 replica holds in FP8: every
    `nn.Linear`'s weight but the output head's (and those tied to the
    embeddings), outside a vision tower, and the input embedding table when it
    is a plain `nn.Embedding` not tied to the head (a subclass, e.g. Gemma's
    scaled one, keeps its own forward in bfloat16). Call on the model before any
    wrapper (LoRA, DDP) renames its parameters."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {id(head.weight)} if head is not None else set()
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        tied.add(id(embeddings.weight))
    names = set()
    for module_name, module in model.named_modules():
        if module is embeddings and type(module) is torch.nn.Embedding:
            if head is None or head.weight is not module.weight:
                names.add(f"{module_name}.weight")
            continue
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if "vision" in module_name or id(module.weight) in tied:
            continue
        names.add(f"{module_name}.weight")
    return names


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def _on_grid(local: torch.Tensor, start: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """`local` (a block of its matrix starting at `start`) in float32 as
    [rows / 128, 128, cols / 128, 128]: the matrix's 128 x 128 blocks that it
    touches, zero-padded out to the grid lines around it (no copy where it lies
    on them); and where `local` starts inside (top, left)."""
    rows, cols = local.shape
    top, left = start[0] % BLOCK, start[1] % BLOCK
    padded_rows = math.ceil((top + rows) / BLOCK) * BLOCK
    padded_cols = math.ceil((left + cols) / BLOCK) * BLOCK
    x = local.detach().float()
    if (top, left, padded_rows, padded_cols) != (0, 0, rows, cols):
        right, bottom = padded_cols - cols - left, padded_rows - rows - top
        x = torch.nn.functional.pad(x, (left, right, top, bottom))
    x = x.contiguous()
    return x.view(padded_rows // BLOCK, BLOCK, padded_cols // BLOCK, BLOCK), top, left


def _block_amax(local: torch.Tensor, start: tuple[int, int], full: tuple[int, int]) -> torch.Tensor:
    """Each global 128 x 128 block's largest magnitude over `local`, a block of
    the full [rows, cols] matrix starting at `start` (zero where it has none)."""
    grid = torch.zeros(_grid(*full), dtype=torch.float32, device=local.device)
    if local.numel() == 0:
        return grid
    blocks, _, _ = _on_grid(local, start)
    # max(|min|, max): the block's largest magnitude without a copy of |x|.
    # (One dim at a time: faster on the CPU than both at once.)
    amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), -blocks.amin(dim=3).amin(dim=1))
    br, bc = start[0] // BLOCK, start[1] // BLOCK
    grid[br : br + amax.size(0), bc : bc + amax.size(1)] = amax
    return grid


def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """Block scales from block maxima: amax / 448, and 1 for an all-zero block."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _scales_over(blocks: torch.Tensor, scale: torch.Tensor, start: tuple[int, int]) -> torch.Tensor:
    """The matrix's block `scale`s of the `_on_grid` `blocks` of a block of it
    starting at `start`, shaped to broadcast over them."""
    br, bc = start[0] // BLOCK, start[1] // BLOCK
    mine = scale[br : br + blocks.size(0), bc : bc + blocks.size(2)].float()
    return mine[:, None, :, None]


def quantize_local(
    local: torch.Tensor, scale: torch.Tensor, start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """`local` (a block of the matrix starting at `start`) in float8_e4m3fn with
    the matrix's block `scale`s: one division a weight, by its block's scale."""
    if local.numel() == 0:
        return torch.empty(local.shape, dtype=FP8, device=local.device)
    blocks, top, left = _on_grid(local, start)
    # Written as FP8 by the division itself (no float32 quotient kept). No clamp: a
    # weight over its block's scale is at most 448 but for the division's rounding,
    # and a cast to float8_e4m3fn rounds that to 448.
    quantized = torch.empty(blocks.shape, dtype=FP8, device=blocks.device)
    torch.div(blocks, _scales_over(blocks, scale, start), out=quantized)
    rows, cols = local.shape
    flat = quantized.view(blocks.size(0) * BLOCK, blocks.size(2) * BLOCK)
    return flat[top : top + rows, left : left + cols].contiguous()


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole [rows, cols] matrix as (float8_e4m3fn weights, float32 scales
    [ceil(rows / 128), ceil(cols / 128)])."""
    scale = scales_of(_block_amax(weight, (0, 0), tuple(weight.shape)))
    return quantize_local(weight, scale), scale


def dequantize_blocks(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """FP8 weights (the block of the matrix starting at `start`) times their
    block scales (the matrix's), in `dtype`."""
    if weight.numel() == 0:
        return torch.empty(weight.shape, dtype=dtype, device=weight.device)
    blocks, top, left = _on_grid(weight, start)
    values = (blocks * _scales_over(blocks, scale, start)).to(dtype)
    rows, cols = weight.shape
    flat = values.view(blocks.size(0) * BLOCK, blocks.size(2) * BLOCK)
    return flat[top : top + rows, left : left + cols]


def _quantized_dtensor(param) -> tuple:
    """A DTensor matrix's (FP8 DTensor of the same layout, whole scales): its
    blocks' maxima reduced over every rank (each holds a block of the matrix)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    _, start = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    amax = _block_amax(local, tuple(start), tuple(param.shape))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # every rank publishes (sharded)
    scale = scales_of(amax)
    quantized = quantize_local(local, scale, tuple(start))
    wire = DTensor.from_local(
        quantized,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return wire, scale


def converted(
    parameters: Iterable[tuple[str, torch.Tensor]], precision: str, fp8_names: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of what a `precision` replica holds, from the trainer's
    (name, parameter) pairs, in their order: each FP8 matrix followed by its
    `<name>_scale`. A DTensor stays one (its local block converted)."""
    from meshrl.weights.publisher import _is_dtensor

    dtype = DTYPES[precision]
    for name, param in parameters:
        param = param.detach()
        if precision == "fp8" and name in fp8_names and param.dim() == 2:
            if _is_dtensor(param):
                weight, scale = _quantized_dtensor(param)
            else:
                weight, scale = quantize_blocks(param)
            yield name, weight
            yield name + SCALE_SUFFIX, scale
        elif param.dtype.is_floating_point and param.dtype != dtype:
            yield name, param.to(dtype)
        else:
            yield name, param


def source(
    parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]], precision: str, fp8: set[str]
) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """`parameters` as a `WeightPublisher` source of `precision`'s tensors."""
    if precision == "fp32":
        return lambda: iter(parameters())
    return lambda: converted(parameters(), precision, fp8)


def fp8_matmul_available(device: torch.device) -> bool:
    """Whether `device` runs FP8 matmuls (`torch._scaled_mm`): CUDA with compute
    capability >= 8.9 (Ada, Hopper and later)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _column_pieces(cols: int, c0: int) -> list[tuple[int, int, int]]:
    """(from, to, k): the pieces of a block of `cols` columns that starts at
    column `c0` of its matrix, each within one 128-column block `k` of it."""
    pieces, at = [], 0
    while at < cols:
        k = (c0 + at) // BLOCK
        end = min(cols, (k + 1) * BLOCK - c0)
        pieces.append((at, end, k))
        at = end
    return pieces


def _fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """x [M, K] (bf16) @ weight.T in FP8 on the device, in float32: per piece of
    the weight's columns within one 128-column block, x's columns quantized per
    row (1 x 128 tiles) and one `torch._scaled_mm` with row scales on both sides
    (the weight's rows take their 128 x 128 block's scale), the pieces' products
    summed in float32. `weight` is the block of the matrix starting at `start`
    (a tensor-parallel proc's), `scale` the whole matrix's."""
    rows, cols = weight.shape
    count = x.size(0)
    x = torch.nn.functional.pad(x, (0, 0, 0, -count % 16))  # _scaled_mm: M a multiple of 16
    out = torch.zeros(x.size(0), rows, dtype=torch.float32, device=x.device)
    row_block = (torch.arange(rows, device=x.device) + start[0]) // BLOCK
    for at, end, k in _column_pieces(cols, start[1]):
        xs = x[:, at:end].float()
        x_scale = scales_of(xs.abs().amax(dim=1, keepdim=True))  # [M, 1]
        xq = (xs / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        wq = weight[:, at:end].contiguous()  # [N, k]; its transpose is column-major
        w_scale = scale[row_block, k].float().view(1, rows).contiguous()
        # Row-wise scaling gives bfloat16 out (torch's constraint); summed in float32.
        out += torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16
        ).float()
    return out[:count]


def _fp8_shapes_ok(weight: torch.Tensor, start: tuple[int, int] = (0, 0)) -> bool:
    """`torch._scaled_mm` wants dims that are multiples of 16 (each piece too)."""
    rows, cols = weight.shape
    pieces = _column_pieces(cols, start[1])
    return rows % 16 == 0 and all((end - at) % 16 == 0 for at, end, _ in pieces)


class _Fp8Weights(torch.nn.Module):
    """A layer holding `weight` (float8_e4m3fn) and `weight_scale` (float32)."""

    def _apply(self, fn, recurse=True):
        # A model-wide `.to(dtype)` leaves the FP8 bytes and their scales as they are;
        # a move to another device takes them along.
        weight, scale = self.weight.data, self.weight_scale.data
        super()._apply(fn, recurse)
        if self.weight.dtype != FP8:
            self.weight.data = weight.to(self.weight.device)
            self.weight_scale.data = scale.to(self.weight.device)
        return self


class Fp8Linear(_Fp8Weights):
    """A linear layer whose weight is float8_e4m3fn with 128 x 128 block scales
    (`weight`, `weight_scale`: parameters, so weight sync fills them by name); the
    bias, if any, in bfloat16. FP8 matmul where the device has it, else the
    weight dequantized to bfloat16 for each call (module docstring). Split over a
    tensor-parallel group by `split_tensor_parallel`."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_blocks(linear.weight.detach())
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        bias = linear.bias
        self.bias = (
            None
            if bias is None
            else torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        )
        self.fp8_matmul = fp8_matmul_available(weight.device)
        self.start = (0, 0)
        """Where this proc's block of the weight starts in the matrix (split: its
        offset on the scales' grid)."""
        self.sums_over = None
        """Split by input features: the process group whose partial outputs add up."""

    def split_tensor_parallel(self, mesh, style: str) -> None:
        """Split over the 1-D device `mesh` as torch's `ColwiseParallel` and
        `RowwiseParallel` split an `nn.Linear` (local outputs): `colwise`, this
        proc's rows of the weight (and of the bias), the input whole and the output
        this proc's features; `rowwise`, this proc's columns, the input this proc's
        features and the output summed over the group (in float32), then the bias.
        The weight becomes a DTensor of the mesh, so a weight pull reads this
        proc's block and nothing more; the scales stay whole (a few bytes)."""
        dim = {"colwise": 0, "rowwise": 1}[style]
        weight, start = _shard(self.weight.data, mesh, dim)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.start = (start[0], start[1])
        if dim == 0 and self.bias is not None:
            self.bias = torch.nn.Parameter(_shard(self.bias.data, mesh, 0)[0], requires_grad=False)
        self.sums_over = mesh.get_group() if dim == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        weight, bias = _local(self.weight), _local(self.bias)
        if self.sums_over is not None:  # a partial sum: the bias once, after the sum
            bias = None
        if self.fp8_matmul and _fp8_shapes_ok(weight, self.start):
            out = _fp8_matmul(flat, weight, self.weight_scale, self.start)
            if bias is not None:
                out = out + bias
        else:
            weight = dequantize_blocks(weight, self.weight_scale, torch.bfloat16, self.start)
            out = torch.nn.functional.linear(flat, weight, bias)
        if self.sums_over is not None:
            import torch.distributed as dist

            out = out.float()
            dist.all_reduce(out, group=self.sums_over)
            if self.bias is not None:
                out = out + self.bias
        return out.to(torch.bfloat16).view(*shape[:-1], weight.size(0))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fp8_matmul = fp8_matmul_available(self.weight.device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local block (a split layer's), else the tensor."""
    from meshrl.weights.publisher import _is_dtensor

    return tensor.to_local() if tensor is not None and _is_dtensor(tensor) else tensor


def _shard(tensor: torch.Tensor, mesh, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`tensor` (whole on every proc of 1-D `mesh`) as a DTensor split on `dim`
    (DTensor's own chunks), each proc keeping its block, and where that starts.
    Cut locally: no collective (FP8 has none on gloo)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [Shard(dim)]
    shape, start = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    index = tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))
    local = tensor[index].contiguous()
    split = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
    return split, tuple(start)


class Fp8Embedding(_Fp8Weights):
    """An embedding table in float8_e4m3fn with 128 x 128 block scales (`weight`,
    `weight_scale`, as `Fp8Linear`'s): each looked-up row dequantized to bfloat16."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.padding_idx = embedding.padding_idx
        weight, scale = quantize_blocks(embedding.weight.detach())
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # (Indexing float8 is not implemented on every device: the bytes are.)
        rows = self.weight.view(torch.uint8)[ids].view(FP8).float()
        cols = torch.arange(self.embedding_dim, device=ids.device) // BLOCK
        scale = self.weight_scale[ids // BLOCK][..., cols]
        return (rows * scale).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fp8"


def to_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`model` (float32, as built) made a `precision` replica in place: fp32 as
    it is; bf16 cast; fp8 cast to bfloat16 with its `fp8_weight_names` layers
    replaced by `Fp8Linear`s (and an `Fp8Embedding`) holding their weights
    quantized. Returns it."""
    if precision != "fp8":
        return model.to(DTYPES[precision])
    names = fp8_weight_names(model)
    for name in names:  # quantized from the float32 weights, then the rest cast
        owner_name, _, attr = name[: -len(".weight")].rpartition(".")
        owner = model.get_submodule(owner_name)
        layer = getattr(owner, attr)
        kind = Fp8Embedding if isinstance(layer, torch.nn.Embedding) else Fp8Linear
        setattr(owner, attr, kind(layer))
    return model.to(torch.bfloat16)


def check_precisions(precision: str, precisions: Iterable[str], model_dtype: str) -> None:
    """One clear error (naming the key) for a trainer precision, or published
    precisions, that cannot be."""
    if precision not in TRAINER_PRECISIONS:
        raise ValueError(
            f"config key 'trainer.precision': '{precision}' is not one of "
            f"{', '.join(TRAINER_PRECISIONS)}"
        )
    if precision == "bf16-mixed" and model_dtype != "float32":
        raise ValueError(
            "config key 'trainer.precision': bf16-mixed keeps float32 master weights, "
            f"so model.dtype must be float32 (it is {model_dtype})"
        )
    for wire in precisions:
        if wire not in PRECISIONS:
            raise ValueError(
                f"config key 'policy.precision': '{wire}' is not one of {', '.join(PRECISIONS)}"
            )


def compute_precision(precision: str, device: torch.device):
    """The context a trainer's forward runs in: bf16-mixed autocasts matmuls to
    bfloat16 over float32 parameters (norms, softmax and the loss stay float32,
    autocast's lists); fp32 runs as it is."""
    import contextlib

    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
