"""How the quantized Triton kernels tile their launches: the jitted helpers for a
program's output tile and K range, and the host-side plan (tile sizes, split-K, the dot
dtype), shared by quant_linear.py, fp8_w8a8.py and the MoE kernels.

Split-K: a decode-sized grid has too few programs to stream a weight at the GPU's
bandwidth, so K is cut into ranges whose float32 partial sums are added after the kernel
(with the bias) and rounded to the activations' dtype once: the result is still the
float32 product rounded once, in another summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import interpreter_active, tl, triton

if triton is not None:

    @triton.jit
    def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's row and column offsets, row tiles taken GROUP_M at a time."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def split_k_range(K, k_per_split, out_ptr, stride_split):
        """This program's K range [k_start, k_end) and its output (its split's partial sums)."""
        split = tl.program_id(1)
        k_start = split * k_per_split
        return k_start, tl.minimum(k_start + k_per_split, K), out_ptr + split.to(tl.int64) * stride_split

    @triton.jit
    def store_output_tile(acc, rows, cols, M, N, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def dot_dtype(dtype: torch.dtype):
    """The dtype the tiles meet in tl.dot: the activation's own, except float32 for
    bfloat16 under the interpreter (it stores bfloat16 as raw uint16 and cannot multiply it)."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreter_active():
        return tl.bfloat16
    return tl.float32


def tile_k_for(block: int, largest: int = 128, smallest: int = 16) -> int | None:
    """The largest power-of-two K tile in [smallest, largest] dividing ``block``, or None."""
    tile = largest
    while tile >= smallest:
        if block % tile == 0:
            return tile
        tile //= 2
    return None


def _tile_mn(num_rows: int, num_cols: int) -> tuple[int, int]:
    """BLOCK_M, BLOCK_N: 16-row tiles (tl.dot's minimum) for decode-sized batches,
    larger ones when rows are many enough to reuse each weight tile."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64 if num_rows <= 64 else 128
    block_n = 64 if num_rows <= 64 or num_cols <= 64 else 128
    return block_m, block_n


@dataclass(frozen=True)
class TilePlan:
    """A launch's tiling: BLOCK_M x BLOCK_N output tiles walking K in BLOCK_K tiles, K cut
    into ``split_k`` ranges of ``k_per_split`` columns (a multiple of BLOCK_K) whose float32
    partial sums are added after the kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int

    def grid(self, num_rows: int, out_features: int) -> tuple[int, int]:
        return -(-num_rows // self.block_m) * -(-out_features // self.block_n), self.split_k

    def output(self, num_rows: int, out_features: int, x: torch.Tensor) -> torch.Tensor:
        """[M, N] in x's dtype, or the splits' float32 partial sums [split_k, M, N]."""
        if self.split_k == 1:
            return torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
        return torch.empty((self.split_k, num_rows, out_features), dtype=torch.float32, device=x.device)

    def finish(self, out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The [M, N] result: the partial sums (and the bias, which the kernel leaves to this
        when K is split) added in float32 and rounded once."""
        if self.split_k == 1:
            return out
        total = out.sum(dim=0)
        if bias is not None:
            total += bias.float()
        return total.to(dtype)


def output_strides(out: torch.Tensor) -> tuple[int, int]:
    """(row stride, split stride) of a TilePlan.output buffer."""
    return (out.stride(1), out.stride(0)) if out.dim() == 3 else (out.stride(0), 0)


def plan_tiles(num_rows: int, out_features: int, in_features: int, block_k: int, device: torch.device,
               split_k: int | None) -> TilePlan:
    """The tiling for an [M, K] x [K, N] launch; ``split_k`` None: chosen for the device."""
    block_m, block_n = _tile_mn(num_rows, out_features)
    k_tiles = -(-in_features // block_k)
    if split_k is None:
        split_k = _default_split_k(-(-num_rows // block_m) * -(-out_features // block_n), k_tiles, device)
    tiles_per_split = -(-k_tiles // max(1, min(split_k, k_tiles)))
    return TilePlan(block_m, block_n, block_k, -(-k_tiles // tiles_per_split), tiles_per_split * block_k)


def _default_split_k(tiles: int, k_tiles: int, device: torch.device) -> int:
    """Decode-sized grids have too few programs to stream a weight at the GPU's bandwidth:
    K is split until there are about four programs per SM, each keeping four K tiles or more."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-4 * sms // tiles), k_tiles // 4, 16))
