"""What this host's CPU and libraries can run, asked of them, never assumed from an
instruction set: the capability half of the CPU path choice (engine/cpu/paths.py
races the paths that pass here and decides).

- packed linears: torch built with oneDNN and a probe matmul that must give torch's
  answer; for bfloat16, oneDNN's own bfloat16 support query (it needs AVX-512
  BW/VL/DQ or AVX-NE-CONVERT). Where that query says no, bfloat16 linears can be
  packed as float32 copies instead (cpu/linear.py), if twice their weights' memory
  is free;
- fused elementwise kernels, native decode and prefill attention, the recurrent
  layers' kernel (convolutions, gated delta-net and Kimi delta attention cores), the
  quantized linears' kernels: a C compiler, the library built for the kernel target
  (kernels/native.py), the dtype.

Each check returns whether the path can run and why, for the choice's log line.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..kernels import cpu_attention, cpu_fused, cpu_prefill_attention, cpu_quant, cpu_recurrent, native
from .linear import onednn_linear_available


@dataclass(frozen=True)
class HostCpu:
    """What the host's CPU and libraries say they can do."""

    model: str
    machine: str
    torch_isa: str  # the vector level torch's own kernels dispatch to
    kernel_isa: str | None  # what the C kernels are built with; None: no compiler
    kernel_target: str
    onednn: bool
    onednn_bfloat16: bool
    # The CPU's bfloat16 matrix units as it reports them (AMX, AVX512_BF16, or none):
    # for the log line only; the paths go by what oneDNN runs and by measurement.
    bfloat16_units: str = "none"

    def describe(self) -> str:
        kernels = f"{self.kernel_isa} (-march={self.kernel_target})" if self.kernel_isa else "none (no C compiler)"
        return (f"{self.model} ({self.machine}); torch kernels {self.torch_isa}; C kernels {kernels}; "
                f"oneDNN {'yes' if self.onednn else 'no'}, bfloat16 {'yes' if self.onednn_bfloat16 else 'no'}; "
                f"bfloat16 units {self.bfloat16_units}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_cpu() -> HostCpu:
    """The host's CPU as torch, oneDNN and the C compiler report it."""
    onednn = torch.backends.mkldnn.is_available()
    return HostCpu(
        model=_cpu_model(),
        machine=platform.machine(),
        torch_isa=torch.backends.cpu.get_cpu_capability(),
        kernel_isa=native.built_vector_isa(),
        kernel_target=native.kernel_target(),
        onednn=onednn,
        onednn_bfloat16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        bfloat16_units=_bfloat16_units(),
    )


def _bfloat16_units() -> str:
    """AMX, AVX512_BF16 or none, as torch's CPU queries report the CPU (where this
    torch has them)."""
    units = [name for name, query in (("AMX", "_is_amx_tile_supported"), ("AVX512_BF16", "_is_avx512_bf16_supported"))
             if bool(getattr(torch.cpu, query, lambda: False)())]
    return "+".join(units) or "none"


@dataclass(frozen=True)
class ModelShape:
    """The shapes the measurements run: the model's widest linear and its heads."""

    hidden_size: int
    widest_linear: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Elements in the model's linear weights (what packed copies would hold); not part
    # of a measurement's key.
    linear_weights: int = field(default=0, repr=False, compare=False)

    @classmethod
    def of(cls, model: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> ModelShape:
        """The decoder's width and its widest linear on the hidden states (the LM head,
        as wide as the vocabulary, aside)."""
        vocab_size, hidden_size = _input_embedding_weight(model).shape
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        widths = [module.out_features for module in linears
                  if module.in_features == hidden_size and module.out_features != vocab_size]
        return cls(hidden_size, max(widths, default=hidden_size), num_heads, num_kv_heads, head_dim,
                   # Linears left on the meta device become quantized ones (engine/quantization/).
                   linear_weights=sum(module.weight.numel() for module in linears if not module.weight.is_meta))



@runtime_checkable
class EmbeddingModel(Protocol):
    """A model with input embeddings (every transformers model)."""

    def get_input_embeddings(self) -> nn.Module: ...


def _input_embedding_weight(model: nn.Module) -> torch.Tensor:
    """[vocab, hidden]: the weight of the model's input embeddings."""
    if not isinstance(model, EmbeddingModel):
        raise TypeError(f"{type(model).__name__} has no get_input_embeddings() to read its width from")
    weight = model.get_input_embeddings().weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(model).__name__}'s input embeddings have no weight tensor")
    return weight


def packed_copy_dtype(host: HostCpu, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype packed copies of ``dtype`` linears would take where it is not
    ``dtype``: float32 for bfloat16 where oneDNN has no bfloat16."""
    return torch.float32 if dtype == torch.bfloat16 and host.onednn and not host.onednn_bfloat16 else None


# The float32 copies of a bfloat16 model's linears are taken only if this many times
# their size is free: the KV cache and the step's temporaries come after them.
COPY_HEADROOM = 2


def packed_linears_capability(host: HostCpu, dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    """Whether oneDNN's packed linears (or float32 copies of bfloat16 ones) run ``dtype``
    here and fit in memory, and why."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"oneDNN has no {str(dtype).removeprefix('torch.')} matmul"
    if not host.onednn:
        return False, "torch built without oneDNN"
    packed_dtype = packed_copy_dtype(host, dtype) or dtype
    if not onednn_linear_available(packed_dtype):
        return False, "oneDNN's packed linear fails its probe here"
    if packed_dtype == dtype:
        return True, "oneDNN runs it"
    copies, free = shape.linear_weights * packed_dtype.itemsize, available_memory()
    if free is not None and copies * COPY_HEADROOM > free:
        return False, (f"oneDNN has no bfloat16 on this CPU and float32 copies of the linears "
                       f"({copies / 2**30:.1f} GiB) do not fit {COPY_HEADROOM}x in the {free / 2**30:.1f} GiB free")
    return True, f"as float32 copies ({copies / 2**30:.2f} GiB): oneDNN has no bfloat16 on this CPU"


def available_memory() -> int | None:
    """Bytes of memory the host reports available to allocate, or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fused_kernels_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the fused elementwise kernels (kernels/cpu_fused.c) run ``dtype`` here, and why."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False, "float32 and bfloat16 only"
    if not cpu_fused.fused_kernels_available(dtype):
        return False, f"{cpu_fused.SOURCE.name} could not be built (see its warning)"
    return True, "built"


def decode_programs_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether decode steps of fused layers can be replayed from recorded kernel calls
    here (cpu/decode_programs.py), and why."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False, "float32 and bfloat16 only"
    # Its executor is generated per record and built by the fused kernels' compiler (a
    # record whose executor does not build is refused then, with the reason logged).
    return True, "with the fused kernels"


def recurrent_kernel_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the recurrent layers' kernel (kernels/cpu_recurrent.py) runs ``dtype`` here, and why."""
    if dtype not in cpu_recurrent.DTYPES:
        return False, "float32 and float64 only"
    if cpu_recurrent.load_library() is None:
        return False, f"{cpu_recurrent.SOURCE.name} could not be built (see its warning)"
    return True, "built"


def quant_kernels_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the quantized linears' C kernels (kernels/cpu_quant.py) take ``dtype`` here, and why."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, "float32, bfloat16 and float16 only"
    if not cpu_quant.cpu_quant_available(dtype):
        return False, f"{cpu_quant.SOURCE.name} could not be built for {str(dtype).removeprefix('torch.')}"
    return True, "built"


def decode_kernel_capability(dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    """Whether the native decode attention kernel runs this model here, and why."""
    return _attention_kernel(cpu_attention, cpu_attention.decode_kernel_available, dtype, shape,
                             "reads each context row once")


def prefill_kernel_capability(dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    """Whether the native prefill attention kernel runs this model here, and why."""
    return _attention_kernel(cpu_prefill_attention, cpu_prefill_attention.prefill_kernel_available, dtype, shape,
                             "built")


class NativeKernel(Protocol):
    """A native kernel's module (kernels/cpu_attention.py, cpu_prefill_attention.py)."""

    @property
    def DTYPES(self) -> tuple[torch.dtype, ...]: ...

    @property
    def SOURCE(self) -> Path: ...

    def load_library(self) -> object: ...


def _attention_kernel(kernel: NativeKernel, available: Callable[[torch.Tensor, int], bool], dtype: torch.dtype,
                      shape: ModelShape, why: str) -> tuple[bool, str]:
    """Whether a native attention kernel (a module with SOURCE, DTYPES and
    load_library) runs this model's dtype and heads here, and why."""
    if dtype not in kernel.DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in kernel.DTYPES)
        return False, f"{names} only"
    if kernel.load_library() is None:
        return False, f"{kernel.SOURCE.name} could not be built (see its warning)"
    if not available(_cache_probe(dtype, shape), shape.num_heads):
        return False, (f"the kernel does not take {shape.num_heads} heads over {shape.num_kv_heads} of size "
                       f"{shape.head_dim}")
    return True, why


def _cache_probe(dtype: torch.dtype, shape: ModelShape) -> torch.Tensor:
    return torch.empty((1, 16, shape.num_kv_heads, shape.head_dim), dtype=dtype)

