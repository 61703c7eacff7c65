"""Which fast paths the CPU engine takes on this host, chosen once when it loads.

Each path is taken only where the host can run it, by what the libraries report of
themselves, never by an assumed instruction set (engine/cpu/capability.py asks them).

Where two correct paths exist, the faster one is chosen by measurement on the
model's own shapes: packed oneDNN linears (or their float32 copies) against torch's
matmul, the native prefill kernel against SDPA, the quantized linears' C kernels
against their torch tile path, the W8A8 int8 kernel against the weight-only kernels,
the small-batch linear kernel against oneDNN per weight shape and row count, as the
linears are packed (cpu/linear_race.py).
Each measurement is cached per host, library configuration and shape in the cache
directory, so a host pays it once (a few hundred milliseconds at most; the small-batch
kernel's, which reads as many weight bytes as a step, about a second per weight shape
of a model past the cache). Native decode
attention needs no race: it reads each context row once where the torch path gathers
the paged blocks into a padded copy first.

``SHARDLINE_CPU_PATHS`` sets paths by name: ``prefill_kernel=off`` never takes one,
``packed_linears=on`` takes one wherever the host can run it without measuring, and
``all=off`` runs the plain torch path. The tests run every fallback this way on any
host. The choice, with
its reasons, is logged once at load and kept on the engine (``LLMEngine.cpu_paths``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu_prefill_attention
from ..kernels.cpu_quant import cpu_w8_linear
from ..kernels.cpu_quant_int8 import cpu_int8_token_codes, cpu_w8a8_available, cpu_w8a8_linear
from ..kernels.quant_reference import dequantize_w8, quantized_linear_reference
from ..quantization.stacked import stack_gated_mlps
from . import capability
from .capability import (
    COPY_HEADROOM,
    HostCpu,
    ModelShape,
    decode_kernel_capability,
    fused_kernels_capability,
    host_cpu,
    packed_copy_dtype,
    packed_linears_capability,
    prefill_kernel_capability,
    quant_kernels_capability,
    recurrent_kernel_capability,
)
from .hybrid_layers import optimize_hybrid_layers
from .layers import fuse_decoder_layers, fuse_rms_norms
from .linear import fuse_gated_mlps, onednn_linear_available, pack_linears, packed_matmul
from .linear_race import linear_weight_bytes, small_kernel_choice, small_linear_capability
from .measurement import host_key as _host_key  # noqa: F401 - cleared by the tests with the others
from .measurement import measured as _measured
from .measurement import race as _race
from .recurrent_core import take_native_core

logger = logging.getLogger(__name__)

PATH_NAMES = ("packed_linears", "fused_kernels", "decode_kernel", "prefill_kernel", "recurrent_kernel",
              "quant_kernels", "quant_int8_kernel", "small_linear_kernel")
# A measured alternative replaces the default path only when at least this much faster.
MARGIN = 1.1


@dataclass(frozen=True)
class CpuPaths:
    """The CPU paths one engine takes (read by the model rewrites and the attention
    context) and why each was or was not taken."""

    dtype: torch.dtype | None = None  # the model's, which the choice was made for
    packed_linears: bool = False
    packed_dtype: torch.dtype | None = None  # the packed copies', where it is not the model's
    fused_kernels: bool = False
    decode_kernel: bool = False
    prefill_kernel: bool = False
    recurrent_kernel: bool = False  # recurrent layers' convolutions and delta rules (kernels/cpu_recurrent.py)
    # Quantized linears and experts through the C kernels (kernels/cpu_quant.py, cpu_mxfp4.py),
    # else through torch, a tile of dequantized weight rows at a time.
    quant_kernels: bool = False
    # W8A8 int8 linears (inputs quantized per token) through integer products
    # (kernels/cpu_quant_int8.py), else the weight-only kernels on the dequantized codes.
    quant_int8_kernel: bool = False
    # Packed linears whose shape measures faster on the small-batch C kernel
    # (kernels/cpu_small_linear.py) than on oneDNN take it (cpu/linear_race.py).
    small_linear_kernel: bool = False
    reasons: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return "; ".join(f"{name} {'on' if getattr(self, name) else 'off'} ({why})" for name, why in self.reasons)


NO_CPU_PATHS = CpuPaths()


def path_settings() -> dict[str, bool]:
    """Paths set by SHARDLINE_CPU_PATHS, a comma-separated list of ``name=on`` (taken
    wherever the host can run it, without measuring) and ``name=off`` (never taken);
    ``all`` names every path. Anything else is an error naming the item."""
    settings: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in os.environ.get("SHARDLINE_CPU_PATHS", "").split(","))):
        name, _, value = item.partition("=")
        if name not in (*PATH_NAMES, "all") or value not in ("on", "off"):
            raise ValueError(f"SHARDLINE_CPU_PATHS item {item!r} is not NAME=on or NAME=off with NAME one of "
                             f"{', '.join(PATH_NAMES)} or all")
        settings.update(dict.fromkeys(PATH_NAMES if name == "all" else (name,), value == "on"))
    return settings


def choose_cpu_paths(dtype: torch.dtype, shape: ModelShape, rows_hint: int) -> CpuPaths:
    """Decide every CPU path for a model of ``dtype`` and ``shape`` on this host, and
    log the decision once."""
    host = host_cpu()
    settings = path_settings()
    packed_dtype, copies_why = _packed_dtype(host, dtype, shape, rows_hint, settings.get("packed_linears"))
    checks = {
        "packed_linears": (packed_linears_capability(host, dtype, shape),
                           lambda: _linear_speedup(dtype, packed_dtype or dtype, shape, rows_hint), "torch's matmul"),
        "fused_kernels": (fused_kernels_capability(dtype), None, ""),
        "decode_kernel": (decode_kernel_capability(dtype, shape), None, ""),
        "prefill_kernel": (prefill_kernel_capability(dtype, shape), lambda: _prefill_speedup(dtype, shape), "SDPA"),
        "recurrent_kernel": (recurrent_kernel_capability(dtype), None, ""),
        "quant_kernels": (quant_kernels_capability(dtype), lambda: _quant_speedup(dtype, shape),
                          "the torch tile path"),
        "quant_int8_kernel": (_quant_int8_capability(dtype), lambda: _quant_int8_speedup(dtype, shape),
                              "the weight-only kernels"),
        "small_linear_kernel": (small_linear_capability(packed_dtype or dtype), None, ""),
    }
    choices, reasons = {}, []
    for name, ((capable, why), measure, alternative) in checks.items():
        setting = settings.get(name)
        # How the path would run, where that is not the only way (float32 copies).
        how = f" {copies_why or why}" if capable and name == "packed_linears" and packed_dtype is not None else ""
        if setting is False:  # the user's choice is the reason, whatever the host could do
            taken, why = False, "turned off by SHARDLINE_CPU_PATHS"
        elif not capable:
            taken = False
        elif setting is True or measure is None:
            taken, why = True, why if setting is None else f"turned on by SHARDLINE_CPU_PATHS{how}"
        else:
            speedup = _measured(name, (dtype, packed_dtype, shape, rows_hint, "layer") if name == "packed_linears"
                                else (dtype, shape, rows_hint), measure)
            taken, why = speedup >= 1 / MARGIN, f"measured {speedup:.2f}x {alternative}{how}"
        if name == "small_linear_kernel" and taken and not choices["packed_linears"]:
            taken, why = False, "it runs packed linears, which are not taken"
        choices[name] = taken
        reasons.append((name, why))
    paths = CpuPaths(dtype, **choices, packed_dtype=packed_dtype if choices["packed_linears"] else None,
                     reasons=tuple(reasons))
    logger.info("CPU paths for %s on %s: %s", str(dtype).removeprefix("torch."), host.describe(), paths.describe())
    return paths


def choose_recurrent_paths(dtype: torch.dtype) -> CpuPaths:
    """The CPU paths of a model without attention layers (Mamba, RWKV, xLSTM): its
    recurrent layers' kernels where this host builds them and SHARDLINE_CPU_PATHS does
    not turn them off; the other paths are chosen by measuring attention shapes such a
    model lacks, so they stay off. Logged once, as ``choose_cpu_paths`` logs."""
    capable, why = recurrent_kernel_capability(dtype)
    setting = path_settings().get("recurrent_kernel")
    taken = capable and setting is not False
    if capable and setting is not None:
        why = f"turned {'on' if setting else 'off'} by SHARDLINE_CPU_PATHS"
    no_attention = "the model has no attention layers"
    reasons = tuple((name, why if name == "recurrent_kernel" else no_attention) for name in PATH_NAMES)
    paths = CpuPaths(dtype, recurrent_kernel=taken, reasons=reasons)
    logger.info("CPU paths for %s on %s: %s", str(dtype).removeprefix("torch."), host_cpu().describe(),
                paths.describe())
    return paths



def _packed_dtype(host: HostCpu, dtype: torch.dtype, shape: ModelShape, rows_hint: int,
                  setting: bool | None) -> tuple[torch.dtype | None, str]:
    """The dtype packed copies of ``dtype`` linears take where it is not ``dtype``, and
    why: float32 for bfloat16 where oneDNN has no bfloat16 (capability.packed_copy_dtype),
    and where it has but float32 copies, fitting in memory, measure faster: a CPU
    without bfloat16 units (AVX-512 without AVX512_BF16 or AMX), whose bfloat16 oneDNN
    emulates with float32 instructions, runs float32 copies about twice as fast."""
    copy = packed_copy_dtype(host, dtype)
    if copy is not None or dtype != torch.bfloat16 or not host.onednn_bfloat16 or setting is False:
        return copy, ""
    copies, free = shape.linear_weights * torch.float32.itemsize, capability.available_memory()
    if (free is not None and copies * COPY_HEADROOM > free) or not onednn_linear_available(torch.float32):
        return None, ""
    speedup = _measured("bfloat16_packing", (shape, rows_hint),
                        lambda: _linear_speedup(dtype, dtype, shape, rows_hint, alternative=torch.float32))
    if speedup >= 1 / MARGIN:
        return None, ""
    return torch.float32, (f"as float32 copies ({copies / 2**30:.2f} GiB): oneDNN's bfloat16 measured "
                           f"{speedup:.2f}x them on this CPU")


@dataclass(frozen=True)
class CpuRewrites:
    """How many modules ``optimize_for_cpu`` replaced, by kind."""

    packed_linears: int = 0
    fused_mlps: int = 0
    fused_norms: int = 0
    fused_layers: int = 0  # Llama-family and hybrid decoder layers
    # Hybrids' other replacements: packed gated delta-net projections, the last MLP at
    # the sampled rows, recurrent layers on the recurrent kernel (engine/recurrent/).
    hybrid_modules: int = 0
    quantized_modules: int = 0  # quantized linears and experts told which CPU path to take


def optimize_for_cpu(model: torch.nn.Module, paths: CpuPaths, rows_hint: int) -> CpuRewrites:
    """Replace ``model``'s modules by those of the chosen paths: linears by packed ones
    and gated MLPs by fused ones, then norms and decoder layers by fused ones (which
    read the packed weights). A module whose replacement would give another output on
    a probe input keeps its own (each such refusal is logged with its class); LoRA
    wrappers, already in place, keep wrapping the packed linears inside them. Every
    replacement goes through engine/surgery.py; this is the CPU step of its
    PREPARATION_ORDER."""
    packed = mlps = norms = layers = 0
    if paths.packed_linears:
        assert paths.dtype is not None, "a path is chosen for the model's dtype (choose_cpu_paths)"
        step_bytes = linear_weight_bytes(model, paths.packed_dtype or paths.dtype)
        small_kernel = small_kernel_choice(rows_hint, False, step_bytes) if paths.small_linear_kernel else None
        packed = pack_linears(model, rows_hint, dtypes=(paths.dtype,), packed_dtype=paths.packed_dtype,
                              small_kernel=small_kernel)
        mlps = fuse_gated_mlps(model, rows_hint, silu_kernel=paths.fused_kernels)
    if paths.fused_kernels:
        norms = fuse_rms_norms(model)
        layers = fuse_decoder_layers(model, rows_hint)
    # Hybrid models' own norms, projections and layers (hybrid_layers.py; none for other models).
    hybrid = optimize_hybrid_layers(model, paths.fused_kernels, rows_hint)
    others = hybrid.others
    if paths.recurrent_kernel:  # recurrent layers' convolutions and delta rules through the C kernel
        others += take_native_core(model)
    if paths.decode_kernel:  # latent attention layers' decode steps through kernels/cpu_mla.py
        take_latent_decode_kernel(model)
    if paths.quant_kernels and paths.dtype is not None:  # quantized gate and up as one stacked call
        mlps += stack_gated_mlps(model, paths.dtype, silu_kernel=paths.fused_kernels)
    quantized = choose_quant_kernels(model, paths.quant_kernels, paths.quant_int8_kernel)
    rewrites = CpuRewrites(packed, mlps, norms + hybrid.norms, layers + hybrid.layers, others, quantized)
    logger.info("CPU modules replaced: %s", rewrites)
    return rewrites


def take_latent_decode_kernel(model: torch.nn.Module) -> int:
    """Point every latent attention layer (its boolean ``latent_decode_kernel``,
    engine/model/adapters/latent.py) at the C decode kernel, which it takes where the
    kernel builds and fits its cache; returns how many."""
    modules = [module for module in model.modules() if isinstance(getattr(module, "latent_decode_kernel", None), bool)]
    for module in modules:
        setattr(module, "latent_decode_kernel", True)  # noqa: B010 - a plain attribute, not a submodule
    return len(modules)


def choose_quant_kernels(model: torch.nn.Module, take: bool, int8_kernel: bool = False) -> int:
    """Set every quantized module's CPU path (its boolean ``cpu_kernels``: the C kernels,
    else torch's dequantized tiles, engine/quantization/; and where it has one, its
    boolean ``int8_kernel``: W8A8 int8 through integer products); returns how many there are."""
    modules = [module for module in model.modules() if isinstance(getattr(module, "cpu_kernels", None), bool)]
    for module in modules:
        setattr(module, "cpu_kernels", take)  # noqa: B010 - a plain attribute, not a submodule
        if isinstance(getattr(module, "int8_kernel", None), bool):
            setattr(module, "int8_kernel", int8_kernel)  # noqa: B010
    return len(modules)


# -------------------------------------------------------------- measurements

# The measured matmul: the model's input width, at most this many outputs and rows
# (the speed ratio settles well below a large model's sizes; the cost stays bounded).
MEASURED_OUTPUTS = 2048
MEASURED_ROWS = (16, 256)
# The measured layer's widths are at most this (its seven linears then cost about one
# MEASURED_OUTPUTS-wide linear).
MEASURED_LAYER_WIDTH = 1024


@torch.inference_mode()
def _linear_speedup(dtype: torch.dtype, packed_dtype: torch.dtype, shape: ModelShape, rows_hint: int,
                    alternative: torch.dtype | None = None) -> float:
    """How many times faster a decoder layer's linears run packed in ``packed_dtype`` on
    ``dtype`` inputs, as the packed path runs them (query, key and value as one matmul,
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
    inputs = {(rows, width): torch.randn(rows, width, generator=generator).to(dtype)
              for rows in MEASURED_ROWS for _, width in groups}

    def packed_layer(weights: list[torch.Tensor]) -> None:
        for rows in MEASURED_ROWS:
            for weight, (_, width) in zip(weights, groups):
                packed_matmul(inputs[rows, width], weight, None)

    def torch_layer() -> None:
        for rows in MEASURED_ROWS:
            for linears, width in groups:
                for weight in linears:
                    F.linear(inputs[rows, width], weight)

    return _race(lambda: packed_layer(packed), torch_layer if other is None else lambda: packed_layer(other))


# The measured prefill: fresh prompts of these lengths, one SDPA call each on the alternative.
MEASURED_PROMPTS = (48, 160, 300)


@torch.inference_mode()
def _prefill_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
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

    return _race(kernel, sdpa)


# The measured quantized linear's rows of x: a decode step's and a few sequences'.
MEASURED_QUANT_ROWS = (1, 16)


@torch.inference_mode()
def _quant_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    """How many times faster the C kernels run a per-channel int8 linear of the model's
    width on ``dtype`` inputs than the torch tile path (the float32 product of the
    dequantized weight, which that path computes a tile of rows at a time)."""
    generator = torch.Generator().manual_seed(0)
    rows = min(shape.widest_linear, MEASURED_OUTPUTS)
    weight = torch.randint(-127, 128, (rows, shape.hidden_size), dtype=torch.int8, generator=generator)
    scale = torch.rand(rows, 1, generator=generator) * 1e-2
    inputs = [torch.randn(count, shape.hidden_size, generator=generator).to(dtype) for count in MEASURED_QUANT_ROWS]
    return _race(lambda: [cpu_w8_linear(x, weight, scale) for x in inputs],
                 lambda: [quantized_linear_reference(x, dequantize_w8(weight, scale)) for x in inputs])


def _quant_int8_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the W8A8 int8 kernel (kernels/cpu_quant_int8.py) runs ``dtype`` here, and why."""
    if not cpu_w8a8_available(dtype):
        return False, "no AVX512_VNNI build of cpu_quant_int8.c for this dtype (float32 and bfloat16 only)"
    return True, "built with AVX512_VNNI"


@torch.inference_mode()
def _quant_int8_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
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

    return _race(lambda: [cpu_w8a8_linear(x, weight, scale) for x in inputs],
                 lambda: [weight_only(x) for x in inputs])
