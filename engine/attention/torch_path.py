"""The plain-torch paged attention: the CPU path of ``attention.paged_attention_forward``.

Each step's requests are split into groups (``attention_groups``, with the plans that
gather them, in torch_plans.py). For each group the
K/V blocks of its requests are copied out of the paged cache into a padded
[b, Hkv, L, D] tile, a whole block at a time, and attended with SDPA.

Decoding requests (one query token) dominate a long generation, and their attention
is bound by reading the context. They are grouped DECODE_GROUP_SIZE at a time in
order of context length, so a group's copied K/V is still in the CPU's caches when
SDPA reads it (the context comes from memory about once per layer, not twice) and
padding to the group's longest context stays small. Their query heads are folded
per KV head ([b, Hkv, G, D]), so SDPA reads each key once per KV head, not once per
query head.

Prefill chunks are compute bound. A fresh prompt (no cached context: its keys and
values are exactly the step's new ones) is attended straight from the step's packed
queries, keys and values with one SDPA call in causal mode: no copy out of the
cache and no padding. Chunks with a
cached context are grouped by similar context length, since padding costs Q x L
work.

A layer's AttentionOptions (engine/attention/context.py) apply in every case: windows
and chunks through the masks; softcaps, ALiBi biases, bias tables by key position and
attention sinks, which SDPA does not take, through the scores and softmax written out
(``_explicit_attention``).
Values may have their own head size (Dv): outputs are [T, H, Dv].

On the "auto" backend the native kernels take what they can, reading the paged
cache in place: decoding requests go to kernels/cpu_attention.py, and every prefill
chunk, fresh or not, to kernels/cpu_prefill_attention.py (float32 and bfloat16
caches), as the engine's backend chose at load (engine/attention/backends.py). A layer
with a bias table by key position, which the kernels do not take, runs on plans made
without them (``TorchPlans.without_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_attention, cpu_prefill_attention
from ..kernels.cpu_fused import kv_write, kv_write_takes
from .context import AttentionOptions, StepBatch
from .torch_plans import DecodeBatch, PrefillBatch, TorchAttentionPlan, TorchPlans, visible_keys


def alibi_bias(query_pos: torch.Tensor, key_pos: torch.Tensor, slopes: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's score bias. query_pos: [b, Q] or [Q]; key_pos: [L]; slopes: [H];
    returns [b, H, Q, L] (or [1, H, Q, L]): slope_h * (key position - query position)."""
    query_pos = query_pos if query_pos.dim() == 2 else query_pos[None]
    distance = (key_pos[None, None, :] - query_pos[:, :, None]).to(dtype)  # [b, Q, L]
    return slopes.to(dtype)[None, :, None, None] * distance[:, None]


def score_bias(query_pos: torch.Tensor, key_pos: torch.Tensor, options: AttentionOptions,
               dtype: torch.dtype) -> torch.Tensor | None:
    """The scores' bias from the layer's ALiBi slopes and bias table by key position, or
    None. query_pos: [b, Q] or [Q]; key_pos: [L]; returns [b | 1, H, Q | 1, L]."""
    bias = None
    if options.alibi_slopes is not None:
        bias = alibi_bias(query_pos, key_pos, options.alibi_slopes, dtype)
    if options.position_bias is not None:
        table = options.position_bias  # [H, Lt], covering the step's contexts
        # Keys past the table pad a request's context to whole blocks: masked, any bias.
        by_key = table.index_select(1, key_pos.clamp(max=table.shape[1] - 1)).to(dtype)[None, :, None, :]
        bias = by_key if bias is None else bias + by_key
    return bias


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V into the paged cache. key: [T, Hkv, D], value: [T, Hkv, Dv];
    caches: [N, bs, Hkv, D] and [N, bs, Hkv, Dv]. Keys or values of other heads or
    sizes than the cache's are an error (a view by theirs would write wrong slots)."""
    if key.shape[1:] != k_cache.shape[2:] or value.shape[1:] != v_cache.shape[2:]:
        raise ValueError(f"keys {tuple(key.shape[1:])} and values {tuple(value.shape[1:])} (heads, head size) "
                         f"do not match the KV cache's {tuple(k_cache.shape[2:])} and {tuple(v_cache.shape[2:])}")
    if kv_write_takes(key, value, k_cache, v_cache, slot_mapping):  # one C call for both, no views
        kv_write(key, value, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def torch_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    work: TorchPlans,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention of the packed queries over each request's paged context: ``work``'s
    decode and prefill batches through the native kernels, its plans through SDPA,
    and each of its fresh prompts' rows through SDPA on the step's own keys and
    values.

    query: [T, H, D]; key: [T, Hkv, D], value: [T, Hkv, Dv], the step's new ones
    (already in the cache); k_cache: [N, bs, Hkv, D], v_cache: [N, bs, Hkv, Dv];
    returns [T, H, Dv] contiguous.
    """
    output = query.new_empty((*query.shape[:2], v_cache.shape[3]))
    if work.decode is not None:
        _attend_decode(query, k_cache, v_cache, work.decode, output, options)
    for plan in work.plans:
        output.index_copy_(0, plan.output_index, _attend(query, k_cache, v_cache, plan, options))
    if work.prefill is not None:
        _attend_prefill(query, k_cache, v_cache, work.prefill, output, options)
    for first, end in work.fresh:
        output[first:end] = _attend_fresh(query[first:end], key[first:end], value[first:end], options)
    return output


def attend_last_tokens(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                       options: AttentionOptions, native_kernel: bool) -> torch.Tensor:
    """Attention of one query token per request of ``batch``, each the last token of its
    request's context (already in the cache): the query of request r is row
    ``batch.query_rows[r]``. Through the native decode kernel (``native_kernel``), else
    SDPA over the contexts gathered as for a step of decoding requests.

    query: [S, H, D], one row per request of ``batch.requests``; k_cache:
    [N, bs, Hkv, D], v_cache: [N, bs, Hkv, Dv]; returns [S, H, Dv].
    """
    output = query.new_empty((*query.shape[:2], v_cache.shape[3]))
    if native_kernel or batch.requests.numel() == 0:
        if batch.requests.numel():
            _attend_decode(query, k_cache, v_cache, batch, output, options)
        return output
    rows = batch.query_rows.index_select(0, batch.requests)  # [S] each request's query row
    seq_lens = batch.seq_lens.index_select(0, batch.requests)
    # The requests as a step of one query token each (their keys are already cached).
    requests = torch.arange(rows.numel(), device=rows.device)
    starts = torch.arange(rows.numel() + 1, device=rows.device)
    single = StepBatch(slot_mapping=rows.new_empty(0), query_start_loc=starts, seq_lens=seq_lens,
                       block_tables=batch.block_tables.index_select(0, batch.requests),
                       kv_caches=[(k_cache, v_cache)], max_query_len=1, max_seq_len=int(seq_lens.max()))
    plan = TorchAttentionPlan.build(single, requests, k_cache.shape[1])
    return output.index_copy_(0, rows, _attend(query.index_select(0, rows), k_cache, v_cache, plan, options))


def _attend_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefill: PrefillBatch,
                    output: torch.Tensor, options: AttentionOptions) -> None:
    """The prefill chunks' rows of ``output``, by the native kernel."""
    cpu_prefill_attention.prefill_attention(
        query, k_cache, v_cache, prefill.block_tables, prefill.query_start_loc, prefill.seq_lens, prefill.requests,
        output, options.scale, options.sliding_window, options.softcap, sinks=options.sinks,
        alibi_slopes=options.alibi_slopes, chunk_size=options.chunk_size, key_limits=prefill.key_limits)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  options: AttentionOptions) -> torch.Tensor:
    """One fresh prompt: query [L, H, D] over its own key [L, Hkv, D] and value
    [L, Hkv, Dv] at positions 0 .. L-1; returns [L, H, Dv]."""
    length = query.shape[0]
    mask = bias = None
    cut = options.first_visible_key(length - 1) > 0  # the window or a chunk cuts the context
    if cut or options.alibi_slopes is not None or options.position_bias is not None:
        positions = torch.arange(length, device=query.device)
        if cut:
            mask = visible_keys(positions[:, None], positions[None, :], options)[None, None]
        bias = score_bias(positions, positions, options, query.dtype)
    out = padded_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None].to(query.dtype),
                           value.transpose(0, 1)[None].to(query.dtype), mask, mask is None, options.scale,
                           options.softcap, bias, options.sinks)
    return out[0].transpose(0, 1)


def _attend_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeBatch,
                   output: torch.Tensor, options: AttentionOptions) -> None:
    """The decoding requests' rows of ``output``, by the native kernel."""
    cpu_attention.decode_attention(
        query, k_cache, v_cache, decode.block_tables, decode.seq_lens, decode.query_rows, decode.requests, output,
        options.scale, options.sliding_window, options.softcap, sinks=options.sinks,
        alibi_slopes=options.alibi_slopes, chunk_size=options.chunk_size)


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchAttentionPlan,
            options: AttentionOptions) -> torch.Tensor:
    """One plan's attention; returns [n, H, Dv] for its valid queries in plan order."""
    num_requests, max_query_len = plan.query_valid.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    q = query.index_select(0, plan.query_index).view(num_requests, max_query_len, num_heads, head_dim)
    k = plan.gather(k_cache).to(q.dtype)  # [b, Hkv, Lmax, D]
    v = plan.gather(v_cache).to(q.dtype)  # [b, Hkv, Lmax, Dv]
    causal = plan.fresh and options.sliding_window is None and options.chunk_size is None
    mask = None if causal else plan.mask(options)
    bias = score_bias(plan.query_pos, plan.key_pos, options, q.dtype)
    out = padded_attention(q.transpose(1, 2), k, v, mask, causal, options.scale, options.softcap, bias,
                           options.sinks)  # [b, H, Qmax, Dv]
    out = out.transpose(1, 2).reshape(num_requests * max_query_len, num_heads, v.shape[3])
    return out if plan.valid_rows is None else out.index_select(0, plan.valid_rows)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over padded per-request tensors, GQA by head groups, optional softcap,
    score bias and attention sinks.

    q: [b, H, Q, D]; k: [b, Hkv, L, D]; v: [b, Hkv, L, Dv]; mask: bool [b | 1, 1, Q, L]
    (True = attend), or None with ``causal`` (query i sees keys 0..i) or with no
    masking at all; bias: [b | 1, H, Q | 1, L] added to the scaled scores (ALiBi, a bias
    table by key position); sinks:
    [H] logits joining each softmax's denominator; returns [b, H, Q, Dv].

    With an explicit mask (or none at all), the G = H / Hkv query heads sharing a KV
    head are folded into the query dimension ([b, Hkv, G * Q, D]), so keys and values
    are read once per KV head and never repeated.
    """
    num_requests, num_heads, query_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    plain = softcap is None and bias is None and sinks is None
    if plain and causal and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    if causal and mask is None:
        mask = torch.ones(query_len, k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    folded_q = q.reshape(num_requests, num_kv_heads, group * query_len, head_dim)
    if mask is not None and group > 1:
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(mask.shape[0], 1, group * query_len, -1)
    if plain:
        out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=mask, scale=scale)
    else:
        out = _explicit_attention(folded_q, k, v, mask, scale, softcap, bias, sinks)
    # reshape, not view: CUDA's attention kernels may return a transposed layout.
    return out.reshape(num_requests, num_heads, query_len, v.shape[3])


def _explicit_attention(folded_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, softcap: float | None, bias: torch.Tensor | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Scores, then softmax, written out: for what SDPA does not take (softcap, bias,
    sinks. folded_q: [b, Hkv, G * Q, D] (heads folded as in padded_attention); bias:
    [b | 1, H, Q | 1, L]; sinks: [H]; returns [b, Hkv, G * Q, Dv]."""
    num_requests, num_kv_heads, rows, _ = folded_q.shape
    softmax_dtype = torch.float64 if folded_q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(folded_q, k.transpose(-1, -2)) * scale  # [b, Hkv, G * Q, L]
    if bias is not None:  # [b | 1, H, Q | 1, L] folds as the queries do: head h = kv * G + g
        group = bias.shape[1] // num_kv_heads
        by_group = bias.reshape(bias.shape[0], num_kv_heads, group, bias.shape[2], -1)
        scores = (scores.view(num_requests, num_kv_heads, group, rows // group, -1) + by_group).view(scores.shape)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(folded_q.dtype), v)
    # The sink is one more logit per row, attending to no value: softmax over
    # [scores, sink], then the sink's column dropped.
    group_rows = sinks.to(scores.dtype).view(num_kv_heads, -1, 1)  # [Hkv, G, 1]
    sink_column = group_rows.expand(-1, -1, rows // group_rows.shape[1]).reshape(1, num_kv_heads, rows, 1)
    logits = torch.cat([scores, sink_column.expand(num_requests, -1, -1, -1)], dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=softmax_dtype)[..., :-1]
    return torch.matmul(probs.to(folded_q.dtype), v)
