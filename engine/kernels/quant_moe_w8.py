"""MoE experts with W8 weights (FP8 or int8; per-tensor, per-channel or block scales) in
Triton: the grouped matmul of quant_moe.py over quant_reference.py's W8 layout stacked
over the experts.

Weights: gate_up ``weight`` [E, 2I, H] and down [E, H, I] in torch.float8_e4m3fn or
torch.int8, each with a float32 ``scale`` [E, 1, 1] (per tensor), [E, N, 1] (per output
channel) or [E, ceil(N / bn), ceil(K / bk)] for blocks of ``block`` = (bn, bk), as
DeepSeek-V3's and the Qwen3 FP8 releases' 128x128 blocks. Biases [E, 2I] and [E, H].
The routing, the fused activation and the rounding are quant_moe.py's; each K tile is
quant_linear.py's W8 product (w8_product), so the scales meet the products as there.
"""

from __future__ import annotations

from functools import partial

import torch

from ._triton import check_kernel_dtype, launcher, require_triton, tl, triton
from .quant_linear import w8_scale_mode, weight_operand
from .quant_moe import GatedActivation, RoutedBatch, gated_launch_args, routed_experts
from .quant_reference import W8_DTYPES, dequantize_w8
from .quant_tiles import dot_dtype

if triton is not None:
    from .quant_linear import w8_product
    from .quant_moe import expert_tile, finish_expert_tile

    @triton.jit
    def _w8_experts_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, route_weight_ptr, out_ptr, row_slots_ptr, block_expert_ptr,
        N, K, num_slots, num_experts, top_k, up_row_offset, alpha, limit, up_shift,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, scale_block_n, scale_block_k,
        stride_bias_e, stride_om,
        GATED: tl.constexpr, GATE_ROW_STRIDE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        SCALE_MODE: tl.constexpr, WEIGHT_FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        # As quant_moe._mxfp4_experts_kernel, with w: [E, N, K] int8 or FP8 codes as uint8.
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert >= num_experts:
            return
        slots, slot_valid, x_rows, cols, col_valid = expert_tile(
            x_ptr, row_slots_ptr, block, N, num_slots, top_k, stride_xm, GATED, BLOCK_M, BLOCK_N)
        expert_w = w_ptr + expert.to(tl.int64) * stride_we
        expert_scale = scale_ptr + expert.to(tl.int64) * stride_se
        rows = cols * GATE_ROW_STRIDE  # the gate rows when GATED
        acc = w8_product(x_rows, slot_valid, expert_w + rows.to(tl.int64)[None, :] * stride_wn,
                         expert_scale + (rows // scale_block_n) * stride_sn, col_valid, 0, K, K, stride_sk,
                         scale_block_k, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_MODE, WEIGHT_FP8, DOT_DTYPE, INPUT_PRECISION)
        up = acc
        if GATED:
            up_rows = rows + up_row_offset
            up = w8_product(x_rows, slot_valid, expert_w + up_rows.to(tl.int64)[None, :] * stride_wn,
                            expert_scale + (up_rows // scale_block_n) * stride_sn, col_valid, 0, K, K, stride_sk,
                            scale_block_k, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_MODE, WEIGHT_FP8, DOT_DTYPE,
                            INPUT_PRECISION)
        finish_expert_tile(acc, up, expert, rows, up_row_offset, slots, slot_valid, cols, col_valid,
                           bias_ptr, route_weight_ptr, out_ptr, stride_bias_e, stride_om, alpha, limit, up_shift,
                           GATED, HAS_LIMIT, HAS_BIAS)


def _scale_layout(name: str, scale: torch.Tensor, shape: tuple[int, int, int],
                  block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(stride_sn, stride_sk, block_n, block_k) of a stacked W8 scale, asserting its shape."""
    num_experts, out_features, in_features = shape
    assert scale.dtype == torch.float32 and scale.dim() == 3 and scale.shape[0] == num_experts, (
        f"{name} scale {scale.dtype} {tuple(scale.shape)}, expected float32 [{num_experts}, ...]")
    if block is None:
        assert scale.shape[1:] in ((1, 1), (out_features, 1)), (
            f"{name} scale {tuple(scale.shape)}: neither per tensor [E, 1, 1] nor per channel [E, {out_features}, 1]")
        return (0 if scale.shape[1] == 1 else scale.stride(1)), 0, 1, in_features
    expected = (num_experts, -(-out_features // block[0]), -(-in_features // block[1]))
    assert tuple(scale.shape) == expected, f"{name} block {block} scale {tuple(scale.shape)}, expected {expected}"
    return scale.stride(1), scale.stride(2), block[0], block[1]


def _check_weight(name: str, weight: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int, int],
                  device: torch.device) -> None:
    assert weight.dtype in W8_DTYPES and tuple(weight.shape) == shape and weight.is_contiguous(), (
        f"{name} weight {weight.dtype} {tuple(weight.shape)}, expected contiguous fp8/int8 {shape}")
    if bias is not None:
        assert bias.is_floating_point() and tuple(bias.shape) == shape[:2] and bias.is_contiguous(), (
            f"{name} bias {bias.dtype} {tuple(bias.shape)}, expected float {shape[:2]}")
    assert weight.device == device, f"{name} on {weight.device}, hidden on {device}"


def w8_moe(hidden: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
           gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_scale: torch.Tensor,
           down_bias: torch.Tensor | None, block: tuple[int, int] | None, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """The routed experts' output [T, H] in hidden's dtype, as quant_moe.mxfp4_moe with W8
    weights (``block`` the scales' block, or None per tensor/channel); w8_moe_reference
    is its plain-torch twin."""
    # hidden: [T, H]; gate_up_weight: [E, 2I, H]; down_weight: [E, H, I]; topk_*: [T, k]
    require_triton()
    check_kernel_dtype("hidden", hidden)
    assert hidden.dim() == 2 and hidden.stride(1) == 1, f"hidden {tuple(hidden.shape)} must be [T, H], rows contiguous"
    assert down_weight.dim() == 3, f"down weight {tuple(down_weight.shape)}, expected [E, H, I]"
    num_experts, hidden_size, intermediate = down_weight.shape
    gate_up_shape = (num_experts, 2 * intermediate, hidden_size)
    _check_weight("gate_up", gate_up_weight, gate_up_bias, gate_up_shape, hidden.device)
    _check_weight("down", down_weight, down_bias, (num_experts, hidden_size, intermediate), hidden.device)
    gate_up_layout = _scale_layout("gate_up", gate_up_scale, gate_up_shape, block)
    down_layout = _scale_layout("down", down_scale, (num_experts, hidden_size, intermediate), block)
    gate_up = partial(_launch_w8, gate_up_weight, gate_up_scale, gate_up_layout, gate_up_bias)
    down = partial(_launch_w8, down_weight, down_scale, down_layout, down_bias)
    return routed_experts(hidden, topk_ids, topk_weights, num_experts, intermediate, activation, gate_up, down)


def _launch_w8(weight: torch.Tensor, scale: torch.Tensor, layout: tuple[int, int, int, int],
               bias: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor, batch: RoutedBatch,
               activation: GatedActivation | None) -> None:
    out_features, in_features = out.shape[1], x.shape[1]
    stride_sn, stride_sk, scale_block_n, scale_block_k = layout
    mode, block_k = w8_scale_mode(stride_sk, scale_block_k, in_features)
    block_n = 64 if out_features >= 64 else 32
    positional, switches = gated_launch_args(activation, out_features)
    operand, weight_fp8 = weight_operand(weight)
    launcher(_w8_experts_kernel, (batch.routes.max_blocks, triton.cdiv(out_features, block_n)))(
        x, operand, scale, bias if bias is not None else scale,
        batch.route_weights, out, batch.routes.row_slots, batch.routes.block_expert,
        out_features, in_features, batch.num_slots, batch.num_experts, batch.top_k, *positional,
        x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), stride_sn, stride_sk,
        scale_block_n, scale_block_k, bias.stride(0) if bias is not None else 0, out.stride(0), **switches,
        HAS_BIAS=bias is not None, SCALE_MODE=mode, WEIGHT_FP8=weight_fp8,
        BLOCK_M=batch.routes.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )


def w8_moe_reference(hidden: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
                     gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_scale: torch.Tensor,
                     down_bias: torch.Tensor | None, block: tuple[int, int] | None, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """Plain-torch w8_moe, one expert at a time, rounded as quant_moe.mxfp4_moe_reference."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(gate_up_weight.shape[0]):
        token_idx, position = torch.where(topk_ids == expert)
        if token_idx.numel() == 0:
            continue
        gate_up = hidden[token_idx].float() @ dequantize_w8(gate_up_weight[expert], gate_up_scale[expert], block).t()
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert].float()
        gated = activation(gate_up.to(hidden.dtype).float()).to(hidden.dtype)
        routed = gated.float() @ dequantize_w8(down_weight[expert], down_scale[expert], block).t()
        if down_bias is not None:
            routed = routed + down_bias[expert].float()
        out.index_add_(0, token_idx, routed * topk_weights[token_idx, position, None].float())
    return out.to(hidden.dtype)
