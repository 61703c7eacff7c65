"""Paged absorbed multi-head latent attention decode as one Triton kernel.

A latent layer (engine/attention/mla.py) caches per token one row [c, k_rope]
(W = R + DR numbers: the kv_lora_rank-wide latent, then the rotary key) for all heads.
A decode step's absorbed query per head, q_abs = [q_nope W_UK, q_rope] (W numbers),
scores each row whole and weights the rows' latents; the kernel returns those weighted
latents per head ([n, H, R]) and the caller applies W_UV.

One program attends one request for BLOCK_H heads (at least 16: tl.dot's minimum,
extra heads masked): it walks the request's context BLOCK_N positions at a time,
each position's row found through the block table, so every row is read once per
run of heads; scores = q_lat c^T + q_rope k_rope^T as two [BLOCK_H, BLOCK_N] products,
an online softmax (running max, running sum), acc += p c; rows and queries are widened
to float32 as loaded and every product is IEEE float32, as the torch path computes
(not tensor-core bfloat16 or TF32). The plain-torch
reference is kernels/cpu_mla.py's ``mla_decode_reference``.

Layout (asserted by the launcher): q_abs [n, H, W] contiguous; latent_cache
[num_blocks, block_size, W] contiguous, q_abs's dtype (float16, bfloat16, float32);
block_tables [n, max_blocks] int32 with unit last stride; seq_lens [n] int32 or int64
(context length with the new token; 0 for a row that attends nothing, such as a CUDA
graph's padding row, whose output is zeros).
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton
from .cpu_mla import mla_decode_reference

__all__ = ["mla_decode_reference", "mla_decode_triton"]

BLOCK_H = 16  # heads per program
BLOCK_N = 32  # context positions per step

if triton is not None:

    @triton.jit
    def _mla_decode_kernel(
        q_ptr, cache_ptr, table_ptr, seq_lens_ptr, out_ptr, scale, table_stride,
        NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P: tl.constexpr,
        ROPE_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < NUM_HEADS
        width = RANK + ROPE
        rank_cols = tl.arange(0, RANK_P)
        rope_cols = tl.arange(0, ROPE_P)
        rank_ok = rank_cols < RANK
        rope_ok = rope_cols < ROPE
        q_rows = q_ptr + (request * NUM_HEADS + heads[:, None]) * width
        q_lat = tl.load(q_rows + rank_cols[None, :], mask=head_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
        q_rope = tl.load(q_rows + RANK + rope_cols[None, :], mask=head_ok[:, None] & rope_ok[None, :],
                         other=0.0).to(tl.float32)
        seq_len = tl.load(seq_lens_ptr + request)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, RANK_P), tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            positions = start + tl.arange(0, BLOCK_N)
            valid = positions < seq_len
            blocks = tl.load(table_ptr + request * table_stride + positions // PAGE, mask=valid, other=0)
            rows = cache_ptr + (blocks.to(tl.int64) * PAGE + positions % PAGE)[:, None] * width
            latent = tl.load(rows + rank_cols[None, :], mask=valid[:, None] & rank_ok[None, :],
                             other=0.0).to(tl.float32)
            rope_key = tl.load(rows + RANK + rope_cols[None, :], mask=valid[:, None] & rope_ok[None, :],
                               other=0.0).to(tl.float32)
            scores = (tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
                      + tl.dot(q_rope, tl.trans(rope_key), input_precision="ieee")) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            correction = tl.exp(m - new_m)
            p = tl.exp(scores - new_m[:, None])
            s = s * correction + tl.sum(p, axis=1)
            acc = acc * correction[:, None] + tl.dot(p, latent, input_precision="ieee")
            m = new_m
        out = acc / tl.where(s > 0, s, 1.0)[:, None]  # context 0 (a padding row): zeros
        out_rows = out_ptr + (request * NUM_HEADS + heads[:, None]) * RANK + rank_cols[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & rank_ok[None, :])


def mla_decode_triton(q_abs: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """Each request's absorbed query (q_abs [n, H, W]) over its paged latent context:
    the weighted latents [n, H, rank] in q_abs's dtype (see the module docstring)."""
    require_triton()
    check_kernel_dtype("q_abs", q_abs)
    num_requests, num_heads, width = q_abs.shape
    assert q_abs.is_contiguous() and latent_cache.is_contiguous(), "q_abs and latent_cache must be contiguous"
    assert latent_cache.dtype == q_abs.dtype, (latent_cache.dtype, q_abs.dtype)
    assert latent_cache.dim() == 3 and latent_cache.shape[2] == width and 0 < rank < width, (latent_cache.shape, rank)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and block_tables.shape[0] == num_requests
    assert seq_lens.dtype in (torch.int32, torch.int64) and seq_lens.shape == (num_requests,)
    assert q_abs.device == latent_cache.device == block_tables.device == seq_lens.device
    out = q_abs.new_empty((num_requests, num_heads, rank))
    if num_requests == 0:
        return out
    grid = (num_requests, triton.cdiv(num_heads, BLOCK_H))
    launcher(_mla_decode_kernel, grid)(
        q_abs, latent_cache, block_tables, seq_lens.contiguous(), out, float(scale), block_tables.stride(0),
        NUM_HEADS=num_heads, RANK=rank, ROPE=width - rank, RANK_P=max(16, next_power_of_2(rank)),
        ROPE_P=max(16, next_power_of_2(width - rank)), PAGE=latent_cache.shape[1], BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N)
    return out
