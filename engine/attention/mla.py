"""Multi-head latent attention over a paged cache of latents, in plain torch.

A latent layer (deepseek_v2/v3's attention) derives every head's key and value from
one compressed vector per token: k_nope = W_UK c, v = W_UV c, with c the normalized
``kv_lora_rank``-wide latent, and one rotary key k_rope shared by all heads. So the
cache holds per token [c, k_rope] (kv_lora_rank + qk_rope_head_dim numbers) for all
heads together, laid out [num_blocks, block_size, kv_lora_rank + rope_dim], instead
of H keys and values.

Two exact ways to attend it, one result:
- up-projected (a prompt's many queries): rebuild each context token's k_nope and v
  from the latent, then attend as multi-head attention;
- absorbed (a decode step's one query per request): fold W_UK into the query
  (q_lat = q_nope W_UK, per head kv_lora_rank wide), score against the latents
  directly, and apply W_UV to the weighted sum of latents; no per-head key or value
  is ever formed, so a step reads S x (kv_lora_rank + rope_dim) numbers per request.
  On the CPU's decode kernel path the one-query requests of a step attend absorbed
  through the C kernel (kernels/cpu_mla.py), on the Triton backend through the Triton
  kernel (kernels/mla_decode.py), all in one call; prompt chunks always up-project
  here, in torch. ``latent_decode_triton`` is a decode step's whole attention on the
  Triton backend without reading anything back to the host, so CUDA graphs record it.

Positions: request b's queries are its last ``query_len`` positions of ``seq_lens[b]``
and each sees the keys at or before its own position; with a sparse attention's
selection (engine/attention/sparse_index.py) only the keys selected for it, in torch
(a request whose queries select every key they see takes the kernels as any other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import mla_decode as triton_mla
from ..kernels.cpu_mla import mla_decode, mla_decode_available
from .latent_window import visible_keys, window_start
from .sparse_index import Selection

DECODE_KERNELS = ("c", "triton")


def split_up_projection(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int,
                        value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (nope_dim + value_dim), kv_lora_rank] (per head the key
    rows, then the value rows) as (W_UK [H, nope_dim, r], W_UV [H, value_dim, r])."""
    rows, rank = kv_b_weight.shape
    if rows != num_heads * (nope_dim + value_dim):
        raise ValueError(f"kv_b_proj's weight has {rows} rows; {num_heads} heads of {nope_dim} key and "
                         f"{value_dim} value numbers need {num_heads * (nope_dim + value_dim)}")
    per_head = kv_b_weight.view(num_heads, nope_dim + value_dim, rank)
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def write_latent(latent_cache: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store the step's tokens: latent [T, r] and rope_key [T, dr] into latent_cache
    [N, bs, r + dr] at slot_mapping [T] (block_id * bs + offset)."""
    width = latent.shape[-1] + rope_key.shape[-1]
    if latent_cache.shape[-1] != width:
        raise ValueError(f"a latent of {latent.shape[-1]} and a rotary key of {rope_key.shape[-1]} numbers "
                         f"do not fill the latent cache's {latent_cache.shape[-1]} per token")
    rows = torch.cat([latent, rope_key], dim=-1).to(latent_cache.dtype)
    latent_cache.view(-1, width).index_copy_(0, slot_mapping, rows)


def _context(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0) -> torch.Tensor:
    """One request's [seq_len - first, r + dr] context from position ``first`` on, read
    through its block table."""
    block_size = latent_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = latent_cache.index_select(0, block_table[first // block_size:num_blocks].long())
    skipped = first // block_size * block_size
    return blocks.reshape(-1, latent_cache.shape[-1])[first - skipped:seq_len - skipped]


def latent_paged_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                           absorb_up_to: int = 1, decode_kernel: str | None = None,
                           selections: Sequence[Selection] | None = None,
                           sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of the packed queries (q_nope [T, H, dn], q_rope [T, H, dr]) over each
    request's latent context; requests of at most ``absorb_up_to`` queries attend
    absorbed, the others up-projected. With ``decode_kernel`` "c", the one-query
    requests attend through the C kernel (kernels/cpu_mla.py) where it takes the cache,
    with "triton" through the Triton kernel (kernels/mla_decode.py), all together.
    ``selections``: per request the keys each query attends (a sparse attention's
    indexer), None for a request attending causally; a selected request attends in torch.
    ``sinks`` [H]: a learned logit per head that joins each softmax and attends to no
    value (the kernels take none: every request attends in torch). ``sliding_window``: a
    query at p sees keys p - sliding_window + 1 .. p (latent_window.py); a request whose
    window cuts its context attends in torch. Returns [T, H, dv]."""
    if decode_kernel is not None and decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS} or None, got {decode_kernel!r}")
    rank = w_uk.shape[-1]
    if latent_cache.shape[-1] != rank + q_rope.shape[-1]:
        raise ValueError(f"the latent cache holds {latent_cache.shape[-1]} numbers per token; a latent of {rank} "
                         f"and a rotary key of {q_rope.shape[-1]} need {rank + q_rope.shape[-1]}")
    output = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]))
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if selections is not None and len(selections) != len(lens):
        raise ValueError(f"{len(selections)} selections for {len(lens)} requests")
    decoding = [request for request in range(len(lens)) if starts[request + 1] - starts[request] == 1
                and (selections is None or selections[request] is None)
                and (sliding_window is None or lens[request] <= sliding_window)]
    kernel_takes = sinks is None and (
        decode_kernel == "triton" or (decode_kernel == "c" and mla_decode_available(latent_cache)))
    if decoding and kernel_takes and latent_cache.dtype == q_nope.dtype:
        _kernel_decode(output, q_nope, q_rope, latent_cache, decoding, [starts[r] for r in decoding], seq_lens,
                       block_tables, w_uk, w_uv, scale, decode_kernel == "triton")
        taken = set(decoding)
    else:
        taken = set()
    for request, seq_len in enumerate(lens):
        first, end = starts[request], starts[request + 1]
        if end == first or request in taken:
            continue
        start = window_start(seq_len, end - first, sliding_window)
        context = _context(latent_cache, block_tables[request], seq_len, start).to(q_nope.dtype)
        latent, rope_key = context[:, :rank], context[:, rank:]
        attend = _absorbed if end - first <= absorb_up_to else _up_projected
        selected = visible_keys(end - first, seq_len, start, sliding_window,
                                selections[request] if selections is not None else None, q_nope.device)
        output[first:end] = attend(q_nope[first:end], q_rope[first:end], latent, rope_key, w_uk, w_uv, scale,
                                   selected, sinks)
    return output


def _kernel_decode(output: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                   requests: list[int], rows: list[int], seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, triton: bool) -> None:
    """The one-query ``requests`` (their packed ``rows``) through the C kernel, or the
    Triton kernel with ``triton``: the absorbed queries [n, H, r + dr] in, the weighted
    latents out, W_UV applied here."""
    row_index = torch.tensor(rows, dtype=torch.int64, device=q_nope.device)
    request_index = torch.tensor(requests, dtype=torch.int64, device=q_nope.device)
    q_abs = _absorbed_query(q_nope[row_index], q_rope[row_index], w_uk)
    tables = block_tables[request_index].to(torch.int32).contiguous()
    if triton:
        lens = seq_lens[request_index].to(torch.int32).contiguous()
        out_latent = triton_mla.mla_decode_triton(q_abs, latent_cache, tables, lens, w_uk.shape[-1], scale)
    else:
        lens = seq_lens[request_index].to(torch.int64).contiguous()
        out_latent = mla_decode(q_abs, latent_cache, tables, lens, w_uk.shape[-1], scale)
    output[row_index] = torch.einsum("nhr,hvr->nhv", out_latent, w_uv.to(q_nope.dtype))


def latent_decode_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """A step of one query per request, packed row b request b (q_nope [B, H, dn],
    q_rope [B, H, dr]; seq_lens [B] int32, block_tables [B, max_blocks] int32), through
    the Triton kernel absorbed: fixed shapes and no host reads, so a CUDA graph
    records it. A request of context 0 (a graph's padding row) gets zeros. Returns
    [B, H, dv]."""
    if latent_cache.dtype != q_nope.dtype:
        raise ValueError(f"the latent cache holds {latent_cache.dtype} and the queries are {q_nope.dtype}; the "
                         "Triton decode kernel reads both in one dtype")
    q_abs = _absorbed_query(q_nope, q_rope, w_uk)
    out_latent = triton_mla.mla_decode_triton(q_abs, latent_cache, block_tables, seq_lens, w_uk.shape[-1], scale)
    return torch.einsum("nhr,hvr->nhv", out_latent, w_uv.to(q_nope.dtype))


def _absorbed_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_nope W_UK, q_rope] per head: [n, H, r + dr], contiguous."""
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_latent, q_rope], dim=-1).contiguous()


def _causal_softmax(scores: torch.Tensor, selected: Selection = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """softmax over keys of scores [H, n, S], query i at position S - n + i seeing keys
    at or before it, or the keys ``selected`` [n, S] marks for it; with ``sinks`` [H],
    each head's sink logit joins the softmax (its weight dropped after)."""
    num_queries, seq_len = scores.shape[1], scores.shape[2]
    if selected is None:
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=scores.device)[:, None]
        selected = torch.arange(seq_len, device=scores.device)[None, :] <= query_pos
    masked = scores.masked_fill(~selected, float("-inf"))
    if sinks is None:
        return masked.softmax(dim=-1)
    logits = torch.cat([masked, sinks.to(masked.dtype)[:, None, None].expand(-1, num_queries, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return logits.softmax(dim=-1)[..., :-1]


def _absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
              w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, selected: Selection = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk.to(q_nope.dtype))
    scores = torch.einsum("nhr,sr->hns", q_latent, latent) + torch.einsum("nhd,sd->hns", q_rope, rope_key)
    weights = _causal_softmax(scores * scale, selected, sinks)
    out_latent = torch.einsum("hns,sr->nhr", weights, latent)
    return torch.einsum("nhr,hvr->nhv", out_latent, w_uv.to(q_nope.dtype))


def _up_projected(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                  w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, selected: Selection = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    key_nope = torch.einsum("sr,hdr->shd", latent, w_uk.to(q_nope.dtype))
    value = torch.einsum("sr,hvr->shv", latent, w_uv.to(q_nope.dtype))
    scores = torch.einsum("nhd,shd->hns", q_nope, key_nope) + torch.einsum("nhd,sd->hns", q_rope, rope_key)
    weights = _causal_softmax(scores * scale, selected, sinks)
    return torch.einsum("hns,shv->nhv", weights, value)
