"""Weight-only quantized linears in Triton: W8A16 (FP8 or int8 weights) and W4A16 (int4).

The weights stay in the layouts of quant_reference.py (W8: ``weight`` [N, K] with a
per-tensor, per-channel or block ``scale``; W4: ``packed`` [N, K // 2] uint8 with
group ``scales``/``zeros``); an act-order ``input_perm`` is applied by the caller.

Kernel design: one program per [BLOCK_M, BLOCK_N] output tile (programs ordered in
groups of GROUP_M row tiles so neighbouring programs share weight tiles in L2), walking
K, or one of its split-K ranges (quant_tiles.py), in BLOCK_K tiles and accumulating in
float32. The raw codes are widened to the
activation's dot dtype, where every FP8, int8 and small-integer code is exact, and the
scale is applied to the tile's float32 product, so the kernels compute the reference's
float32 product up to summation order:
- a scale constant along K (per tensor, per channel) multiplies the accumulator once;
- a scale constant within each K tile (blocks, groups that BLOCK_K divides) multiplies
  each tile's product;
- otherwise (a block or group size no power of two >= 16 divides) each weight element is
  dequantized in float32 before the dot, rounded to the dot dtype.
FP8 weights are read as FP8 on GPUs of capability 8.9+; elsewhere as bytes decoded from
their bits (e4m3_bits_to_float), since Triton takes FP8 tensors only on GPUs with FP8
support and W8A16 serves older ones too.
An asymmetric int8 weight's zero points (per tensor or output channel, with its scale)
are subtracted from the codes before the dot: code - zero lies in [-255, 255], exact in
every dot dtype.
W4 tiles are never unpacked in registers: the low nibbles (even columns) and the high
nibbles (odd columns) each meet the matching columns of x in their own dot.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, require_triton, tl, triton
from .quant_reference import W8_DTYPES
from .quant_tiles import dot_dtype, output_strides, plan_tiles, tile_k_for

# How a W8 scale meets the accumulator (a compile-time switch of the kernel).
SCALE_PER_ROW, SCALE_PER_TILE, SCALE_PER_ELEMENT = 0, 1, 2

if triton is not None:
    from .quant_tiles import split_k_range, store_output_tile, tile_coords

    @triton.jit
    def e4m3_bits_to_float(bits):
        """FP8 E4M3 codes (uint8) -> float32, from their bits: Triton accepts FP8 tensors only on
        GPUs with FP8 support (8.9+), and the W8A16 kernel runs on older ones too. The 7 bits
        below the sign, placed under float16's exponent, give the value / 2^8 exactly
        (subnormals included); the code 0x7F is nan, as in torch."""
        bits = bits.to(tl.int16)
        half_bits = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
        value = half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)

    @triton.jit
    def w8_product(x_rows, row_valid, w_cols, scale_rows, col_valid, k_start, k_end, K, stride_sk, scale_block_k,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr,
                   WEIGHT_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """[BM, BN] float32: x's rows times the W8 weight's rows over K in [k_start, k_end),
        scaled; x_rows [BM, 1] and w_cols [1, BN] point at the rows, scale_rows [BN] at
        each weight row's scale row."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < K
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BK, BN]
            if WEIGHT_FP8:  # FP8 codes as bytes
                w = e4m3_bits_to_float(w)
            if SCALE_MODE == 2:
                s = tl.load(scale_rows[None, :] + (ks // scale_block_k)[:, None] * stride_sk,
                            mask=k_valid[:, None] & col_valid[None, :], other=0.0)
                w = w.to(tl.float32) * s
            part = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
            if SCALE_MODE == 1:
                s = tl.load(scale_rows + (k0 // scale_block_k) * stride_sk, mask=col_valid, other=0.0)
                part = part * s[None, :]
            acc += part
        if SCALE_MODE == 0:
            acc = acc * tl.load(scale_rows, mask=col_valid, other=0.0)[None, :]
        return acc

    @triton.jit
    def w8_zero_product(x_rows, row_valid, w_cols, zero_rows, scale_rows, col_valid, k_start, k_end, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """w8_product for an asymmetric int8 weight (a scale per row): (code - zero) in
        each K tile's dot, the scale applied to the float32 sum once."""
        zero = tl.load(zero_rows, mask=col_valid, other=0.0)  # [BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < K
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            mask = k_valid[:, None] & col_valid[None, :]
            w = tl.load(w_cols + ks[:, None], mask=mask, other=0)  # [BK, BN]
            w = tl.where(mask, w.to(tl.float32) - zero[None, :], 0.0)
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
        return acc * tl.load(scale_rows, mask=col_valid, other=0.0)[None, :]

    @triton.jit
    def _w8_linear_kernel(
        x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K,
        stride_xm, stride_wn, stride_sn, stride_sk, stride_zn, stride_om, scale_block_n, scale_block_k, k_per_split,
        stride_split,
        SCALE_MODE: tl.constexpr, WEIGHT_FP8: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        # x: [M, K]; w: [N, K] int8, or FP8 E4M3 codes as uint8; scale: [N // bn, K // bk] (strides 0 where broadcast)
        rows, cols = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row_valid, col_valid = rows < M, cols < N
        k_start, k_end, out_ptr = split_k_range(K, k_per_split, out_ptr, stride_split)
        if HAS_ZERO:  # asymmetric int8: scale and zero point per tensor or row
            acc = w8_zero_product(x_ptr + rows.to(tl.int64)[:, None] * stride_xm, row_valid,
                                  w_ptr + cols.to(tl.int64)[None, :] * stride_wn, zero_ptr + cols * stride_zn,
                                  scale_ptr + cols * stride_sn, col_valid, k_start, k_end, K,
                                  BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, INPUT_PRECISION)
        else:
            acc = w8_product(x_ptr + rows.to(tl.int64)[:, None] * stride_xm, row_valid,
                             w_ptr + cols.to(tl.int64)[None, :] * stride_wn,
                             scale_ptr + (cols // scale_block_n) * stride_sn, col_valid, k_start, k_end, K,
                             stride_sk, scale_block_k, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_MODE, WEIGHT_FP8,
                             DOT_DTYPE, INPUT_PRECISION)
        store_output_tile(acc, rows, cols, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)

    @triton.jit
    def _w4_weight_halves(packed_cols, scale_cols, zero_cols, stride_sg, stride_zg, k0, ks_even, k_valid, col_valid,
                          group_size,
                          HAS_ZEROS: tl.constexpr, PER_ELEMENT: tl.constexpr):
        """The even-column and odd-column weights of one K tile, each [BLOCK_K // 2, BN] in
        float32: codes minus zero point, times the scale only when PER_ELEMENT."""
        mask = k_valid[:, None] & col_valid[None, :]
        codes = tl.load(packed_cols + (ks_even // 2)[:, None], mask=mask, other=0).to(tl.int32)
        low = (codes & 15).to(tl.float32)
        high = (codes >> 4).to(tl.float32)
        if PER_ELEMENT:  # even and odd columns may fall in different groups
            groups_even = (ks_even // group_size)[:, None]
            groups_odd = ((ks_even + 1) // group_size)[:, None]
            if HAS_ZEROS:
                low -= tl.load(zero_cols + groups_even * stride_zg, mask=mask, other=0.0)
                high -= tl.load(zero_cols + groups_odd * stride_zg, mask=mask, other=0.0)
            else:
                low, high = low - 8.0, high - 8.0
            low *= tl.load(scale_cols + groups_even * stride_sg, mask=mask, other=0.0)
            high *= tl.load(scale_cols + groups_odd * stride_sg, mask=mask, other=0.0)
        else:  # the whole tile lies in group k0 // group_size
            if HAS_ZEROS:
                zero = tl.load(zero_cols + (k0 // group_size) * stride_zg, mask=col_valid[None, :], other=0.0)
                low, high = low - zero, high - zero
            else:
                low, high = low - 8.0, high - 8.0
        return low, high

    @triton.jit
    def _w4_linear_kernel(
        x_ptr, packed_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, group_size,
        stride_xm, stride_pn, stride_sn, stride_sg, stride_zn, stride_zg, stride_om, k_per_split, stride_split,
        HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PER_ELEMENT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        # x: [M, K]; packed: [N, K // 2] uint8; scales, zeros: [N, ceil(K / group_size)]
        rows, cols = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row_valid, col_valid = rows < M, cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        packed_cols = packed_ptr + cols.to(tl.int64)[None, :] * stride_pn
        scale_cols = scales_ptr + cols[None, :] * stride_sn
        zero_cols = zeros_ptr + cols[None, :] * stride_zn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start, k_end, out_ptr = split_k_range(K, k_per_split, out_ptr, stride_split)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            k_valid = ks_even < K  # K is even: the odd column is valid with its even one
            x_mask = row_valid[:, None] & k_valid[None, :]
            x_even = tl.load(x_rows + ks_even[None, :], mask=x_mask, other=0.0).to(DOT_DTYPE)
            x_odd = tl.load(x_rows + ks_even[None, :] + 1, mask=x_mask, other=0.0).to(DOT_DTYPE)
            low, high = _w4_weight_halves(packed_cols, scale_cols, zero_cols, stride_sg, stride_zg, k0, ks_even,
                                          k_valid, col_valid, group_size, HAS_ZEROS, PER_ELEMENT)
            part = tl.dot(x_even, low.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
            part = tl.dot(x_odd, high.to(DOT_DTYPE), acc=part, input_precision=INPUT_PRECISION)
            if not PER_ELEMENT:
                part = part * tl.load(scale_cols + (k0 // group_size) * stride_sg, mask=col_valid[None, :], other=0.0)
            acc += part
        store_output_tile(acc, rows, cols, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)


def _as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] as a 2-D [M, K] view (a copy only when the rows are not strided)."""
    check_kernel_dtype("x", x)
    assert x.shape[-1] == in_features, f"x has {x.shape[-1]} features, the weight {in_features}"
    rows = x.reshape(-1, in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_bias(bias: torch.Tensor | None, out_features: int, device: torch.device) -> None:
    if bias is not None:
        assert bias.shape == (out_features,) and bias.is_contiguous(), (
            f"bias {tuple(bias.shape)} must be contiguous [{out_features}]")
        assert bias.device == device, f"bias on {bias.device}, x on {device}"


def _w8_scale_layout(weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(stride_sn, stride_sk, block_n, block_k) of a W8 scale, asserting its shape."""
    out_features, in_features = weight.shape
    assert scale.dtype == torch.float32 and scale.dim() == 2, f"scale {scale.dtype} {tuple(scale.shape)}"
    if block is None:
        assert scale.shape in ((1, 1), (out_features, 1)), (
            f"scale {tuple(scale.shape)} is neither per tensor [1, 1] nor per channel [{out_features}, 1]")
        per_tensor = scale.shape[0] == 1
        return 0 if per_tensor else scale.stride(0), 0, 1, in_features
    block_n, block_k = block
    assert block_n >= 1 and block_k >= 1, f"block {block}"
    expected = (-(-out_features // block_n), -(-in_features // block_k))
    assert tuple(scale.shape) == expected, f"block {block} scale {tuple(scale.shape)}, expected {expected}"
    return scale.stride(0), scale.stride(1), block_n, block_k


def reads_fp8_natively(device: torch.device) -> bool:
    """Whether the W8 kernels take FP8 weights as FP8 tensors (converted by the hardware):
    on CUDA GPUs of capability 8.9+, the only ones where Triton accepts FP8 tensors.
    Elsewhere, the CPU interpreter included, they read the bytes and decode the bits."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def weight_operand(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A W8 weight as the kernels read it, and WEIGHT_FP8: True when it is FP8 codes as bytes."""
    if weight.dtype != torch.float8_e4m3fn or reads_fp8_natively(weight.device):
        return weight, False
    return weight.view(torch.uint8), True


def w8_scale_mode(stride_sk: int, block_k: int, in_features: int) -> tuple[int, int]:
    """(SCALE_MODE, BLOCK_K) for a W8 scale: once per row when constant along K (stride 0),
    per K tile when a power-of-two tile divides the block, else per element."""
    if stride_sk == 0:
        return SCALE_PER_ROW, 128 if in_features >= 128 else 64
    tile = tile_k_for(block_k)
    return (SCALE_PER_TILE, tile) if tile else (SCALE_PER_ELEMENT, 64)


def triton_w8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] | None, bias: torch.Tensor | None, *,
                     split_k: int | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_w8(weight, scale, block, zero).T + bias, as
    quant_reference.quantized_linear_reference; returns [..., N] in x's dtype.
    ``split_k``: K ranges summed after the kernel (None: chosen for the device).
    ``zero``: an asymmetric int8 weight's zero points, float32 of the scale's shape."""
    # x: [..., K] float16/bfloat16/float32; weight: [N, K] fp8 e4m3 or int8; scale: float32
    require_triton()
    assert weight.dtype in W8_DTYPES and weight.dim() == 2, f"weight {weight.dtype} {tuple(weight.shape)}"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    out_features, in_features = weight.shape
    rows = _as_rows(x, in_features)
    stride_sn, stride_sk, block_n, block_k = _w8_scale_layout(weight, scale, block)
    _check_bias(bias, out_features, x.device)
    assert weight.device == scale.device == x.device, f"devices {weight.device}, {scale.device}, {x.device}"
    if zero is not None:
        assert block is None and weight.dtype == torch.int8, f"zero points with block {block}, weight {weight.dtype}"
        assert zero.dtype == torch.float32 and zero.shape == scale.shape and zero.device == x.device, (
            f"zero {zero.dtype} {tuple(zero.shape)} on {zero.device}, scale {tuple(scale.shape)}")
    num_rows = rows.shape[0]
    if num_rows == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    mode, block_k_tile = w8_scale_mode(stride_sk, block_k, in_features)
    plan = plan_tiles(num_rows, out_features, in_features, block_k_tile, x.device, split_k)
    out = plan.output(num_rows, out_features, x)
    stride_om, stride_split = output_strides(out)
    weight, weight_fp8 = weight_operand(weight)
    launcher(_w8_linear_kernel, plan.grid(num_rows, out_features))(
        rows, weight, scale, zero if zero is not None else scale, bias if bias is not None else scale, out,
        num_rows, out_features, in_features, rows.stride(0), weight.stride(0), stride_sn, stride_sk,
        0 if zero is None or zero.shape[0] == 1 else zero.stride(0), stride_om, block_n, block_k, plan.k_per_split,
        stride_split,
        SCALE_MODE=mode, WEIGHT_FP8=weight_fp8, HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None and plan.split_k == 1,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=block_k_tile, GROUP_M=8,
        DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
    return plan.finish(out, bias, x.dtype).reshape(*x.shape[:-1], out_features)


def _check_w4_layout(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int) -> None:
    assert packed.dtype == torch.uint8 and packed.dim() == 2 and packed.stride(1) == 1, (
        f"packed must be [N, K // 2] uint8 with contiguous rows, got {packed.dtype} {tuple(packed.shape)}")
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    assert group_size >= 2 and group_size % 2 == 0, f"group_size {group_size} must be even"
    expected = (out_features, -(-in_features // group_size))
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor is not None:
            assert tensor.dtype == torch.float32 and tuple(tensor.shape) == expected, (
                f"{name} {tensor.dtype} {tuple(tensor.shape)}, expected float32 {expected}")
            assert tensor.device == packed.device, f"{name} on {tensor.device}, packed on {packed.device}"


def triton_w4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int, bias: torch.Tensor | None, *, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_w4(packed, scales, zeros, group_size).T + bias, with x's
    columns already in the weight's stored order; returns [..., N] in x's dtype.
    ``split_k`` as triton_w8_linear's."""
    # x: [..., K]; packed: [N, K // 2] uint8; scales, zeros: [N, ceil(K / group_size)] float32
    require_triton()
    _check_w4_layout(packed, scales, zeros, group_size)
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    rows = _as_rows(x, in_features)
    _check_bias(bias, out_features, x.device)
    assert packed.device == x.device, f"packed on {packed.device}, x on {x.device}"
    num_rows = rows.shape[0]
    if num_rows == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    tile = tile_k_for(group_size, smallest=32)  # each half of a tile feeds a dot of K >= 16
    plan = plan_tiles(num_rows, out_features, in_features, tile or 64, x.device, split_k)
    out = plan.output(num_rows, out_features, x)
    stride_om, stride_split = output_strides(out)
    launcher(_w4_linear_kernel, plan.grid(num_rows, out_features))(
        rows, packed, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        out, num_rows, out_features, in_features, group_size,
        rows.stride(0), packed.stride(0), scales.stride(0), scales.stride(1),
        *(zeros.stride() if zeros is not None else (0, 0)), stride_om, plan.k_per_split, stride_split,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None and plan.split_k == 1, PER_ELEMENT=tile is None,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8,
        DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
    return plan.finish(out, bias, x.dtype).reshape(*x.shape[:-1], out_features)
