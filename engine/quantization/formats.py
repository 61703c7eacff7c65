"""A checkpoint's quantized linear, read in its on-disk layout and converted to the
engine's W8 or W4 layout (engine/kernels/quant_reference.py) as a QuantizedLinear.

On-disk layouts read (each tensor named ``<module>.<name>``):
- "w8" (quant_method fp8; compressed-tensors float- and int-quantized): ``weight``
  [N, K] float8_e4m3fn or int8, ``weight_scale_inv`` or ``weight_scale`` per tensor,
  per output channel or per block (compressed-tensors int8 groups: [N, K / g], blocks of
  one row by g); both are multiplied (w = q * scale). Asymmetric
  int8 (compressed-tensors ``symmetric: false``) adds ``weight_zero_point`` int8 of the
  scale's shape (per tensor, output channel or group): w = (q - zero_point) * scale.
- "packed" (compressed-tensors pack-quantized): ``weight_packed`` int32 [N, K / 8],
  eight signed 4-bit values offset by 8, low bits first (8-bit: [N, K / 4], four
  values offset by 128); ``weight_scale`` [N, K / g] (per channel: [N, 1]);
  ``weight_zero_point`` int32 [N / 8, K / g] (8-bit: [N / 4, K / g]) packed the same
  way along the output channels when asymmetric; ``weight_g_idx`` [K] with group
  act-order; ``weight_shape`` [N, K]. 4-bit becomes W4, 8-bit W8 int8 (blocks of one
  row by a group, zero points of the scale's shape).
- "gptq": ``qweight`` int32 [K / 8, N] packed along the input columns, ``qzeros``
  int32 [K / g, N / 8] along the output channels (stored one less than the zero point
  in checkpoint_format "gptq", v1), ``scales`` [K / g, N], ``g_idx`` [K]; 8-bit GPTQ
  packs four codes to a word and, symmetric (zero point 128), becomes W8 int8 with
  blocks of one row by a group.
- "awq" (gemm): ``qweight`` int32 [K, N / 8] and ``qzeros`` [K / g, N / 8], both
  packed along the output channels in AWQ's interleaved nibble order, ``scales`` [K / g, N].
Each problem is one QuantizedCheckpointError naming the tensor and what is wrong.
"""

from __future__ import annotations

import torch

from ..kernels.quant_reference import W8_DTYPES
from .checkpoint import CheckpointTensors, QuantizedCheckpointError
from .linear import QuantizedLinear
from .scheme import QuantScheme

# The tensor whose presence marks a module as stored quantized, by on-disk layout.
QUANTIZED_MARKERS = {"packed": "weight_packed", "gptq": "qweight", "awq": "qweight"}
# AWQ packs output column j of each eight into nibble AWQ_NIBBLE[j].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def stored_quantized(tensors: CheckpointTensors, module: str, scheme: QuantScheme) -> bool:
    """Whether the checkpoint stores linear ``module`` quantized in ``scheme``'s layout."""
    if scheme.layout == "w8":
        weight = f"{module}.weight"
        return (weight in tensors and tensors.dtype(weight) in W8_DTYPES) or any(
            f"{module}.{name}" in tensors for name in scheme.scale_names)
    marker = QUANTIZED_MARKERS.get(scheme.layout)
    # A packed linear's scale marks it too, so one whose codes are missing is named.
    return marker is not None and (f"{module}.{marker}" in tensors
                                   or (scheme.layout == "packed" and f"{module}.weight_scale" in tensors))


def read_quantized_linear(tensors: CheckpointTensors, module: str, scheme: QuantScheme,
                          shape: tuple[int, int], bias_dtype: torch.dtype) -> QuantizedLinear:
    """The QuantizedLinear of linear ``module`` ([N, K] = ``shape``) from the checkpoint."""
    bias_name = f"{module}.bias"
    bias = tensors.get(bias_name).to(bias_dtype) if bias_name in tensors else None
    readers = {"w8": _read_w8, "packed": _read_packed, "gptq": _read_gptq, "awq": _read_awq}
    layer = readers[scheme.layout](tensors, module, scheme, shape, bias)
    layer.activations, layer.input_quantization = scheme.activations, scheme.input_quantization
    return layer


def _check(condition: bool, name: str, problem: str) -> None:
    if not condition:
        raise QuantizedCheckpointError(f"{name}: {problem}")


def _scale(tensors: CheckpointTensors, name: str, what: str) -> torch.Tensor:
    """A float scale tensor, as float32; refused when stored as another dtype."""
    dtype = tensors.dtype(name, what)
    _check(dtype in _FLOAT_DTYPES, name, f"scale stored as {dtype}, expected a float dtype "
           "(float32, bfloat16 or float16)")
    return tensors.get(name).float()


def _read_w8(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
             bias: torch.Tensor | None) -> QuantizedLinear:
    weight_name = f"{module}.weight"
    expected = torch.float8_e4m3fn if scheme.weights == "fp8" else torch.int8
    dtype = tensors.dtype(weight_name, "the quantized weight")
    _check(dtype == expected, weight_name, f"stored as {dtype}, the scheme {scheme.description} stores {expected}")
    stored = tensors.shape(weight_name)
    _check(stored == shape, weight_name, f"shape {list(stored)} where the model's linear is {list(shape)}")
    scale_name = next((f"{module}.{name}" for name in scheme.scale_names if f"{module}.{name}" in tensors), None)
    _check(scale_name is not None, weight_name,
           f"quantized weight has no scale tensor ({' or '.join(f'{module}.{n}' for n in scheme.scale_names)} missing)")
    assert scale_name is not None
    scale = _scale(tensors, scale_name, "the weight's scale")
    scale, block = _w8_scale(scale, scale_name, scheme, shape)
    zero = None if scheme.symmetric else _w8_zero_point(tensors, f"{module}.weight_zero_point", scale)
    return QuantizedLinear.w8(tensors.get(weight_name), scale, block, bias, zero=zero)


def _w8_zero_point(tensors: CheckpointTensors, name: str, scale: torch.Tensor) -> torch.Tensor:
    """An asymmetric int8 weight's zero points (int8, one per tensor, output channel or
    group, as its scale) in the scale's shape."""
    dtype = tensors.dtype(name, "the asymmetric weight's zero points")
    _check(dtype == torch.int8, name, f"zero points stored as {dtype}, asymmetric int8 stores int8")
    zero = tensors.get(name)
    _check(zero.numel() == scale.numel(), name,
           f"shape {list(zero.shape)} where the weight's scale has {scale.numel()} values (one zero point each)")
    return zero.reshape(scale.shape)


def _w8_scale(scale: torch.Tensor, name: str, scheme: QuantScheme,
              shape: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """A W8 scale reshaped to its layout ([1, 1], [N, 1] or per block) and the block."""
    rows, cols = shape
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        groups = cols // scheme.group_size
        _check(cols % scheme.group_size == 0, name, f"group_size {scheme.group_size} does not divide the weight's "
               f"{cols} input columns {list(shape)}")
        _check(tuple(scale.shape) == (rows, groups), name, f"shape {list(scale.shape)} where groups of "
               f"{scheme.group_size} over the weight {list(shape)} need [{rows}, {groups}]")
        return scale, scheme.block
    if scheme.strategy == "block":
        assert scheme.block is not None
        block_rows, block_cols = scheme.block
        expected = (-(-rows // block_rows), -(-cols // block_cols))
        _check(tuple(scale.shape) == expected, name,
               f"block size {list(scheme.block)} does not match the weight {list(shape)}: its scale is "
               f"{list(scale.shape)}, blocks of {list(scheme.block)} need {list(expected)}")
        return scale, scheme.block
    if scale.numel() == 1 and scheme.strategy in (None, "tensor"):
        return scale.reshape(1, 1), None
    _check(scale.numel() == rows and scheme.strategy in (None, "channel") and scale.dim() <= 2, name,
           f"scale of shape {list(scale.shape)} is neither per tensor nor per output channel ({rows}) of the "
           f"weight {list(shape)}")
    return scale.reshape(rows, 1), None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> W4's [N, K // 2] uint8 (column 2j low nibble, 2j + 1 high)."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8)),
                  bits: int = 4) -> torch.Tensor:
    """int32 words of 32 / ``bits`` codes -> the codes (uint8), that many per word along
    ``dim``; element j of each word is in field ``order[j]`` (``bits`` wide, low first).
    One field at a time, so the temporaries stay the packed tensor's size."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    rows, cols = packed.shape
    if dim == 0:
        codes = torch.empty(rows, per_word, cols, dtype=torch.uint8, device=packed.device)
        for element, field in enumerate(order[:per_word]):
            codes[:, element] = (packed >> (bits * field)) & mask
        return codes.reshape(rows * per_word, cols)
    codes = torch.empty(rows, cols, per_word, dtype=torch.uint8, device=packed.device)
    for element, field in enumerate(order[:per_word]):
        codes[:, :, element] = (packed >> (bits * field)) & mask
    return codes.reshape(rows, cols * per_word)


def _group_size(scheme: QuantScheme, cols: int, name: str) -> int:
    group_size = scheme.group_size or cols
    _check(cols % group_size == 0, name, f"group_size {group_size} does not divide the input width {cols}")
    return group_size


def _act_order(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """The input permutation that sorts act-order columns by group (None when they are
    already in group order); each group must hold group_size columns."""
    g_idx = g_idx.long()
    cols = g_idx.numel()
    if torch.equal(g_idx, torch.arange(cols, device=g_idx.device) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=cols // group_size)
    _check(counts.numel() == cols // group_size and bool((counts == group_size).all()), name,
           f"act-order g_idx does not put {group_size} columns in each of {cols // group_size} groups")
    return torch.sort(g_idx, stable=True).indices


def _w4_linear(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
               g_idx: torch.Tensor | None, g_idx_name: str, bias: torch.Tensor | None) -> QuantizedLinear:
    """The W4 linear of [N, K] codes, [N, K / g] scales and zeros, in act-order when g_idx
    says so. Zero points that are all 8 (a symmetric GPTQ checkpoint stores them) are
    dropped: the W4 layout's None means 8, and the kernels then need no zero-point term."""
    perm = None if g_idx is None else _act_order(g_idx, group_size, g_idx_name)
    if perm is not None:
        codes = codes[:, perm]
    if zeros is not None and bool((zeros == 8).all()):
        zeros = None
    return QuantizedLinear.w4(pack_int4(codes), scales, zeros, group_size, perm, bias)


def _read_packed(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
                 bias: torch.Tensor | None) -> QuantizedLinear:
    rows, cols = shape
    bits = 8 if scheme.weights == "int8" else 4
    per_word = 32 // bits
    packed_name, scale_name = f"{module}.weight_packed", f"{module}.weight_scale"
    packed = _packed_tensor(tensors, packed_name, (rows, -(-cols // per_word)), bits)
    group_size = _group_size(scheme, cols, scale_name)
    scales = _scale(tensors, scale_name, "the weight's group scales")
    _check(tuple(scales.shape) == (rows, cols // group_size), scale_name,
           f"shape {list(scales.shape)} where groups of {group_size} need [{rows}, {cols // group_size}]")
    codes = _unpack_int32(packed, dim=1, bits=bits)[:, :cols]
    zeros = None
    if not scheme.symmetric:
        zero_name = f"{module}.weight_zero_point"
        words = _packed_tensor(tensors, zero_name, (-(-rows // per_word), scales.shape[1]), bits,
                               "the asymmetric weight's zero points")
        zeros = _unpack_int32(words, dim=0, bits=bits)[:rows]
    g_idx_name = f"{module}.weight_g_idx"
    g_idx = tensors.get(g_idx_name) if g_idx_name in tensors else None
    if bits == 4:
        return _w4_linear(codes, scales, None if zeros is None else zeros.float(), group_size, g_idx, g_idx_name,
                          bias)
    # 8-bit codes and zero points are stored offset by 128: as int8, W8 per channel or by group.
    perm = None if g_idx is None else _act_order(g_idx, group_size, g_idx_name)
    if perm is not None:
        codes = codes[:, perm]
    zero = None if zeros is None else _signed_bytes(zeros)
    return QuantizedLinear.w8(_signed_bytes(codes), scales, scheme.block, bias, perm, zero=zero)


def _signed_bytes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes stored offset by 128 as the int8 values they stand for."""
    return (codes.to(torch.int16) - 128).to(torch.int8)


def check_weight_shape(tensors: CheckpointTensors, module: str, shape: tuple[int, int]) -> None:
    """A pack-quantized linear's ``weight_shape`` (where stored) names the model's [N, K]
    (a packed width only bounds K); read before any tensor-parallel cut."""
    name = f"{module}.weight_shape"
    if name not in tensors:
        return
    stored = tensors.get(name)
    _check(not stored.is_floating_point() and stored.numel() == 2 and stored.flatten().tolist() == list(shape), name,
           f"holds {stored.flatten().tolist()} where the model's linear is {list(shape)}")


def _read_gptq(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
               bias: torch.Tensor | None) -> QuantizedLinear:
    rows, cols = shape
    bits = 8 if scheme.weights == "int8" else 4
    per_word = 32 // bits
    group_size = _group_size(scheme, cols, f"{module}.scales")
    groups = cols // group_size
    qweight = _packed_tensor(tensors, f"{module}.qweight", (cols // per_word, rows), bits)
    qzeros = _packed_tensor(tensors, f"{module}.qzeros", (groups, -(-rows // per_word)), bits)
    scales = _scale(tensors, f"{module}.scales", "the weight's group scales")
    _check(tuple(scales.shape) == (groups, rows), f"{module}.scales",
           f"shape {list(scales.shape)} where groups of {group_size} need [{groups}, {rows}]")
    codes = _unpack_int32(qweight, dim=0, bits=bits).t()  # [N, K]
    mask = (1 << bits) - 1
    zeros = ((_unpack_int32(qzeros, dim=1, bits=bits)[:, :rows] + scheme.zero_offset) & mask).t()
    g_idx_name = f"{module}.g_idx"
    g_idx = tensors.get(g_idx_name) if g_idx_name in tensors else None
    if bits == 4:
        return _w4_linear(codes, scales.t(), zeros.float(), group_size, g_idx, g_idx_name, bias)
    # 8-bit GPTQ as W8 int8 with blocks of one row by group_size columns: symmetric only.
    _check(bool((zeros == 128).all()), f"{module}.qzeros", "8-bit zero points other than 128 (asymmetric), "
           "which the int8 layout (no zero point) cannot hold")
    perm = None if g_idx is None else _act_order(g_idx, group_size, g_idx_name)
    if perm is not None:
        codes = codes[:, perm]
    return QuantizedLinear.w8((codes.to(torch.int16) - 128).to(torch.int8), scales.t(), (1, group_size), bias, perm)


def _read_awq(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
              bias: torch.Tensor | None) -> QuantizedLinear:
    rows, cols = shape
    group_size = _group_size(scheme, cols, f"{module}.scales")
    groups = cols // group_size
    qweight = _packed_tensor(tensors, f"{module}.qweight", (cols, rows // 8))
    qzeros = _packed_tensor(tensors, f"{module}.qzeros", (groups, rows // 8))
    scales = _scale(tensors, f"{module}.scales", "the weight's group scales")
    _check(tuple(scales.shape) == (groups, rows), f"{module}.scales",
           f"shape {list(scales.shape)} where groups of {group_size} need [{groups}, {rows}]")
    codes = _unpack_int32(qweight, dim=1, order=AWQ_NIBBLE).t()
    zeros = _unpack_int32(qzeros, dim=1, order=AWQ_NIBBLE).t().float()
    return _w4_linear(codes, scales.t(), zeros, group_size, None, "", bias)


def _packed_tensor(tensors: CheckpointTensors, name: str, shape: tuple[int, int], bits: int = 4,
                   what: str = "") -> torch.Tensor:
    """An int32 tensor of packed ``bits``-bit codes, checked for its dtype and shape."""
    dtype = tensors.dtype(name, what or f"packed {bits}-bit codes")
    _check(dtype == torch.int32, name, f"stored as {dtype}, expected int32 words of {32 // bits} {bits}-bit codes")
    stored = tensors.shape(name)
    _check(stored == shape, name, f"shape {list(stored)} where the model's linear needs {list(shape)}")
    return tensors.get(name)
