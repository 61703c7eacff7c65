"""FP8 W8A8 linear: activations quantized to FP8 per token at run time, FP8 x FP8 tl.dot.

The weight is a W8 layout of quant_reference.py in torch.float8_e4m3fn with a per-tensor,
per-channel or block scale. Each activation row is quantized dynamically, as vLLM does
on Hopper: per token (one scale per row) for per-tensor and per-channel weights, per
token and K block (one scale per row and weight block column) for block weights, so a
tile's product is scaled by one activation and one weight scale per row and column.

Two launches: _quantize_rows_kernel writes the FP8 rows and their float32 scales
(scale = max(amax / 448, MIN_SCALE); q = x / scale rounded to nearest even on the E4M3
grid, which the kernel computes itself, so the cast to FP8 is exact on every backend);
_fp8_gemm_kernel multiplies FP8 tiles on the tensor cores with float32 accumulation.
FP8 tensor cores need compute capability 8.9 (Ada) or newer; the launcher refuses
older GPUs. The interpreter runs the same math on CPU.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, interpreter_active, launcher, next_power_of_2, require_triton, tl, triton
from .quant_reference import dequantize_w8, expand_block_scale
from .quant_tiles import output_strides, plan_tiles, tile_k_for

FP8_MAX = 448.0
# A row of zeros still gets a finite scale (vLLM's floor), so q = 0, not nan.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FP8_TENSOR_CORES = (8, 9)

if triton is not None:
    from .quant_tiles import split_k_range, store_output_tile, tile_coords

    # Module constants a kernel reads must be Triton constexprs.
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_SCALE = tl.constexpr(MIN_SCALE)

    @triton.jit
    def _round_to_e4m3(v):
        """v (float32, |v| <= 448 after clamping) rounded to nearest even on the E4M3 grid."""
        bits = v.to(tl.int32, bitcast=True)
        # Normal E4M3 values keep 3 mantissa bits; below 2^-6 the spacing stays 2^-9.
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inverse_spacing = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)  # exact: powers of two
        steps = tl.abs(v) * inverse_spacing + 12582912.0  # 1.5 * 2^23: float32 addition rounds to an integer
        magnitude = tl.minimum((steps - 12582912.0) * spacing, _FP8_MAX)
        return tl.where(bits < 0, -magnitude, magnitude)  # the sign bit, so -0.0 stays -0.0

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, group_size, stride_xm, stride_qm, stride_sm,
                              BLOCK: tl.constexpr):
        # One program per (row, group of group_size columns); x: [M, K] -> q: [M, K] fp8
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        start = group * group_size
        end = tl.minimum(start + group_size, K)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(start, end, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _FP8_MAX), _MIN_SCALE)  # IEEE, as torch divides
        tl.store(scale_ptr + row * stride_sm + group, scale)
        for k0 in range(start, end, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < end, other=0.0).to(tl.float32)
            q = _round_to_e4m3(tl.math.div_rn(x, scale))
            tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < end)

    @triton.jit
    def _fp8_gemm_kernel(
        q_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
        stride_qm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_om, scale_block_n, scale_block_k,
        k_per_split, stride_split, PER_TILE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # q: [M, K] fp8 with x_scale [M, groups]; w: [N, K] fp8 with w_scale [N // bn, K // bk]
        rows, cols = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row_valid, col_valid = rows < M, cols < N
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
        x_scale_rows = x_scale_ptr + rows * stride_xsm
        w_scale_cols = w_scale_ptr + (cols // scale_block_n) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start, k_end, out_ptr = split_k_range(K, k_per_split, out_ptr, stride_split)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < K
            q = tl.load(q_rows + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            if PER_TILE:  # this tile lies in activation group and weight block column k0 // bk
                x_scale = tl.load(x_scale_rows + k0 // scale_block_k, mask=row_valid, other=0.0)
                w_scale = tl.load(w_scale_cols + (k0 // scale_block_k) * stride_wsk, mask=col_valid, other=0.0)
                acc += tl.dot(q, w) * (x_scale[:, None] * w_scale[None, :])
            else:
                acc = tl.dot(q, w, acc=acc)
        if not PER_TILE:
            x_scale = tl.load(x_scale_rows, mask=row_valid, other=0.0)
            acc = acc * (x_scale[:, None] * tl.load(w_scale_cols, mask=col_valid, other=0.0)[None, :])
        store_output_tile(acc, rows, cols, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS)


def fp8_w8a8_supported(device: torch.device) -> bool:
    """True when FP8 W8A8 can run on ``device``: a CUDA GPU with FP8 tensor cores, or the
    CPU through Triton's interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= FP8_TENSOR_CORES
    return device.type == "cpu" and interpreter_active()


def _require_fp8_device(device: torch.device) -> None:
    if fp8_w8a8_supported(device):
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"FP8 W8A8 needs FP8 tensor cores (compute capability 8.9+); {device} has "
                           f"{major}.{minor}: use the W8A16 kernel (triton_w8_linear) there")
    raise RuntimeError(f"FP8 W8A8 runs on CUDA GPUs of compute capability 8.9+ (or under TRITON_INTERPRET=1), "
                       f"not on {device}")


def activation_group_size(in_features: int, block: tuple[int, int] | None) -> int:
    """Columns per activation scale: the whole row, or the weight's K block."""
    return in_features if block is None else block[1]


def quantize_fp8_rows(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K / group_size)] float32), one
    scale per row and group of group_size columns (Triton)."""
    require_triton()
    check_kernel_dtype("x", x)
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with contiguous rows, got {tuple(x.shape)}"
    num_rows, in_features = x.shape
    num_groups = -(-in_features // group_size)
    q = torch.empty((num_rows, in_features), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    launcher(_quantize_rows_kernel, (num_rows, num_groups))(
        x, q, scale, in_features, group_size, x.stride(0), q.stride(0), scale.stride(0),
        BLOCK=min(1024, max(16, next_power_of_2(min(group_size, in_features)))),
    )
    return q, scale


def _check_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2 and weight.stride(1) == 1, (
        f"weight must be [N, K] float8_e4m3fn with contiguous rows, got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    assert scale.dtype == torch.float32 and scale.dim() == 2, f"scale {scale.dtype} {tuple(scale.shape)}"
    if block is None:
        assert scale.shape in ((1, 1), (out_features, 1)), (
            f"scale {tuple(scale.shape)} is neither per tensor [1, 1] nor per channel [{out_features}, 1]")
        return
    expected = (-(-out_features // block[0]), -(-in_features // block[1]))
    assert tuple(scale.shape) == expected, f"block {block} scale {tuple(scale.shape)}, expected {expected}"
    if tile_k_for(block[1]) is None:
        raise ValueError(f"FP8 W8A8 needs a weight block K size that is a multiple of 16, got block {block}; "
                         "use the W8A16 kernel (triton_w8_linear) for this weight")


def fp8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, bias: torch.Tensor | None, *,
                    split_k: int | None = None) -> torch.Tensor:
    """x [..., K] quantized per token (and K block) to FP8, times the FP8 weight [N, K],
    plus bias; returns [..., N] in x's dtype. fp8_w8a8_reference is its plain-torch twin.
    ``split_k`` as quant_linear.triton_w8_linear's."""
    require_triton()
    _check_weight(weight, scale, block)
    out_features, in_features = weight.shape
    check_kernel_dtype("x", x)
    assert x.shape[-1] == in_features, f"x has {x.shape[-1]} features, the weight {in_features}"
    assert weight.device == scale.device == x.device, f"devices {weight.device}, {scale.device}, {x.device}"
    if bias is not None:
        assert bias.shape == (out_features,) and bias.is_contiguous() and bias.device == x.device, (
            f"bias {tuple(bias.shape)} on {bias.device} must be contiguous [{out_features}] on {x.device}")
    _require_fp8_device(x.device)
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    num_rows = rows.shape[0]
    if num_rows == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    q, x_scale = quantize_fp8_rows(rows, activation_group_size(in_features, block))
    per_channel = block is None and scale.shape[0] == out_features
    stride_wsn, stride_wsk = (scale.stride(0), 0) if per_channel else (0, 0)
    scale_block_n, scale_block_k = 1, in_features
    block_k = 128 if in_features >= 128 else 64
    if block is not None:
        stride_wsn, stride_wsk = scale.stride(0), scale.stride(1)
        scale_block_n, scale_block_k = block
        block_k = min(128, tile_k_for(block[1]) or 16)
    plan = plan_tiles(num_rows, out_features, in_features, block_k, x.device, split_k)
    out = plan.output(num_rows, out_features, x)
    stride_om, stride_split = output_strides(out)
    launcher(_fp8_gemm_kernel, plan.grid(num_rows, out_features))(
        q, x_scale, weight, scale, bias if bias is not None else scale, out, num_rows, out_features, in_features,
        q.stride(0), x_scale.stride(0), weight.stride(0), stride_wsn, stride_wsk, stride_om,
        scale_block_n, scale_block_k, plan.k_per_split, stride_split,
        PER_TILE=block is not None, HAS_BIAS=bias is not None and plan.split_k == 1,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=3,
    )
    return plan.finish(out, bias, x.dtype).reshape(*x.shape[:-1], out_features)


def quantize_fp8_rows_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch quantize_fp8_rows: the same scales, and torch's round-to-nearest-even cast."""
    num_rows, in_features = x.shape
    num_groups = -(-in_features // group_size)
    padded = torch.zeros(num_rows, num_groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :in_features] = x.float()
    amax = padded.view(num_rows, num_groups, group_size).abs().amax(dim=-1)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    expanded = scale.repeat_interleave(group_size, dim=1)[:, :in_features]
    q = (x.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Plain-torch fp8_w8a8_linear: the dequantized FP8 activations times the dequantized
    weight in float32, plus bias, rounded to x's dtype once."""
    in_features = weight.shape[1]
    rows = x.reshape(-1, in_features)
    group_size = activation_group_size(in_features, block)
    q, x_scale = quantize_fp8_rows_reference(rows, group_size)
    x_dequantized = q.float() * expand_block_scale(x_scale, (q.shape[0], q.shape[1]), (1, group_size))
    out = x_dequantized @ dequantize_w8(weight, scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
