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
directory, so a host pays it once (a few hundred milliseconds for most; the packed
linears', which run a prefill step's rows, a few seconds, and more where a result below
the margin is measured again; the small-batch kernel's, which reads as many weight
bytes as a step, a few seconds per weight shape of a model past the cache). Native decode
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

from ..quantization.stacked import stack_gated_mlps
from . import capability
from .capability import (
    COPY_HEADROOM,
    HostCpu,
    ModelShape,
    decode_kernel_capability,
    decode_programs_capability,
    fused_kernels_capability,
    host_cpu,
    packed_copy_dtype,
    packed_linears_capability,
    prefill_kernel_capability,
    quant_kernels_capability,
    recurrent_kernel_capability,
)
from .fused_decoder import record_decode_steps
from .hybrid_layers import optimize_hybrid_layers
from .layers import fuse_decoder_layers
from .linear import fuse_gated_mlps, onednn_linear_available, pack_linears
from .linear_race import linear_weight_bytes, small_kernel_choice, small_linear_capability
from .measurement import host_key as _host_key  # noqa: F401 - cleared by the tests with the others
from .measurement import measured as _measured
from .norms import fuse_rms_norms
from .path_races import (
    confirmed,
    linear_speedup,
    prefill_speedup,
    quant_digits_capability,
    quant_digits_speedup,
    quant_int8_capability,
    quant_int8_speedup,
    quant_speedup,
)
from .recurrent_core import take_native_core

logger = logging.getLogger(__name__)

PATH_NAMES = ("packed_linears", "fused_kernels", "decode_kernel", "prefill_kernel", "recurrent_kernel",
              "quant_kernels", "quant_int8_kernel", "quant_digits_kernel", "small_linear_kernel", "decode_programs")
# A measured alternative replaces the default path only when at least this much faster.
MARGIN = 1.1
# Paths that are themselves the alternative: taken only where measured at least MARGIN
# faster than what they replace. The digit products replace, for one row of x, the
# bfloat16 tiles every other decode shape of int8 weights takes.
TAKEN_WHEN_FASTER = ("quant_digits_kernel",)
# Paths that run inside another: not taken where that one is not, and why.
RUNS_IN = {"small_linear_kernel": ("packed_linears", "it runs packed linears, which are not taken"),
           "quant_digits_kernel": ("quant_kernels", "it runs in the quantized linears' C kernels, which are not taken"),
           "decode_programs": ("fused_kernels", "it replays the fused decoder layers' kernels, which are not taken")}


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
    # int8 weights times one row of bfloat16 x through integer byte products on x in fixed
    # point (kernels/cpu_quant_digits.h), else the bfloat16 dot-product tiles.
    quant_digits_kernel: bool = False
    # Packed linears whose shape measures faster on the small-batch C kernel
    # (kernels/cpu_small_linear.py) than on oneDNN take it (cpu/linear_race.py).
    small_linear_kernel: bool = False
    # Decode steps of fused Llama-family decoders replayed from their recorded kernel
    # calls, one C call between attention calls (cpu/decode_programs.py).
    decode_programs: bool = False
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


def choose_cpu_paths(dtype: torch.dtype, shape: ModelShape, rows_hint: int, enforce_eager: bool = False) -> CpuPaths:
    """Decide every CPU path for a model of ``dtype`` and ``shape`` on this host, and
    log the decision once. ``enforce_eager`` (the engine's option) keeps decode steps
    from being recorded and replayed (decode_programs), as it keeps CUDA graphs off."""
    host = host_cpu()
    settings = path_settings()
    packed_dtype, copies_why = _packed_dtype(host, dtype, shape, rows_hint, settings.get("packed_linears"))
    checks = {
        "packed_linears": (packed_linears_capability(host, dtype, shape),
                           lambda: confirmed(lambda: linear_speedup(dtype, packed_dtype or dtype, shape, rows_hint),
                                             1 / MARGIN), "torch's matmul"),
        "fused_kernels": (fused_kernels_capability(dtype), None, ""),
        "decode_kernel": (decode_kernel_capability(dtype, shape), None, ""),
        "prefill_kernel": (prefill_kernel_capability(dtype, shape), lambda: prefill_speedup(dtype, shape), "SDPA"),
        "recurrent_kernel": (recurrent_kernel_capability(dtype), None, ""),
        "quant_kernels": (quant_kernels_capability(dtype), lambda: quant_speedup(dtype, shape),
                          "the torch tile path"),
        "quant_int8_kernel": (quant_int8_capability(dtype), lambda: quant_int8_speedup(dtype, shape),
                              "the weight-only kernels"),
        "quant_digits_kernel": (quant_digits_capability(dtype), lambda: quant_digits_speedup(dtype, shape),
                                "the bfloat16 dot-product tiles"),
        "small_linear_kernel": (small_linear_capability(packed_dtype or dtype), None, ""),
        "decode_programs": (decode_programs_capability(dtype), None, ""),
    }
    choices, reasons = {}, []
    for name, ((capable, why), measure, alternative) in checks.items():
        setting = settings.get(name)
        # How the path would run, where that is not the only way (float32 copies).
        how = f" {copies_why or why}" if capable and name == "packed_linears" and packed_dtype is not None else ""
        if setting is False:  # the user's choice is the reason, whatever the host could do
            taken, why = False, "turned off by SHARDLINE_CPU_PATHS"
        elif name == "decode_programs" and enforce_eager:
            taken, why = False, "turned off by enforce_eager"
        elif not capable:
            taken = False
        elif setting is True or measure is None:
            taken, why = True, why if setting is None else f"turned on by SHARDLINE_CPU_PATHS{how}"
        else:
            speedup = _measured(name, (dtype, packed_dtype, shape, rows_hint, "layer at step rows")
                                if name == "packed_linears"
                                else (dtype, shape, rows_hint), measure)
            threshold = MARGIN if name in TAKEN_WHEN_FASTER else 1 / MARGIN
            taken, why = speedup >= threshold, f"measured {speedup:.2f}x {alternative}{how}"
        outer, outer_off = RUNS_IN.get(name, (None, ""))
        if taken and outer is not None and not choices[outer]:
            taken, why = False, outer_off
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
    speedup = _measured("bfloat16_packing", (shape, rows_hint, "step rows"),
                        lambda: linear_speedup(dtype, dtype, shape, rows_hint, alternative=torch.float32))
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
        if paths.decode_programs:
            record_decode_steps(model)
    # Hybrid models' own norms, projections and layers (hybrid_layers.py; none for other models).
    hybrid = optimize_hybrid_layers(model, paths.fused_kernels, rows_hint)
    others = hybrid.others
    if paths.recurrent_kernel:  # recurrent layers' convolutions and delta rules through the C kernel
        others += take_native_core(model)
    if paths.decode_kernel:  # latent attention layers' decode steps through kernels/cpu_mla.py
        take_latent_decode_kernel(model)
    if paths.quant_kernels and paths.dtype is not None:  # quantized gate and up as one stacked call
        mlps += stack_gated_mlps(model, paths.dtype, silu_kernel=paths.fused_kernels)
    quantized = choose_quant_kernels(model, paths.quant_kernels, paths.quant_int8_kernel, paths.quant_digits_kernel)
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


def choose_quant_kernels(model: torch.nn.Module, take: bool, int8_kernel: bool = False,
                         digit_tiles: bool = False) -> int:
    """Set every quantized module's CPU path (its boolean ``cpu_kernels``: the C kernels,
    else torch's dequantized tiles, engine/quantization/; and where it has them, its
    booleans ``int8_kernel``: W8A8 int8 through integer products, and ``digit_tiles``:
    one row of bfloat16 x times int8 codes through the digit products); returns how many
    there are."""
    modules = [module for module in model.modules() if isinstance(getattr(module, "cpu_kernels", None), bool)]
    for module in modules:
        setattr(module, "cpu_kernels", take)  # noqa: B010 - a plain attribute, not a submodule
        for name, value in (("int8_kernel", int8_kernel), ("digit_tiles", digit_tiles)):
            if isinstance(getattr(module, name, None), bool):
                setattr(module, name, value)
    return len(modules)


# -------------------------------------------------------------- measurements
