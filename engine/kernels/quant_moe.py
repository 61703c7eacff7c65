"""MoE experts with MXFP4 weights (gpt-oss) in Triton: a grouped matmul over the tokens
routed to each expert.

Weights stay in quant_reference.py's MXFP4 layout, output rows first: gate_up
``blocks`` [E, 2I, H // 32, 16] / ``scales`` [E, 2I, H // 32] and down [E, H, I // 32, 16] /
[E, H, I // 32], beside float biases [E, 2I] and [E, H] (engine/quantization/mxfp4.py).

Routing (plain torch on the device, no host sync): the T * k routes ("slots", slot =
token * k + j) are sorted by expert and each expert's run is padded to whole BLOCK_M
row blocks; ``row_slots`` lists each padded row's slot (num_slots for padding) and
``block_expert`` each block's expert (E past the last block: the program exits). The
grid's first axis is a bound on the block count, so it is known without a sync.
Routes to ids outside [0, E) take no block and contribute nothing, as transformers
skips them.

Two launches of one kernel: gate_up with the gated activation fused (the gate and up
rows of an output column tile are two weight tiles), writing the intermediate [T * k, I]
in the activations' dtype; then down, plus bias, times the route's weight, into a
float32 [T * k, H] that is summed over k and rounded to the activations' dtype once.
In each K tile the FP4 codes are dequantized in float32 (times 2^(scale - 127)) and
rounded to the dot dtype: exact in bfloat16 and float32; in float16 a weight beyond
float16's range would be inf. Even and odd columns meet x in their own dots, as in
quant_linear.py's W4 kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ._triton import check_kernel_dtype, launcher, require_triton, tl, triton
from .quant_reference import dequantize_mxfp4
from .quant_tiles import dot_dtype

MXFP4_BLOCK = 32


@dataclass(frozen=True)
class GatedActivation:
    """How gate_up's output becomes down's input: h = g * sigmoid(alpha * g) * (u + up_shift),
    with g = min(gate, limit) and u = clamp(up, -limit, limit) when ``limit`` is set. The
    gate and up rows are interleaved (gate 2i, up 2i + 1) or halves (gate i, up I + i)."""

    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0
    interleaved: bool = False

    @classmethod
    def clamped_swiglu(cls, alpha: float, limit: float) -> GatedActivation:
        """gpt-oss's experts' activation (transformers' GptOssExperts)."""
        return cls(alpha=alpha, limit=limit, up_shift=1.0, interleaved=True)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The plain-torch activation of gate_up [..., 2I] -> [..., I], in gate_up's dtype."""
        if self.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + self.up_shift)


SILU_GATED_HALVES = GatedActivation()  # silu(gate) * up: Qwen-MoE, Mixtral, DeepSeek-V3

if triton is not None:
    _MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)  # module constants a kernel reads must be Triton constexprs

    @triton.jit
    def _mxfp4_half_tiles(row_ptrs, scale_ptrs, ks_even, k_valid, row_valid):
        """The even- and odd-column weights of a K tile, [BLOCK_K // 2, BN] float32, from
        per-row pointers to the rows' bytes and scales."""
        mask = k_valid[:, None] & row_valid[None, :]
        codes = tl.load(row_ptrs + (ks_even // 2)[:, None], mask=mask, other=0).to(tl.int32)
        exponent = tl.load(scale_ptrs + (ks_even // _MXFP4_BLOCK)[:, None], mask=mask, other=127).to(tl.int32)
        # 2^(e - 127) built from its bits; e = 0 is the subnormal 2^-127.
        scale = tl.where(exponent == 0, 0x00400000, exponent << 23).to(tl.float32, bitcast=True)
        return _e2m1(codes & 15) * scale, _e2m1(codes >> 4) * scale

    @triton.jit
    def _e2m1(code):
        """FP4 E2M1 code (int32 0..15) -> float32: sign bit 3, exponent bits 2..1, mantissa bit 0."""
        exponent = (code >> 1) & 3
        half_mantissa = (code & 1).to(tl.float32) * 0.5
        power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
        magnitude = tl.where(exponent == 0, half_mantissa, (1.0 + half_mantissa) * power)
        return tl.where(code >= 8, -magnitude, magnitude)

    @triton.jit
    def _project(x_rows, x_valid, row_ptrs, scale_ptrs, w_valid, K, acc,
                 BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """acc [BM, BN] += x [BM, K] @ the MXFP4 rows' weight [BN, K].T, walking K."""
        for k0 in range(0, K, BLOCK_K):
            ks_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            k_valid = ks_even < K
            x_mask = x_valid[:, None] & k_valid[None, :]
            x_even = tl.load(x_rows + ks_even[None, :], mask=x_mask, other=0.0).to(DOT_DTYPE)
            x_odd = tl.load(x_rows + ks_even[None, :] + 1, mask=x_mask, other=0.0).to(DOT_DTYPE)
            low, high = _mxfp4_half_tiles(row_ptrs, scale_ptrs, ks_even, k_valid, w_valid)
            acc = tl.dot(x_even, low.to(DOT_DTYPE), acc=acc, input_precision=INPUT_PRECISION)
            acc = tl.dot(x_odd, high.to(DOT_DTYPE), acc=acc, input_precision=INPUT_PRECISION)
        return acc

    @triton.jit
    def expert_tile(x_ptr, row_slots_ptr, block, N, num_slots, top_k, stride_xm,
                    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A routed row block's slots, their x rows (by token when GATED, else by slot)
        and this program's output columns, with their masks."""
        slots = tl.load(row_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        slot_valid = slots < num_slots
        x_rows = x_ptr + (slots // top_k if GATED else slots).to(tl.int64)[:, None] * stride_xm
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return slots, slot_valid, x_rows, cols, cols < N

    @triton.jit
    def _mxfp4_experts_kernel(
        x_ptr, blocks_ptr, scales_ptr, bias_ptr, route_weight_ptr, out_ptr, row_slots_ptr, block_expert_ptr,
        N, K, num_slots, num_experts, top_k, up_row_offset, alpha, limit, up_shift,
        stride_xm, stride_be, stride_bn, stride_se, stride_sn, stride_bias_e, stride_om,
        GATED: tl.constexpr, GATE_ROW_STRIDE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        # GATED: x = hidden [T, H] read by token, out = intermediate [T * k, I];
        # else:  x = intermediate [T * k, I] read by slot, out = float32 [T * k, H].
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert >= num_experts:
            return
        slots, slot_valid, x_rows, cols, col_valid = expert_tile(
            x_ptr, row_slots_ptr, block, N, num_slots, top_k, stride_xm, GATED, BLOCK_M, BLOCK_N)
        expert_blocks = blocks_ptr + expert.to(tl.int64) * stride_be
        expert_scales = scales_ptr + expert.to(tl.int64) * stride_se
        rows = cols * GATE_ROW_STRIDE  # the gate rows when GATED
        acc = _project(x_rows, slot_valid, expert_blocks + rows[None, :] * stride_bn,
                       expert_scales + rows[None, :] * stride_sn, col_valid, K,
                       tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_K, DOT_DTYPE, INPUT_PRECISION)
        up = acc
        if GATED:
            up_rows = rows + up_row_offset
            up = _project(x_rows, slot_valid, expert_blocks + up_rows[None, :] * stride_bn,
                          expert_scales + up_rows[None, :] * stride_sn, col_valid, K,
                          tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_K, DOT_DTYPE, INPUT_PRECISION)
        finish_expert_tile(acc, up, expert, rows, up_row_offset, slots, slot_valid, cols, col_valid,
                           bias_ptr, route_weight_ptr, out_ptr, stride_bias_e, stride_om, alpha, limit, up_shift,
                           GATED, HAS_LIMIT, HAS_BIAS)

    @triton.jit
    def finish_expert_tile(acc, up, expert, rows, up_row_offset, slots, slot_valid, cols, col_valid,
                           bias_ptr, route_weight_ptr, out_ptr, stride_bias_e, stride_om, alpha, limit, up_shift,
                           GATED: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """An expert tile's products (gate and up, or down) to its output rows: plus bias, then
        the gated activation (gate_up) or times the route's weight (down)."""
        bias_row = bias_ptr + expert * stride_bias_e
        if HAS_BIAS:
            acc += tl.load(bias_row + rows, mask=col_valid, other=0.0)[None, :]
        out_dtype = out_ptr.dtype.element_ty
        if GATED:
            if HAS_BIAS:
                up += tl.load(bias_row + rows + up_row_offset, mask=col_valid, other=0.0)[None, :]
            # gate_up is rounded to the activations' dtype before the activation, as the torch path does
            gate = acc.to(out_dtype).to(tl.float32)
            up = up.to(out_dtype).to(tl.float32)
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            acc = gate * tl.sigmoid(gate * alpha) * (up + up_shift)
        else:
            acc = acc * tl.load(route_weight_ptr + slots, mask=slot_valid, other=0.0).to(tl.float32)[:, None]
        offs = slots.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptr + offs, acc.to(out_dtype), mask=slot_valid[:, None] & col_valid[None, :])


@dataclass(frozen=True)
class RoutedBlocks:
    """The routes sorted by expert in BLOCK_M-row blocks (see the module docstring)."""

    row_slots: torch.Tensor  # [max_blocks * block_m (+1 scratch)] int32: a slot, or num_slots
    block_expert: torch.Tensor  # [max_blocks] int32: an expert, or E past the last block
    block_m: int
    max_blocks: int


def route_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutedBlocks:
    """Sort the T * k routes of ``topk_ids`` [T, k] by expert into blocks of ``block_m`` rows."""
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    device = flat.device
    expert_of = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: skipped
    order = torch.argsort(expert_of, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert_of, torch.ones_like(expert_of))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    max_blocks = -(-num_slots // block_m) + min(num_experts, num_slots)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    sorted_expert = expert_of[order]
    clamped = sorted_expert.clamp(max=num_experts - 1)
    rank = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[clamped]
    padded_row = (block_end - blocks)[clamped] * block_m + rank
    scratch = max_blocks * block_m  # skipped routes land here, past every block
    padded_row = torch.where(sorted_expert < num_experts, padded_row, scratch)
    row_slots = torch.full((scratch + 1,), num_slots, dtype=torch.int32, device=device)
    row_slots[padded_row] = order.to(torch.int32)
    return RoutedBlocks(row_slots, block_expert.to(torch.int32), block_m, max_blocks)


def _check_projection(name: str, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      shape: tuple[int, int, int], device: torch.device) -> None:
    num_experts, out_features, in_features = shape
    expected = (num_experts, out_features, in_features // MXFP4_BLOCK)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (*expected, 16) and blocks.is_contiguous(), (
        f"{name} blocks {blocks.dtype} {tuple(blocks.shape)}, expected contiguous uint8 {(*expected, 16)}")
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == expected and scales.is_contiguous(), (
        f"{name} scales {scales.dtype} {tuple(scales.shape)}, expected contiguous uint8 {expected}")
    if bias is not None:
        assert bias.is_floating_point() and tuple(bias.shape) == (num_experts, out_features) \
            and bias.is_contiguous(), f"{name} bias {bias.dtype} {tuple(bias.shape)}"
    assert {blocks.device, scales.device} == {device}, f"{name} on {blocks.device}, hidden on {device}"


def mxfp4_moe(hidden: torch.Tensor, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
              gate_up_bias: torch.Tensor | None, down_blocks: torch.Tensor, down_scales: torch.Tensor,
              down_bias: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              activation: GatedActivation) -> torch.Tensor:
    """The routed experts' output [T, H] in hidden's dtype: per route, gate_up (+ bias),
    ``activation``, down (+ bias), times the route's weight, summed over the token's k
    routes. mxfp4_moe_reference is its plain-torch twin."""
    # hidden: [T, H]; topk_ids: [T, k] int; topk_weights: [T, k] float
    require_triton()
    check_kernel_dtype("hidden", hidden)
    assert hidden.dim() == 2 and hidden.stride(1) == 1, f"hidden {tuple(hidden.shape)} must be [T, H], rows contiguous"
    assert down_blocks.dim() == 4, f"down blocks {tuple(down_blocks.shape)}, expected [E, H, I // 32, 16]"
    num_experts, intermediate = down_blocks.shape[0], down_blocks.shape[2] * MXFP4_BLOCK
    hidden_size = hidden.shape[1]
    assert hidden_size % MXFP4_BLOCK == 0, f"hidden size {hidden_size} is not a multiple of {MXFP4_BLOCK}"
    _check_projection("gate_up", gate_up_blocks, gate_up_scales, gate_up_bias,
                      (num_experts, 2 * intermediate, hidden_size), hidden.device)
    _check_projection("down", down_blocks, down_scales, down_bias, (num_experts, hidden_size, intermediate),
                      hidden.device)
    gate_up = partial(_launch_mxfp4, gate_up_blocks, gate_up_scales, gate_up_bias)
    down = partial(_launch_mxfp4, down_blocks, down_scales, down_bias)
    return routed_experts(hidden, topk_ids, topk_weights, num_experts, intermediate, activation, gate_up, down)


@dataclass(frozen=True)
class RoutedBatch:
    """What both projections of one MoE call share."""

    routes: RoutedBlocks
    route_weights: torch.Tensor  # [T * k] float, by slot
    num_slots: int
    num_experts: int
    top_k: int


# project(x, out, batch, activation): out's rows (by slot) = x's routed rows (by token when
# activation is set, the gate_up projection; by slot otherwise, down) times one projection.
Projection = Callable[[torch.Tensor, torch.Tensor, RoutedBatch, "GatedActivation | None"], None]


def routed_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   intermediate: int, activation: GatedActivation, gate_up: Projection,
                   down: Projection) -> torch.Tensor:
    """The MoE output [T, H]: routes sorted into blocks, gate_up with ``activation`` into
    the intermediate [T * k, I], down into float32 [T * k, H], summed over k and rounded once."""
    num_tokens, hidden_size = hidden.shape
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens and not topk_ids.is_floating_point(), (
        f"topk_ids {topk_ids.dtype} {tuple(topk_ids.shape)}, expected integer [{num_tokens}, k]")
    assert topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(), (
        f"topk_weights {topk_weights.dtype} {tuple(topk_weights.shape)}, expected float {tuple(topk_ids.shape)}")
    assert topk_ids.device == topk_weights.device == hidden.device, "routes and hidden on different devices"
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    block_m = 16 if num_slots <= 16 * num_experts else 32 if num_slots <= 32 * num_experts else 64
    batch = RoutedBatch(route_blocks(topk_ids, num_experts, block_m), topk_weights.reshape(-1).contiguous(),
                        num_slots, num_experts, top_k)
    intermediate_rows = torch.empty((num_slots, intermediate), dtype=hidden.dtype, device=hidden.device)
    out_slots = torch.zeros((num_slots, hidden_size), dtype=torch.float32, device=hidden.device)
    gate_up(hidden, intermediate_rows, batch, activation)
    down(intermediate_rows, out_slots, batch, None)
    return out_slots.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def gated_launch_args(activation: GatedActivation | None, out_features: int) -> tuple[tuple, dict]:
    """The experts kernels' activation arguments: (up_row_offset, alpha, limit, up_shift)
    and the GATED, GATE_ROW_STRIDE and HAS_LIMIT switches (activation None: down)."""
    gated = activation is not None
    act = activation or SILU_GATED_HALVES
    positional = (out_features if gated and not act.interleaved else 1, float(act.alpha), float(act.limit or 0.0),
                  float(act.up_shift))
    return positional, dict(GATED=gated, GATE_ROW_STRIDE=2 if gated and act.interleaved else 1,
                            HAS_LIMIT=act.limit is not None)


def _launch_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                  out: torch.Tensor, batch: RoutedBatch, activation: GatedActivation | None) -> None:
    out_features, in_features = out.shape[1], x.shape[1]
    block_n = 64 if out_features >= 64 else 32
    positional, switches = gated_launch_args(activation, out_features)
    launcher(_mxfp4_experts_kernel, (batch.routes.max_blocks, triton.cdiv(out_features, block_n)))(
        x, blocks, scales, bias if bias is not None else scales, batch.route_weights, out,
        batch.routes.row_slots, batch.routes.block_expert,
        out_features, in_features, batch.num_slots, batch.num_experts, batch.top_k, *positional,
        x.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0), **switches,
        HAS_BIAS=bias is not None, BLOCK_M=batch.routes.block_m, BLOCK_N=block_n, BLOCK_K=64,
        DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )


def mxfp4_moe_reference(hidden: torch.Tensor, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                        gate_up_bias: torch.Tensor | None, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                        down_bias: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        activation: GatedActivation) -> torch.Tensor:
    """Plain-torch mxfp4_moe, one expert at a time: products and biases in float32,
    gate_up and the activation's output each rounded to hidden's dtype, the weighted
    routes summed in float32 and rounded once."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(gate_up_blocks.shape[0]):
        token_idx, position = torch.where(topk_ids == expert)
        if token_idx.numel() == 0:
            continue
        gate_up = hidden[token_idx].float() @ dequantize_mxfp4(gate_up_blocks[expert], gate_up_scales[expert]).t()
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert].float()
        gated = activation(gate_up.to(hidden.dtype).float()).to(hidden.dtype)
        routed = gated.float() @ dequantize_mxfp4(down_blocks[expert], down_scales[expert]).t()
        if down_bias is not None:
            routed = routed + down_bias[expert].float()
        out.index_add_(0, token_idx, routed * topk_weights[token_idx, position, None].float())
    return out.to(hidden.dtype)
