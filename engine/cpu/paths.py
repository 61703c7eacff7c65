"""Which fast paths the CPU engine takes on this host, chosen once when it loads.

Each path is taken only where the host can run it, by what the libraries report of
themselves, never by an assumed instruction set:
- packed linears: torch built with oneDNN and a probe matmul that must give torch's
  answer; for bfloat16, oneDNN's own bfloat16 support query (it needs AVX-512
  BW/VL/DQ or AVX-NE-CONVERT). Where that query says no, bfloat16 linears can be
  packed as float32 copies instead (cpu/linear.py), if twice their weights' memory
  is free;
- fused elementwise kernels, native decode and prefill attention, the recurrent
  layers' kernel (convolutions, gated delta-net and Kimi delta attention cores): a C
  compiler, the library built for the kernel target (kernels/native.py), the dtype.

Where two correct paths exist, the faster one is chosen by measurement on the
model's own shapes: packed oneDNN linears (or their float32 copies) against torch's
matmul, the native prefill
kernel against SDPA. Each measurement is cached per host, library configuration and
shape in the cache directory, so a host pays it once (a few hundred milliseconds at
most). Native decode attention needs no race: it reads each context row once where
the torch path gathers the paged blocks into a padded copy first.

``SHARDLINE_CPU_PATHS`` sets paths by name: ``prefill_kernel=off`` never takes one,
``packed_linears=on`` takes one wherever the host can run it without measuring, and
``all=off`` runs the plain torch path. The tests run every fallback this way on any
host. The choice, with
its reasons, is logged once at load and kept on the engine (``LLMEngine.cpu_paths``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels import native
from .hybrid_layers import optimize_hybrid_layers
from .layers import fuse_decoder_layers, fuse_rms_norms
from .linear import fuse_gated_mlps, onednn_linear_available, pack_linears, packed_matmul
from .recurrent_core import take_native_core

logger = logging.getLogger(__name__)

PATH_NAMES = ("packed_linears", "fused_kernels", "decode_kernel", "prefill_kernel", "recurrent_kernel")
# A measured alternative replaces the default path only when at least this much faster.
MARGIN = 1.1


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

    def describe(self) -> str:
        kernels = f"{self.kernel_isa} (-march={self.kernel_target})" if self.kernel_isa else "none (no C compiler)"
        return (f"{self.model} ({self.machine}); torch kernels {self.torch_isa}; C kernels {kernels}; "
                f"oneDNN {'yes' if self.onednn else 'no'}, bfloat16 {'yes' if self.onednn_bfloat16 else 'no'}")


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
    )


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
    def of(cls, model: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> "ModelShape":
        """The decoder's width and its widest linear on the hidden states (the LM head,
        as wide as the vocabulary, aside)."""
        hidden_size = model.get_input_embeddings().weight.shape[1]
        vocab_size = model.get_input_embeddings().weight.shape[0]
        linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
        widths = [module.out_features for module in linears
                  if module.in_features == hidden_size and module.out_features != vocab_size]
        return cls(hidden_size, max(widths, default=hidden_size), num_heads, num_kv_heads, head_dim,
                   linear_weights=sum(module.weight.numel() for module in linears))


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
    packed_dtype = _packed_dtype(host, dtype)
    checks = {
        "packed_linears": (_packed_linears(host, dtype, shape),
                           lambda: _linear_speedup(dtype, packed_dtype or dtype, shape, rows_hint), "torch's matmul"),
        "fused_kernels": (_fused_kernels(dtype), None, ""),
        "decode_kernel": (_decode_kernel(dtype, shape), None, ""),
        "prefill_kernel": (_prefill_kernel(dtype, shape), lambda: _prefill_speedup(dtype, shape), "SDPA"),
        "recurrent_kernel": (_recurrent_kernel(dtype), None, ""),
    }
    choices, reasons = {}, []
    for name, ((capable, why), measure, alternative) in checks.items():
        setting = settings.get(name)
        # How the path would run, where that is not the only way (float32 copies).
        how = f" {why}" if capable and name == "packed_linears" and packed_dtype is not None else ""
        if not capable or setting is False:
            taken, why = False, why if not capable else "turned off by SHARDLINE_CPU_PATHS"
        elif setting is True or measure is None:
            taken, why = True, why if setting is None else f"turned on by SHARDLINE_CPU_PATHS{how}"
        else:
            speedup = _measured(name, (dtype, packed_dtype, shape, rows_hint) if name == "packed_linears"
                                else (dtype, shape, rows_hint), measure)
            taken, why = speedup >= 1 / MARGIN, f"measured {speedup:.2f}x {alternative}{how}"
        choices[name] = taken
        reasons.append((name, why))
    paths = CpuPaths(dtype, **choices, packed_dtype=packed_dtype if choices["packed_linears"] else None,
                     reasons=tuple(reasons))
    logger.info("CPU paths for %s on %s: %s", str(dtype).removeprefix("torch."), host.describe(), paths.describe())
    return paths


def _packed_dtype(host: HostCpu, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype packed copies of ``dtype`` linears would take where it is not
    ``dtype``: float32 for bfloat16 where oneDNN has no bfloat16."""
    return torch.float32 if dtype == torch.bfloat16 and host.onednn and not host.onednn_bfloat16 else None


# The float32 copies of a bfloat16 model's linears are taken only if this many times
# their size is free: the KV cache and the step's temporaries come after them.
COPY_HEADROOM = 2


def _packed_linears(host: HostCpu, dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"oneDNN has no {str(dtype).removeprefix('torch.')} matmul"
    if not host.onednn:
        return False, "torch built without oneDNN"
    packed_dtype = _packed_dtype(host, dtype) or dtype
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


def _fused_kernels(dtype: torch.dtype) -> tuple[bool, str]:
    from ..kernels.cpu_fused import SOURCE, fused_kernels_available

    if dtype not in (torch.float32, torch.bfloat16):
        return False, "float32 and bfloat16 only"
    if not fused_kernels_available(dtype):
        return False, f"{SOURCE.name} could not be built (see its warning)"
    return True, "built"


def _recurrent_kernel(dtype: torch.dtype) -> tuple[bool, str]:
    from ..kernels import cpu_recurrent

    if dtype not in cpu_recurrent.DTYPES:
        return False, "float32 and float64 only"
    if cpu_recurrent.load_library() is None:
        return False, f"{cpu_recurrent.SOURCE.name} could not be built (see its warning)"
    return True, "built"


def _decode_kernel(dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    from ..kernels import cpu_attention

    return _attention_kernel(cpu_attention, cpu_attention.decode_kernel_available, dtype, shape,
                             "reads each context row once")


def _prefill_kernel(dtype: torch.dtype, shape: ModelShape) -> tuple[bool, str]:
    from ..kernels import cpu_prefill_attention

    return _attention_kernel(cpu_prefill_attention, cpu_prefill_attention.prefill_kernel_available, dtype, shape,
                             "built")


def _attention_kernel(kernel: object, available: Callable[[torch.Tensor, int], bool], dtype: torch.dtype,
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
        packed = pack_linears(model, rows_hint, dtypes=(paths.dtype,), packed_dtype=paths.packed_dtype)
        mlps = fuse_gated_mlps(model, rows_hint, silu_kernel=paths.fused_kernels)
    if paths.fused_kernels:
        norms = fuse_rms_norms(model)
        layers = fuse_decoder_layers(model, rows_hint)
    # Hybrid models' own norms, projections and layers (hybrid_layers.py; none for other models).
    hybrid = optimize_hybrid_layers(model, paths.fused_kernels, rows_hint)
    others = hybrid.others
    if paths.recurrent_kernel:  # recurrent layers' convolutions and delta rules through the C kernel
        others += take_native_core(model)
    rewrites = CpuRewrites(packed, mlps, norms + hybrid.norms, layers + hybrid.layers, others)
    logger.info("CPU modules replaced: %s", rewrites)
    return rewrites


# -------------------------------------------------------------- measurements

def _measured(kind: str, key: tuple, measure: Callable[[], float]) -> float:
    """``measure()`` (how many times faster the default path is than its
    alternative), cached per host, library configuration and ``key``."""
    path = native.cache_dir().parent / "cpu_paths.json"
    entry = hashlib.sha256(repr((kind, key, _host_key())).encode()).hexdigest()[:24]
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(entry), float):
        return cached[entry]
    speedup = measure()
    cached[entry] = speedup
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(cached, indent=0))
        os.replace(scratch, path)
    except OSError as error:  # a read-only cache directory: measured again next time
        logger.debug("could not cache a CPU path measurement in %s: %s", path, error)
    return speedup


@functools.lru_cache(maxsize=1)
def _host_key() -> str:
    """What a measurement depends on besides its shape: the CPU, torch, the thread
    count, the C kernels' sources and build, and every setting that changes which
    instructions the libraries use."""
    settings = {name: os.environ.get(name, "") for name in (
        "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    return repr((native.cpu_signature(), torch.__version__, torch.get_num_threads(), native.kernel_target(),
                 native.kernel_sources_digest(), sorted(settings.items())))


def _race(default: Callable[[], object], alternative: Callable[[], object], rounds: int = 5) -> float:
    """Best time of ``alternative`` over best time of ``default``, run interleaved
    (a slow phase of the machine hits both). On one thread both run on the calling
    thread and are timed by its CPU time, which other work on the machine does not
    inflate; on several, by the wall clock."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    default(), alternative()  # warm up: oneDNN and the kernels build their code on first use
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for index, run in enumerate((default, alternative)):
            start = clock()
            run()
            best[index] = min(best[index], clock() - start)
    return best[1] / best[0]


# The measured matmul: the model's input width, at most this many outputs and rows
# (the speed ratio settles well below a large model's sizes; the cost stays bounded).
MEASURED_OUTPUTS = 2048
MEASURED_ROWS = (16, 256)


@torch.inference_mode()
def _linear_speedup(dtype: torch.dtype, packed_dtype: torch.dtype, shape: ModelShape, rows_hint: int) -> float:
    """How many times faster a packed linear of ``packed_dtype`` runs ``dtype`` inputs
    than torch's matmul runs them in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(min(shape.widest_linear, MEASURED_OUTPUTS), shape.hidden_size, generator=generator)
    weight = weight.to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(packed_dtype), rows_hint)
    inputs = [torch.randn(rows, shape.hidden_size, generator=generator).to(dtype) for rows in MEASURED_ROWS]
    return _race(lambda: [packed_matmul(x, packed, None) for x in inputs],
                 lambda: [F.linear(x, weight) for x in inputs])


# The measured prefill: fresh prompts of these lengths, one SDPA call each on the alternative.
MEASURED_PROMPTS = (48, 160, 300)


@torch.inference_mode()
def _prefill_speedup(dtype: torch.dtype, shape: ModelShape) -> float:
    from ..kernels.cpu_prefill_attention import prefill_attention

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
        prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, requests, out, scale)

    def sdpa() -> None:
        for first, end in zip(starts, starts[1:]):
            F.scaled_dot_product_attention(*(x[first:end].transpose(0, 1) for x in (query, key, value)),
                                           is_causal=True, scale=scale, enable_gqa=True)

    return _race(kernel, sdpa)
