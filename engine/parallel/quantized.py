"""A quantized linear's share on one tensor-parallel rank, split with its scales.

The layouts are engine/kernels/quant_reference.py's W8 and W4 (a QuantizedLinear,
engine/quantization/linear.py). A rank's share is again a QuantizedLinear in the same
layout, so every kernel runs it as it runs the whole layer:
- Column-wise (output rows): W8's weight rows with their per-channel scale rows, or
  the block-scale rows of the blocks they lie in (a share must start and end on a
  block boundary, the last block of the weight possibly partial); W4's packed rows
  with their scale and zero-point rows. An act-order ``input_perm`` reorders the
  input, which every rank holds whole, so it stays as it is.
- Row-wise (input columns): the columns of the rank's share of the input with the
  scale columns of their groups or blocks (a share must start and end on a group or
  block boundary; a W8 layer of one group per row keeps it, as a per-channel scale);
  the partial products summed over ranks, then the bias added once.
  An act-order layer stores its columns by group; its share of stored groups must
  read exactly the rank's input columns, else the groups mix the ranks' inputs and
  the split is refused. An asymmetric int8 layer's zero points (per tensor, channel or
  group) are cut as its scale is, by output rows and by groups of input columns. A W8A8
  layer's row share quantizes its columns of each token's input with the whole row's
  scale (the max over ranks of each rank's max|x|).

Invariants:
- A rank's share dequantizes to exactly the rows (or columns) of the whole layer's
  dequantized weight that the float split takes; no scale is recomputed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quantization.activations import InputQuantization, fake_quantize_with_scales, scales_from_absmax
from ..quantization.linear import QuantizedLinear
from .group import RankGroup, ShardingError


def row_ranges(rows: slice | torch.Tensor, out_features: int) -> list[tuple[int, int]]:
    """The output rows a column split keeps (a slice, or the concatenated ranges of a
    packed projection) as [start, end) ranges."""
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(out_features)
        return [(start, stop)]
    values = rows.tolist()
    breaks = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1] + 1] + [len(values)]
    return [(values[first], values[last - 1] + 1) for first, last in zip(breaks, breaks[1:])]


def split_quantized(layer: QuantizedLinear, name: str, column_rows: slice | torch.Tensor | None,
                    group: RankGroup) -> nn.Module:
    """This rank's share of ``layer``: its ``column_rows`` (a column split), or with
    ``column_rows`` None its share of the input columns (a row split, the output summed
    over ranks). ShardingError, naming the layer, where the share cuts a block or group."""
    if column_rows is not None:
        return column_quantized(layer, name, row_ranges(column_rows, layer.out_features))
    if layer.in_features % group.size:
        raise ShardingError(f"{name}: {layer.in_features} input features do not split over {group.size} ranks")
    share = layer.in_features // group.size
    return RowParallelQuantized(row_quantized(layer, name, group.rank * share, (group.rank + 1) * share), layer.bias,
                                group)


def _check_boundary(name: str, what: str, size: int, start: int, end: int, total: int) -> None:
    """A share [start, end) of ``total`` must start on a multiple of ``size`` and end on
    one or at ``total`` (a partial last block)."""
    if start % size or (end % size and end != total):
        raise ShardingError(f"{name}: a rank's share [{start}, {end}) of its {total} {what} does not fall on "
                            f"the boundaries of its blocks of {size}; it is not split over these ranks")


def column_quantized(layer: QuantizedLinear, name: str, ranges: list[tuple[int, int]]) -> QuantizedLinear:
    """The QuantizedLinear holding output rows ``ranges`` of ``layer``."""
    index = torch.cat([torch.arange(start, end) for start, end in ranges])
    bias = None if layer.bias is None else layer.bias[index.to(layer.bias.device)].contiguous()
    if layer.layout == "w4":
        assert layer.packed is not None and layer.scales is not None
        device = layer.packed.device
        zeros = None if layer.zeros is None else layer.zeros[index.to(device)]
        part = QuantizedLinear.w4(layer.packed[index.to(device)], layer.scales[index.to(device)], zeros,
                                  layer.group_size, layer.input_perm, bias)
    else:
        assert layer.weight is not None and layer.scale is not None
        device = layer.weight.device
        if layer.block is not None:
            for start, end in ranges:
                _check_boundary(name, "output rows", layer.block[0], start, end, layer.out_features)
        scale = _scale_rows(layer, layer.scale, ranges, index)
        zero = None if layer.zero is None else _scale_rows(layer, layer.zero, ranges, index)
        part = QuantizedLinear.w8(layer.weight[index.to(device)], scale, layer.block, bias, layer.input_perm, zero)
    return _like(part, layer)


def _scale_rows(layer: QuantizedLinear, values: torch.Tensor, ranges: list[tuple[int, int]],
                index: torch.Tensor) -> torch.Tensor:
    """The rows of a W8 layer's ``values`` of its scale's shape (the scale, or its zero
    points) that hold output rows ``ranges`` (``index``): the row blocks they lie in,
    their own rows per channel, or the one value per tensor."""
    if layer.block is not None:
        block_rows = layer.block[0]
        return torch.cat([values[start // block_rows: -(-end // block_rows)] for start, end in ranges])
    if values.shape[0] > 1:  # per output channel
        return values[index.to(values.device)]
    return values


def row_quantized(layer: QuantizedLinear, name: str, start: int, end: int) -> QuantizedLinear:
    """The QuantizedLinear (no bias) holding input columns [start, end) of ``layer``:
    the stored columns of the same groups, its act-order permutation made local."""
    perm = None
    if layer.input_perm is not None:
        stored = layer.input_perm[start:end]
        if not bool(((stored >= start) & (stored < end)).all()):
            raise ShardingError(f"{name}: its act-order (g_idx) groups mix input columns of different ranks' "
                                f"shares of {layer.in_features}; it is not split row-wise over these ranks")
        perm = (stored - start).contiguous()
    if layer.layout == "w4":
        assert layer.packed is not None and layer.scales is not None
        group_size = layer.group_size
        if start % 2 or end % 2:
            raise ShardingError(f"{name}: a rank's share [{start}, {end}) of its {layer.in_features} input columns "
                                "cuts a byte of two packed 4-bit codes; it is not split over these ranks")
        if group_size == layer.in_features:  # one group per row: each share keeps its scale
            groups, local_group_size = slice(0, 1), end - start
        else:
            _check_boundary(name, "input columns (groups)", group_size, start, end, layer.in_features)
            groups, local_group_size = slice(start // group_size, end // group_size), group_size
        zeros = None if layer.zeros is None else layer.zeros[:, groups]
        part = QuantizedLinear.w4(layer.packed[:, start // 2: end // 2], layer.scales[:, groups], zeros,
                                  local_group_size, perm)
    else:
        assert layer.weight is not None and layer.scale is not None
        scale, zero, block = layer.scale, layer.zero, layer.block
        if block is not None and block[0] == 1 and block[1] >= layer.in_features:
            block = None  # one group per row: the share keeps it, a scale (and zero point) per channel
        elif block is not None:  # the scale's (and zero points') columns of the blocks or groups cut
            block_cols = block[1]
            _check_boundary(name, "input columns", block_cols, start, end, layer.in_features)
            scale = layer.scale[:, start // block_cols: -(-end // block_cols)]
            zero = None if zero is None else zero[:, start // block_cols: -(-end // block_cols)]
        part = QuantizedLinear.w8(layer.weight[:, start:end], scale, block, None, perm, zero)
    return _like(part, layer)


def _like(part: QuantizedLinear, layer: QuantizedLinear) -> QuantizedLinear:
    """``part`` with ``layer``'s kernel settings and input quantization."""
    part.activations, part.cpu_kernels = layer.activations, layer.cpu_kernels
    part.input_quantization, part.int8_kernel = layer.input_quantization, layer.int8_kernel
    part.digit_tiles = layer.digit_tiles
    part.use_reference = layer.use_reference
    return part


class RowParallelQuantized(nn.Module):
    """A QuantizedLinear split along its input: this rank's columns, the partial
    products summed over ranks, then the bias added once.

    A W8A8 layer (``input_quantization`` int8 or fp8) quantizes each token's whole input
    row with one scale from the row's max|x|: each rank takes the max of its columns,
    the max over ranks is the whole row's, so every rank quantizes its columns with the
    whole layer's scale into the whole layer's codes for them. That runs as a forward
    pre-hook of the inner share (its own input quantization off), so whatever wraps the
    inner share (a LoRA layer, whose adapter takes x unquantized) sees it as the whole
    layer's quantized linear."""

    bias: torch.Tensor | None

    def __init__(self, linear: QuantizedLinear, bias: torch.Tensor | None, group: RankGroup) -> None:
        super().__init__()
        self.input_quantization: InputQuantization = linear.input_quantization
        linear.input_quantization, linear.activations = "none", "none"
        if self.input_quantization != "none":
            linear.register_forward_pre_hook(self._quantize_input)
        self.linear = linear
        self.register_buffer("bias", bias)
        self.group = group
        self.in_features, self.out_features = linear.in_features * group.size, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features / size], this rank's share of the input features.
        out = self.group.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias

    def _quantize_input(self, _: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (self.quantize_share(args[0]), *args[1:])

    def quantize_share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of x [..., K / size] quantized per token with the whole
        row's scale and multiplied back (x's dtype)."""
        # Each rank's per-token max gathered in float64 (exact for every float dtype).
        amax = self.group.all_gather(x.abs().amax(dim=-1, keepdim=True).double())  # [..., size]
        whole = amax.amax(dim=-1, keepdim=True).to(x.dtype)
        return fake_quantize_with_scales(x, scales_from_absmax(whole, self.input_quantization),
                                         self.input_quantization)
