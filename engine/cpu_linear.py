"""oneDNN matmuls for the CPU path: each nn.Linear runs on a weight packed once.

torch's CPU ``nn.Linear`` calls MKL's sgemm. oneDNN's linear over a weight reordered
once into its blocked layout is faster on the shapes a decoder runs (2-core AVX-512
worker, hidden 512, float32: about 200 GFLOP/s against MKL's 120-140, for 64 to
2048 rows; bench/bench_engine.py prints both peaks). The packed weight is an opaque
oneDNN tensor held beside the module's own weight, which stays untouched for
everything else that reads it (tied embeddings, LoRA, state dicts): on CPU the
linear weights are held twice.

Only float32 and bfloat16 pack (oneDNN has no float64 matmul), bfloat16 only where
oneDNN reports support for it; float64 keeps torch's exact-reference path. Whether
the engine packs at all is its CPU path choice (engine/cpu_paths.py), measured
against torch's matmul on the host.

Gated MLPs (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the Llama family's)
run their gate and up projections as one matmul over both weights packed together,
which pays on prefill steps (a 2048-row step: 47 against 55 ms per MLP), and SiLU
times up in one pass of the fused kernel (kernels/cpu_fused.c) when that reproduces
the module's ``act_fn``. A module gets the fused forward only if it gives its own
forward's output on a probe input, so a model whose MLP differs keeps its own.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

from .kernels.cpu_fused import fused_kernels_available, silu_mul

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs oneDNN's packed linear in ``dtype`` on this CPU:
    oneDNN's own support query (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT),
    then a probe that must give torch's own answer."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        x = torch.arange(16, dtype=torch.float32).view(2, 8).to(dtype)
        weight = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, nn.functional.linear(x, weight)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def pack_linears(model: nn.Module, rows_hint: int, dtypes: tuple[torch.dtype, ...] = PACKABLE_DTYPES) -> int:
    """Run every CPU nn.Linear of ``model`` whose weight is of one of ``dtypes`` through
    oneDNN on a packed copy of its weight, where oneDNN runs that dtype here; returns
    how many were packed.

    ``rows_hint`` is the number of rows oneDNN tunes the packed layout for; any number
    of rows runs on it.
    """
    dtypes = tuple(dtype for dtype in dtypes if onednn_linear_available(dtype))
    num_packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        if module.bias is not None and module.bias.dtype != weight.dtype:
            continue
        module.shardline_packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        module.forward = types.MethodType(_packed_forward, module)
        num_packed += 1
    return num_packed


# oneDNN builds and caches a kernel per distinct row count (about 0.6 MB each, up to
# its cache's 1024 entries per layer shape), and a continuous batch sees almost every
# row count between 1 and its token budget: the cache would grow with the run. Rows
# are padded with zeros to a bucket instead (multiples of SMALL_ROWS up to LARGE_ROWS,
# then multiples of LARGE_ROWS), so each layer shape meets at most a few dozen
# row counts. Padding decode batches costs little (their matmuls are bound by
# reading the weights); a full prefill step is already a multiple of LARGE_ROWS.
SMALL_ROWS = 16
LARGE_ROWS = 256


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN sees for ``rows`` rows."""
    step = SMALL_ROWS if rows <= LARGE_ROWS else LARGE_ROWS
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in_features] -> [..., out_features]
    # Autograd does not see through the packed weight: with gradients on, use torch's linear.
    if _needs_torch(x, self.weight):
        return nn.functional.linear(x, self.weight, self.bias)
    return packed_matmul(x, self.shardline_packed_weight, self.bias)


def _needs_torch(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype != weight.dtype or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    bucket = row_bucket(rows)
    if bucket != rows:
        flat = torch.cat([flat, flat.new_zeros(bucket - rows, flat.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def fuse_gated_mlps(model: nn.Module, rows_hint: int, silu_kernel: bool = True) -> int:
    """Give every gated MLP whose projections were packed one matmul for gate and up
    (see the module docstring), and SiLU times up through the fused kernel when
    ``silu_kernel`` and that reproduces ``act_fn``; returns how many were fused."""
    num_fused = 0
    for module in model.modules():
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        if not (is_packed(gate) and is_packed(up) and is_packed(getattr(module, "down_proj", None))
                and callable(getattr(module, "act_fn", None))):
            continue
        if gate.bias is not None or up.bias is not None or gate.weight.shape != up.weight.shape \
                or gate.weight.dtype != up.weight.dtype or "forward" in vars(module):  # a hooked forward stays
            continue
        probe = torch.randn(3, gate.in_features, dtype=gate.weight.dtype, generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                expected = module(probe)
        except Exception:  # a forward that wants more than the hidden states: not this pattern
            continue
        with torch.no_grad():
            module.shardline_packed_gate_up, _ = pack_side_by_side((gate, up), rows_hint)
            module.forward = types.MethodType(_fused_gated_mlp_forward, module)
            # SiLU through the fused kernel if that reproduces act_fn, else act_fn itself.
            kernel = silu_kernel and fused_kernels_available(gate.weight.dtype)
            for use_kernel in (True, False) if kernel else (False,):
                module.shardline_silu_mul = use_kernel
                fused = module(probe)
                if reproduces(fused, expected):
                    break
            else:
                fused = None
        if fused is not None:
            for projection in (gate, up):  # their own packed copies are no longer read
                del projection.shardline_packed_weight, projection.forward
            num_fused += 1
        else:
            del module.shardline_packed_gate_up, module.forward, module.shardline_silu_mul
            logger.info("%s does not compute down(act(gate(x)) * up(x)); its MLP stays unfused",
                        type(module).__name__)
    return num_fused


def reproduces(actual: object, expected: object, bfloat16_tolerance: float = 1e-2) -> bool:
    """Whether a replacement forward's output on a probe is the module's own: close to
    1e-4 (``bfloat16_tolerance`` in bfloat16), relative to the output's largest value."""
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return False
    tolerance = bfloat16_tolerance if expected.dtype == torch.bfloat16 else 1e-4
    return actual.shape == expected.shape and torch.allclose(
        actual.float(), expected.float(), rtol=tolerance, atol=tolerance * float(expected.abs().max()))


def is_packed(module: object) -> bool:
    return isinstance(module, nn.Linear) and hasattr(module, "shardline_packed_weight")


def packable_side_by_side(linears: tuple[object, ...]) -> bool:
    """Whether ``pack_side_by_side`` takes these: packed linears of one input size and
    dtype, each with a bias or none with one."""
    return (all(is_packed(linear) for linear in linears)
            and len({(linear.in_features, linear.weight.dtype, linear.bias is None) for linear in linears}) == 1)


def pack_side_by_side(linears: tuple[nn.Linear, ...], rows_hint: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed weight, and bias or None, that computes all of ``linears`` (see
    ``packable_side_by_side``) on the same input in one matmul, their outputs side by
    side in the given order."""
    assert packable_side_by_side(linears)
    biases = [linear.bias for linear in linears]
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint), bias


def _fused_gated_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x: [..., hidden] -> [..., hidden]; gate and up are the two halves of one matmul's output.
    gate_proj, up_proj = self.gate_proj, self.up_proj
    if _needs_torch(x, gate_proj.weight):
        gate, up = nn.functional.linear(x, gate_proj.weight), nn.functional.linear(x, up_proj.weight)
        return self.down_proj(self.act_fn(gate) * up)
    gate_up = packed_matmul(x, self.shardline_packed_gate_up, None)
    if self.shardline_silu_mul:  # one pass, no temporaries (kernels/cpu_fused.c)
        return self.down_proj(silu_mul(gate_up.view(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1))
    gate, up = gate_up.split(gate_proj.out_features, dim=-1)
    return self.down_proj(self.act_fn(gate).mul_(up))
