"""Compile the quantized kernels for CUDA targets on a host without a GPU.

Run as a script (``python cuda_compile.py CAPABILITY CASE...``) with TRITON_INTERPRET
unset: each case calls a launcher on CPU tensors with the kernel launch replaced by a
recorder, and every recorded launch is compiled by Triton's own compiler (front end,
TTGIR, LLVM, PTX and ptxas) for the given compute capability, which the interpreter
never does: a kernel that reads a non-constexpr global, mixes types the GPU does not
take, or uses an FP8 dot on a target without one fails here. Prints one line per
launch, "<case> <kernel> ok" or "<case> <kernel> FAIL: <reason>".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8",
                torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[tuple[int, ...], Any]]:
    names = kernel.arg_names
    values = dict(zip(names, args), **{name: value for name, value in kwargs.items() if name in names})
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for index, name in enumerate(names):
        value = values[name]
        if index in kernel.constexprs:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return signature, constexprs


def record_launches(run: Callable[[], object], modules: list[Any]) -> list[tuple[Any, tuple, dict]]:
    """The (kernel, args, kwargs) of every launch ``run`` makes through ``modules``' launcher."""
    launches: list[tuple[Any, tuple, dict]] = []

    def recording_launcher(kernel: Any, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

    for module in modules:
        module.launcher = recording_launcher
    run()
    return launches


def compile_launches(case: str, launches: list[tuple[Any, tuple, dict]], capability: int) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for kernel, args, kwargs in launches:
        signature, constexprs = _signature(kernel, args, kwargs)
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        try:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", capability, 32), options=options)
            lines.append(f"{case} {kernel.__name__} ok")
        except Exception as error:  # noqa: BLE001  (reported, the caller asserts)
            reason = " ".join(str(error).split())[:400]
            lines.append(f"{case} {kernel.__name__} FAIL: {type(error).__name__}: {reason}")
    return lines


def _cases(capability: int) -> dict[str, Callable[[], object]]:
    from shardline.engine.kernels import fp8_w8a8, quant_linear, quant_moe, quant_moe_w8

    # The target decides, not this host: FP8 W8A8 is launched, FP8 weights read natively from 8.9.
    fp8_w8a8._require_fp8_device = lambda device: None
    quant_linear.reads_fp8_natively = lambda device: capability >= 89
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
    x = torch.randn(5, 256)
    fp8_weight = torch.randn(192, 256).to(torch.float8_e4m3fn)
    int8_weight = torch.randint(-127, 128, (192, 256), dtype=torch.int8)
    block_scale, channel_scale = torch.ones(2, 2), torch.ones(192, 1)
    packed = torch.randint(0, 256, (192, 128), dtype=torch.uint8)
    group_scales, zeros = torch.ones(192, 2), torch.full((192, 2), 8.0)
    hidden_size, intermediate, experts = 64, 64, 4
    moe = (torch.randint(0, 256, (experts, 2 * intermediate, hidden_size // 32, 16), dtype=torch.uint8),
           torch.full((experts, 2 * intermediate, hidden_size // 32), 120, dtype=torch.uint8),
           torch.zeros(experts, 2 * intermediate),
           torch.randint(0, 256, (experts, hidden_size, intermediate // 32, 16), dtype=torch.uint8),
           torch.full((experts, hidden_size, intermediate // 32), 120, dtype=torch.uint8),
           torch.zeros(experts, hidden_size))
    bias = torch.zeros(192)
    return {
        "w8_fp8_block_bf16": lambda: quant_linear.triton_w8_linear(x.to(bf16), fp8_weight, block_scale, (128, 128),
                                                                   bias),
        "w8_fp8_block_bf16_split_k": lambda: quant_linear.triton_w8_linear(
            x.to(bf16), fp8_weight, block_scale, (128, 128), bias, split_k=2),
        "w8_int8_channel_fp16": lambda: quant_linear.triton_w8_linear(x.to(fp16), int8_weight, channel_scale,
                                                                      None, None),
        "w8_fp8_per_element_bf16": lambda: quant_linear.triton_w8_linear(
            x.to(bf16), fp8_weight, torch.ones(8, 7), (24, 40), None),
        "w4_group_bf16": lambda: quant_linear.triton_w4_linear(x.to(bf16), packed, group_scales, zeros, 128, bias),
        "w4_per_element_fp16": lambda: quant_linear.triton_w4_linear(x.to(fp16), packed, torch.ones(192, 16),
                                                                     None, 16, None),
        "fp8_w8a8_channel_bf16": lambda: fp8_w8a8.fp8_w8a8_linear(x.to(bf16), fp8_weight, channel_scale, None,
                                                                  bias),
        "fp8_w8a8_block_bf16": lambda: fp8_w8a8.fp8_w8a8_linear(x.to(bf16), fp8_weight, block_scale, (128, 128),
                                                                None),
        "mxfp4_moe_bf16": lambda: quant_moe.mxfp4_moe(
            torch.randn(3, hidden_size).to(bf16), *moe, torch.randint(0, experts, (3, 2)), torch.rand(3, 2),
            quant_moe.GatedActivation.clamped_swiglu(1.702, 7.0)),
        "w8_moe_fp8_block_bf16": lambda: quant_moe_w8.w8_moe(
            torch.randn(3, hidden_size).to(bf16), torch.randn(experts, 2 * intermediate, hidden_size).to(fp8),
            torch.ones(experts, 1, 1), None, torch.randn(experts, hidden_size, intermediate).to(fp8),
            torch.ones(experts, 1, 1), None, (128, 128), torch.randint(0, experts, (3, 2)), torch.rand(3, 2),
            quant_moe.SILU_GATED_HALVES),
    }


def main(capability: int, names: list[str]) -> None:
    from shardline.engine.kernels import fp8_w8a8, quant_linear, quant_moe, quant_moe_w8

    cases = _cases(capability)
    for name in names:
        launches = record_launches(cases[name], [quant_linear, fp8_w8a8, quant_moe, quant_moe_w8])
        print("\n".join(compile_launches(name, launches, capability)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
