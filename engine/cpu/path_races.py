"""What the CPU paths' races measure (engine/cpu/paths.py chooses by them): a decoder
layer's linears packed against torch's matmul, the native prefill kernel against SDPA,
the quantized C kernels against their torch tile path, the W8A8 int8 kernel against
the weight-only kernel. Each runs on the model's own widths, bounded so that a race
costs at most a few hundred milliseconds, the layer's linears a few seconds (they run
a prefill step's rows)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels import cpu_prefill_attention
from ..kernels.cpu_quant import cpu_w8_linear, digit_tiles_ready
from ..kernels.cpu_quant_int8 import cpu_int8_token_codes, cpu_w8a8_available, cpu_w8a8_linear, w8a8_kernel_isa
from ..kernels.quant_reference import dequantize_w8, quantized_linear_reference
from .capability import ModelShape
from .linear import packed_matmul
from .measurement import race

# The measured matmul: the model's input width, at most this many outputs (the speed
# ratio settles well below a large model's sizes; the cost stays bounded).
MEASURED_OUTPUTS = 2048
# The measured layer's widths are at most this (its seven linears then cost about one
# MEASURED_OUTPUTS-wide linear).
MEASURED_LAYER_WIDTH = 1024
# The layer is measured at the row counts a step runs: a decode step's, one row per
# sequence of a batch this size, and a prefill step's, the engine's token budget
# (``rows_hint``) up to MEASURED_PREFILL_ROWS. Small row counts alone misjudge the
# prefill, where oneDNN and torch's matmul block the arithmetic differently.
MEASURED_DECODE_ROWS = 64
MEASURED_PREFILL_ROWS = 2048


# Times a race that puts the default path below its threshold is run again before the
# alternative replaces it (see ``confirmed``).
CONFIRMING_RACES = 3


def confirmed(speedup: Callable[[], float], threshold: float) -> float:
    """``speedup()``, run again up to CONFIRMING_RACES times in all while it stays below
    ``threshold``; the best of the runs. A loaded machine slows either side of a race
    at random, and the default path (packed linears, which the small-batch and fused
    kernels run on) is given up only where every run finds it slower."""
    best = speedup()
    for _ in range(CONFIRMING_RACES - 1):
        if best >= threshold:
            break
        best = max(best, speedup())
    return best


def measured_rows(rows_hint: int) -> tuple[int, ...]:
    """The row counts the layer's race runs for an engine of ``rows_hint`` rows a step."""
    return tuple(sorted({min(MEASURED_DECODE_ROWS, rows_hint), min(rows_hint, MEASURED_PREFILL_ROWS)}))


@torch.inference_mode()
def linear_speedup(dtype: torch.dtype, packed_dtype: torch.dtype, shape: ModelShape, rows_hint: int,
                    alternative: torch.dtype | None = None) -> float:
    """How many times faster a decoder layer's linears run packed in ``packed_dtype`` on
    ``dtype`` inputs at a decode and a prefill step's rows (``measured_rows``), as the
    packed path runs them (query, key and value as one matmul,
    gate and up as one: cpu/layers.py, cpu/linear.py), than through torch's matmul one
    by one in ``dtype`` (or, with ``alternative``, than packed in that dtype). Measuring
    one linear alone would leave out what packing enables: in bfloat16 a single packed
    linear runs about as fast as torch's."""
    generator = torch.Generator().manual_seed(0)
    hidden, widest, heads, kv_heads = (min(size, MEASURED_LAYER_WIDTH) for size in (
        shape.hidden_size, shape.widest_linear, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim))

    def weights(*outputs: int, inputs: int) -> list[torch.Tensor]:
        return [torch.randn(count, inputs, generator=generator).to(dtype) for count in outputs]

    # (the linears on one input, its width) per matmul of the packed path: qkv, o, gate_up, down
    groups = [(weights(heads, kv_heads, kv_heads, inputs=hidden), hidden), (weights(hidden, inputs=heads), heads),
              (weights(widest, widest, inputs=hidden), hidden), (weights(hidden, inputs=widest), widest)]
    def pack(in_dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.ops.mkldnn._reorder_linear_weight(torch.cat(linears).to(in_dtype), rows_hint)
                for linears, _ in groups]

    packed = pack(packed_dtype)
    other = pack(alternative) if alternative is not None else None
    row_counts = measured_rows(rows_hint)
    inputs = {(rows, width): torch.randn(rows, width, generator=generator).to(dtype)
              for rows in row_counts for _, width in groups}

    def packed_layer(weights: list[torch.Tensor]) -> None:
        for rows in row_counts:
            for weight, (_, width) in zip(weights, groups):
                packed_matmul(inputs[rows, width], weight, None)

    def torch_layer() -> None:
        for rows in row_counts:
            for linears, width in groups:
                for weight in linears:
                    F.linear(inputs[rows, width], weight)

    return race(lambda: packed_layer(packed), torch_layer if other is None else lambda: packed_layer(other))


# The measured prefill: fresh prompts of these lengths, one SDPA call each on the alternative.
MEASURED_PROMPTS = (48, 160, 300)


@torch.inference_mode()
def prefill_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    """How many times faster the native prefill kernel attends fresh prompts of
    MEASURED_PROMPTS' lengths than SDPA does, one call per prompt."""
    block_size, generator = 16, torch.Generator().manual_seed(0)
    tokens = sum(MEASURED_PROMPTS)
    blocks = [-(-length // block_size) for length in MEASURED_PROMPTS]
    heads = (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads)
    query, key, value = (torch.randn(tokens, count, shape.head_dim, generator=generator).to(dtype)
                         for count in heads)
    k_cache, v_cache = (torch.zeros(sum(blocks) * block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype)
                        for _ in range(2))
    block_tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    starts = [0]
    for request, length in enumerate(MEASURED_PROMPTS):
        first_block = sum(blocks[:request])
        block_tables[request, : blocks[request]] = torch.arange(first_block, first_block + blocks[request])
        k_cache[first_block * block_size : first_block * block_size + length] = key[starts[-1] : starts[-1] + length]
        v_cache[first_block * block_size : first_block * block_size + length] = value[starts[-1] : starts[-1] + length]
        starts.append(starts[-1] + length)
    k_cache, v_cache = (cache.view(-1, block_size, shape.num_kv_heads, shape.head_dim) for cache in (k_cache, v_cache))
    query_start_loc, seq_lens = torch.tensor(starts), torch.tensor(MEASURED_PROMPTS)
    requests, out, scale = torch.arange(len(MEASURED_PROMPTS)), torch.empty_like(query), shape.head_dim ** -0.5

    def kernel() -> None:
        cpu_prefill_attention.prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                requests, out, scale)

    def sdpa() -> None:
        for first, end in zip(starts, starts[1:]):
            F.scaled_dot_product_attention(query[first:end].transpose(0, 1), key[first:end].transpose(0, 1),
                                           value[first:end].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)

    return race(kernel, sdpa)


# The measured quantized linear's rows of x: a decode step's and a few sequences'.
MEASURED_QUANT_ROWS = (1, 16)


@torch.inference_mode()
def quant_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    """How many times faster the C kernels run a per-channel int8 linear of the model's
    width on ``dtype`` inputs than the torch tile path (the float32 product of the
    dequantized weight, which that path computes a tile of rows at a time)."""
    generator = torch.Generator().manual_seed(0)
    rows = min(shape.widest_linear, MEASURED_OUTPUTS)
    weight = torch.randint(-127, 128, (rows, shape.hidden_size), dtype=torch.int8, generator=generator)
    scale = torch.rand(rows, 1, generator=generator) * 1e-2
    inputs = [torch.randn(count, shape.hidden_size, generator=generator).to(dtype) for count in MEASURED_QUANT_ROWS]
    return race(lambda: [cpu_w8_linear(x, weight, scale) for x in inputs],
                 lambda: [quantized_linear_reference(x, dequantize_w8(weight, scale)) for x in inputs])


def quant_int8_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the W8A8 int8 kernel (kernels/cpu_quant_int8.py) runs ``dtype`` here, and why."""
    isa = w8a8_kernel_isa()
    if isa is None:
        return False, "cpu_quant_int8.c has no integer kernel here (neither AVX512_VNNI nor AVX2, or no C compiler)"
    if not cpu_w8a8_available(dtype):
        return False, f"cpu_quant_int8.c's {isa} kernel takes float32 and bfloat16 inputs, not {dtype}"
    return True, f"cpu_quant_int8.c built with its {isa} kernel"


@torch.inference_mode()
def quant_int8_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    """How many times faster the W8A8 int8 kernel runs a per-channel int8 linear of the
    model's width than the weight-only C kernel on x's per-token codes dequantized
    (what a W8A8 layer runs without it)."""
    generator = torch.Generator().manual_seed(0)
    rows = min(shape.widest_linear, MEASURED_OUTPUTS)
    weight = torch.randint(-127, 128, (rows, shape.hidden_size), dtype=torch.int8, generator=generator)
    scale = torch.rand(rows, 1, generator=generator) * 1e-2
    inputs = [torch.randn(count, shape.hidden_size, generator=generator).to(dtype) for count in MEASURED_QUANT_ROWS]

    def weight_only(x: torch.Tensor) -> torch.Tensor:
        codes, scales, _ = cpu_int8_token_codes(x)
        return cpu_w8_linear(codes.to(dtype) * scales.to(dtype)[:, None], weight, scale)

    return race(lambda: [cpu_w8a8_linear(x, weight, scale) for x in inputs],
                 lambda: [weight_only(x) for x in inputs])


# The one-row race's weights: copies of a linear of the model's width filling this many
# bytes, each then read from memory as a decode step reads its layers' (from the cache
# the two paths rank otherwise on some hosts).
DIGITS_RACE_BYTES = 64 << 20


def quant_digits_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether int8 weights times one row of ``dtype`` x can take the digit products
    (kernels/cpu_quant_digits.h) here, and why."""
    if dtype != torch.bfloat16:
        return False, "the digit products take bfloat16 x only"
    if not digit_tiles_ready():
        return False, "cpu_quant_bf16.c has no digit products here (AVX512_BF16 and AVX512_VNNI)"
    return True, "built"


@torch.inference_mode()
def quant_digits_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    """How many times faster one row of x times per-channel int8 weights of the model's
    width runs through the digit products than through the bfloat16 dot-product tiles,
    the weights read from memory (DIGITS_RACE_BYTES of copies)."""
    generator = torch.Generator().manual_seed(0)
    rows = min(shape.widest_linear, MEASURED_OUTPUTS)
    weight = torch.randint(-127, 128, (rows, shape.hidden_size), dtype=torch.int8, generator=generator)
    weights = [weight.clone() for _ in range(max(1, DIGITS_RACE_BYTES // weight.numel()))]
    scale = torch.rand(rows, 1, generator=generator) * 1e-2
    x = torch.randn(1, shape.hidden_size, generator=generator).to(dtype)

    def run(digits: bool) -> None:
        for each in weights:
            cpu_w8_linear(x, each, scale, digits=digits)

    return race(lambda: run(True), lambda: run(False))
