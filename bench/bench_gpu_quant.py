"""The quantized Triton kernels against bfloat16 torch matmul on a CUDA GPU, side by side.

Qwen3-8B's linears (hidden 4096, intermediate 12288, 32 query heads and 8 KV heads of
128): qkv [6144 x 4096], o [4096 x 4096], gate_up [24576 x 4096], down [4096 x 12288],
each with random weights quantized here, for batches of M rows from decode (1) to
prefill (4096). Times bfloat16 ``F.linear`` (cuBLAS) and, on the same input:

- W8A16 FP8 per channel and in 128x128 blocks, W8A16 int8 per channel
  (engine/kernels/quant_linear.py triton_w8_linear);
- W4A16 int4 with group 128 scales and zero points (triton_w4_linear);
- FP8 W8A8 per channel and in blocks, activations quantized per token (per token and
  block) at run time (engine/kernels/fp8_w8a8.py), on GPUs of capability 8.9+ only;

and prints ms per call, the ratio bf16 time / kernel time (above 1: faster than bf16)
per linear, and the four linears of one decoder layer summed. ``--moe`` adds the MXFP4
experts (engine/kernels/quant_moe.py) on gpt-oss-20b's shapes (hidden 2880, 32 experts
of 2880, top 4) and the FP8 128x128-block experts (quant_moe_w8.py) on Qwen3-30B-A3B's
(hidden 2048, 128 experts of 768, top 8), each against transformers' way, a bfloat16
matmul per routed expert.
Each kernel's output is checked against its plain-torch reference before it is timed.

    python bench/bench_gpu_quant.py [--rows 1 16 64 256 1024 4096] [--moe]

Needs a CUDA GPU: without one it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

QWEN3_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
FP8_MAX = 448.0


def quantize_w8(weight: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] | None):
    """Symmetric W8 of a float weight [N, K]: per channel, or per (bn, bk) block."""
    top = FP8_MAX if dtype == torch.float8_e4m3fn else 127.0
    rows, cols = weight.shape
    if block is None:
        scale = weight.abs().amax(dim=1, keepdim=True).float() / top
        expanded = scale
    else:
        bn, bk = block
        tiles = weight.float().reshape(rows // bn, bn, cols // bk, bk)
        scale = tiles.abs().amax(dim=(1, 3)) / top
        expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    scaled = weight.float() / expanded
    quantized = scaled.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    return quantized, scale.contiguous()


def quantize_w4(weight: torch.Tensor, group_size: int):
    """Asymmetric int4 with group scales and zero points, packed two codes a byte."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = (-low / scales).round().clamp(0, 15)
    codes = (groups / scales[..., None] + zeros[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scales.contiguous(), zeros.contiguous()


def time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    ms = do_bench(fn, warmup=25, rep=100)
    assert isinstance(ms, float), ms
    return ms


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
    if error > 2e-2:
        raise SystemExit(f"{name}: relative error {error:.3g} against its reference; not timing a wrong kernel")


def linear_methods(weight: torch.Tensor, fp8_tensor_cores: bool) -> dict[str, tuple[Callable, Callable]]:
    """Per method: (kernel(x), reference(x)) over ``weight`` [N, K] bf16 quantized that way."""
    from shardline.engine.kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_reference
    from shardline.engine.kernels.quant_linear import triton_w4_linear, triton_w8_linear
    from shardline.engine.kernels.quant_reference import (
        dequantize_w4,
        dequantize_w8,
        quantized_linear_reference,
    )

    methods: dict[str, tuple[Callable, Callable]] = {}
    for name, dtype, block in (("w8a16 fp8 channel", torch.float8_e4m3fn, None),
                               ("w8a16 fp8 block128", torch.float8_e4m3fn, (128, 128)),
                               ("w8a16 int8 channel", torch.int8, None)):
        q, s = quantize_w8(weight, dtype, block)
        methods[name] = (lambda x, q=q, s=s, b=block: triton_w8_linear(x, q, s, b, None),
                         lambda x, q=q, s=s, b=block: quantized_linear_reference(x, dequantize_w8(q, s, b)))
    packed, scales, zeros = quantize_w4(weight, 128)
    methods["w4a16 int4 g128"] = (lambda x: triton_w4_linear(x, packed, scales, zeros, 128, None),
                                  lambda x: quantized_linear_reference(x, dequantize_w4(packed, scales, zeros, 128)))
    if fp8_tensor_cores:
        for name, block in (("w8a8 fp8 channel", None), ("w8a8 fp8 block128", (128, 128))):
            q, s = quantize_w8(weight, torch.float8_e4m3fn, block)
            methods[name] = (lambda x, q=q, s=s, b=block: fp8_w8a8_linear(x, q, s, b, None),
                             lambda x, q=q, s=s, b=block: fp8_w8a8_reference(x, q, s, b, None))
    return methods


def bench_linear(linear: str, weight: torch.Tensor, rows_list: list[int], fp8_tensor_cores: bool,
                 totals: dict[tuple[int, str], float]) -> None:
    """One linear's line per M; adds each method's ms to ``totals[(M, method)]``."""
    methods = linear_methods(weight, fp8_tensor_cores)
    out_features, in_features = weight.shape
    print(f"\n{linear} [{out_features} x {in_features}]: ms per call (bf16 time / kernel time)")
    for rows in rows_list:
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        bf16_ms = time_ms(partial(F.linear, x, weight))
        totals[(rows, "bf16")] = totals.get((rows, "bf16"), 0.0) + bf16_ms
        cells = [f"M={rows:5d}  bf16 {bf16_ms:8.4f}"]
        for name, (kernel, reference) in methods.items():
            _check(f"{linear} {name} M={rows}", kernel(x), reference(x))
            ms = time_ms(partial(kernel, x))
            totals[(rows, name)] = totals.get((rows, name), 0.0) + ms
            cells.append(f"{name} {ms:8.4f} ({bf16_ms / ms:4.2f}x)")
        print("  " + " | ".join(cells), flush=True)


def bench_linears(rows_list: list[int], fp8_tensor_cores: bool) -> None:
    totals: dict[tuple[int, str], float] = {}
    for linear, (out_features, in_features) in QWEN3_8B_LINEARS.items():
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
        bench_linear(linear, weight, rows_list, fp8_tensor_cores, totals)
        del weight
        torch.cuda.empty_cache()
    print("\nOne decoder layer's four linears: ms (bf16 time / kernel time)")
    names = sorted({name for _, name in totals if name != "bf16"})
    for rows in rows_list:
        bf16_ms = totals[(rows, "bf16")]
        cells = [f"{name} {totals[(rows, name)]:8.4f} ({bf16_ms / totals[(rows, name)]:4.2f}x)" for name in names]
        print(f"  M={rows:5d}  bf16 {bf16_ms:8.4f} | " + " | ".join(cells))


def bf16_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """transformers' experts loop in bfloat16: per routed expert, gate_up, activation, down."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token_idx, position = torch.where(topk_ids == expert)
        gated = activation(x[token_idx] @ gate_up[expert].t())
        weights = topk_weights[token_idx, position, None].to(x.dtype)
        out.index_add_(0, token_idx, (gated @ down[expert].t()) * weights)
    return out


def bench_moe(rows_list: list[int]) -> None:
    """gpt-oss-20b's experts: MXFP4 Triton against a bf16 matmul per routed expert."""
    from shardline.engine.kernels.quant_moe import GatedActivation, mxfp4_moe, mxfp4_moe_reference
    from shardline.engine.kernels.quant_reference import dequantize_mxfp4

    hidden, intermediate, experts, top_k = 2880, 2880, 32, 4
    activation = GatedActivation.clamped_swiglu(alpha=1.702, limit=7.0)

    def mxfp4(out_features: int, in_features: int):
        blocks = torch.randint(0, 256, (experts, out_features, in_features // 32, 16), dtype=torch.uint8,
                               device="cuda")
        return blocks, torch.randint(118, 122, blocks.shape[:-1], dtype=torch.uint8, device="cuda")

    gate_up, down = mxfp4(2 * intermediate, hidden), mxfp4(hidden, intermediate)
    biases = (torch.zeros(experts, 2 * intermediate, device="cuda"), torch.zeros(experts, hidden, device="cuda"))
    gate_up_bf16 = dequantize_mxfp4(*gate_up).to(torch.bfloat16)
    down_bf16 = dequantize_mxfp4(*down).to(torch.bfloat16)
    print(f"\nMXFP4 MoE, {experts} experts {hidden} -> {intermediate}, top {top_k}: ms (bf16 time / kernel time)")
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        topk_ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(rows)])
        topk_weights = torch.rand(rows, top_k, device="cuda").softmax(-1)
        args = (x, *gate_up, biases[0], *down, biases[1], topk_ids, topk_weights, activation)
        _check(f"moe M={rows}", mxfp4_moe(*args), mxfp4_moe_reference(*args))
        bf16_ms = time_ms(partial(bf16_experts, x, gate_up_bf16, down_bf16, topk_ids, topk_weights, activation))
        kernel_ms = time_ms(partial(mxfp4_moe, *args))
        print(f"  M={rows:5d}  bf16 per expert {bf16_ms:8.4f} | mxfp4 triton {kernel_ms:8.4f} "
              f"({bf16_ms / kernel_ms:4.2f}x)", flush=True)


def bench_fp8_moe(rows_list: list[int]) -> None:
    """Qwen3-30B-A3B's experts: FP8 128x128 blocks in Triton against a bf16 matmul per routed expert."""
    from shardline.engine.kernels.quant_moe import SILU_GATED_HALVES
    from shardline.engine.kernels.quant_moe_w8 import w8_moe, w8_moe_reference
    from shardline.engine.kernels.quant_reference import dequantize_w8

    hidden, intermediate, experts, top_k, block = 2048, 768, 128, 8, (128, 128)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, shape in (("gate_up", (2 * intermediate, hidden)), ("down", (hidden, intermediate))):
        pairs = [quantize_w8(torch.randn(*shape, device="cuda") * 0.02, torch.float8_e4m3fn, block)
                 for _ in range(experts)]
        weights[name] = (torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]))
    bf16 = {name: torch.stack([dequantize_w8(q[e], s[e], block) for e in range(experts)]).to(torch.bfloat16)
            for name, (q, s) in weights.items()}
    print(f"\nFP8 block MoE, {experts} experts {hidden} -> {intermediate}, top {top_k}: ms (bf16 / kernel)")
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        topk_ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(rows)])
        topk_weights = torch.rand(rows, top_k, device="cuda").softmax(-1)
        (gate_up, gate_up_scale), (down, down_scale) = weights["gate_up"], weights["down"]
        kernel = partial(w8_moe, x, gate_up, gate_up_scale, None, down, down_scale, None, block, topk_ids,
                         topk_weights, SILU_GATED_HALVES)
        reference = partial(w8_moe_reference, x, gate_up, gate_up_scale, None, down, down_scale, None, block,
                            topk_ids, topk_weights, SILU_GATED_HALVES)
        _check(f"fp8 moe M={rows}", kernel(), reference())
        bf16_ms = time_ms(partial(bf16_experts, x, bf16["gate_up"], bf16["down"], topk_ids, topk_weights,
                                  SILU_GATED_HALVES))
        kernel_ms = time_ms(kernel)
        print(f"  M={rows:5d}  bf16 per expert {bf16_ms:8.4f} | fp8 block triton {kernel_ms:8.4f} "
              f"({bf16_ms / kernel_ms:4.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--moe", action="store_true", help="also time the MXFP4 and FP8-block MoE experts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_quant.py needs a CUDA GPU (torch.cuda.is_available() is False here); the kernels "
              "are tested on CPU through TRITON_INTERPRET=1 in tests/engine/kernels/test_quant_triton.py",
              file=sys.stderr)
        raise SystemExit(2)
    capability = torch.cuda.get_device_capability()
    fp8_tensor_cores = capability >= (8, 9)
    print(f"{torch.cuda.get_device_name()} (capability {capability[0]}.{capability[1]}); FP8 W8A8 "
          f"{'on' if fp8_tensor_cores else 'skipped: needs capability 8.9+'}")
    torch.manual_seed(0)
    bench_linears(args.rows, fp8_tensor_cores)
    if args.moe:
        bench_moe(args.rows)
        bench_fp8_moe(args.rows)


if __name__ == "__main__":
    main()
