"""MXFP4 MoE experts (gpt-oss) against bfloat16 experts on CPU, side by side in one process.

One gpt-oss-shaped experts layer (hidden and intermediate 2880, top-4 routing; 32
experts as gpt-oss-20b has, fewer with ``--experts``) in as many copies as ``--layers``,
each call on the next copy so the weights come from memory as a decode step reads
them: transformers' own GptOssExperts holding the dequantized weights in bfloat16 (as
its MXFP4 loader leaves them on CPU), against the engine's QuantizedExperts holding
the checkpoint's uint8 blocks and scales (engine/kernels/cpu_mxfp4.c). Tokens of
bfloat16 activations, routed uniformly at random: 1, 8 and 32 (decode steps) and 256
(a prefill chunk). Prints the bytes each holds, milliseconds per layer call and the
ratios; rounds are interleaved and the best of each compared.

    python bench/bench_moe_quant.py [--experts 32] [--layers 2] [--repeat 3] [--cpu-time]

``--cpu-time`` runs on one thread timed by its CPU time (for a machine other work is
loading; the absolute figures are then one core's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from shardline.engine.kernels.cpu_mxfp4 import cpu_mxfp4_available
from shardline.engine.kernels.quant_moe import GatedActivation
from shardline.engine.kernels.quant_reference import dequantize_mxfp4
from shardline.engine.quantization.experts import QuantizedExperts
from shardline.engine.quantization.mxfp4 import Mxfp4ExpertWeights

HIDDEN = INTERMEDIATE = 2880
TOP_K = 4
TOKENS = (1, 8, 32, 256)


def _mxfp4(experts: int, rows: int, cols: int, generator: torch.Generator) -> Mxfp4ExpertWeights:
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 124, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8)
    return Mxfp4ExpertWeights(blocks, scales)


def build_layer(experts: int, seed: int) -> tuple[torch.nn.Module, QuantizedExperts]:
    """The same random MXFP4 experts twice: dequantized into transformers' module in
    bfloat16, and kept MXFP4 in the engine's."""
    generator = torch.Generator().manual_seed(seed)
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=experts,
                          num_experts_per_tok=TOP_K)
    gate_up = _mxfp4(experts, 2 * INTERMEDIATE, HIDDEN, generator)
    down = _mxfp4(experts, HIDDEN, INTERMEDIATE, generator)
    gate_up_bias, down_bias = torch.randn(experts, 2 * INTERMEDIATE), torch.randn(experts, HIDDEN)
    activation = GatedActivation.clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)
    quantized = QuantizedExperts(gate_up, down, activation, gate_up_bias, down_bias)
    dense = GptOssExperts(config).to(torch.bfloat16)
    with torch.no_grad():  # transformers holds them [E, K, N]
        dense.gate_up_proj.copy_(dequantize_mxfp4(gate_up.blocks, gate_up.scales).transpose(1, 2))
        dense.down_proj.copy_(dequantize_mxfp4(down.blocks, down.scales).transpose(1, 2))
        dense.gate_up_proj_bias.copy_(gate_up_bias)
        dense.down_proj_bias.copy_(down_bias)
    return dense.eval(), quantized.eval()


def held_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _inputs(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).bfloat16()
    index = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1).bfloat16()
    return hidden, index, weights


def _time(layers: Sequence[torch.nn.Module], inputs: tuple, clock: Callable[[], float]) -> float:
    """Milliseconds per layer call, over one call on each copy."""
    with torch.no_grad():
        start = clock()
        for layer in layers:
            layer(*inputs)
        return (clock() - start) * 1e3 / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    pairs = [build_layer(args.experts, seed) for seed in range(args.layers)]
    dense, quantized = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
    print(f"gpt-oss experts layer: {args.experts} experts, hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
          f"top-{TOP_K}; {args.layers} copies; threads {torch.get_num_threads()}; "
          f"C kernel {'built' if cpu_mxfp4_available() else 'NOT built (torch tiles)'}")
    dense_bytes, quantized_bytes = held_bytes(dense[0]), held_bytes(quantized[0])
    print(f"held per layer: bfloat16 {dense_bytes / 2**20:.1f} MiB, MXFP4 {quantized_bytes / 2**20:.1f} MiB "
          f"({quantized_bytes / dense_bytes:.1%} of bfloat16)")
    for tokens in TOKENS:
        inputs = _inputs(tokens, args.experts, seed=tokens)
        best_dense = best_quantized = float("inf")
        for _ in range(args.repeat):  # interleaved rounds, the best of each
            best_dense = min(best_dense, _time(dense, inputs, clock))
            best_quantized = min(best_quantized, _time(quantized, inputs, clock))
        print(f"{tokens:4d} tokens: bfloat16 {best_dense:8.1f} ms  MXFP4 {best_quantized:8.1f} ms  "
              f"bfloat16 / MXFP4 {best_dense / best_quantized:5.2f}x")


if __name__ == "__main__":
    main()
