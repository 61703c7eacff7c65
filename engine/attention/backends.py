"""The attention backends: one is chosen when the engine is built, and everything that
depends on how attention runs asks it.

- ``TritonBackend``: the Triton kernels on CUDA (16- and 32-bit floats); its decode
  steps may replay CUDA graphs.
- ``TorchBackend``: torch ops on whatever device (the exact reference path for
  float64), with the native CPU kernels the engine chose for this host
  (engine/cpu/paths.py): decoding requests through kernels/cpu_attention.py,
  prefill chunks through kernels/cpu_prefill_attention.py.

A backend builds one frozen ``AttentionContext`` per step from the packed batch
(``build_context``), with its own per-step work in it (the torch path's plans, the
kernels' int32 indices), and attends one layer of that step (``attend``). Adding an
attention feature (a sink, a bias, another cache layout) means changing a backend and
its kernels, not the model runner.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from .context import AttentionContext, AttentionOptions, StepBatch
from .torch_path import attend_last_tokens, torch_paged_attention, write_kv_cache
from .torch_plans import DecodeBatch, PrefillBatch, TorchAttentionPlan, TorchPlans, attention_groups, fresh_prompts

BACKEND_NAMES = ("cpu", "torch", "triton")

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """How the engine's paged attention runs; chosen once per engine."""

    # Read-only: the backends are frozen dataclasses.
    @property
    def name(self) -> str: ...

    @property
    def replays_decode_graphs(self) -> bool:
        """Decode steps may replay CUDA graphs recorded over static buffers (cuda_graphs.py)."""
        ...

    @property
    def attends_sampled_rows(self) -> bool:
        """A step's last layer may attend its sampled rows alone (engine/cpu/layers.py)."""
        ...

    def build_context(self, step: StepBatch) -> AttentionContext:
        """The frozen per-step context every layer of the step reads."""
        ...

    def attend(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        """Write the layer's new keys and values into its cache and attend.
        query: [T, H, D]; key: [T, Hkv, D]; value: [T, Hkv, Dv]; returns [T, H, Dv]."""
        ...

    def attend_sampled_rows(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        """Write the layer's new keys and values (of every token of the step) into its
        cache, then attend the step's sampled rows alone (``ctx.sampled_rows``, marked
        where ``attends_sampled_rows``), each its request's last token attending the
        request's whole context. query: [S, H, D], the queries at those rows in their
        order; key: [T, Hkv, D]; value: [T, Hkv, Dv]; returns [S, H, Dv]."""
        ...


def layer_options(options: AttentionOptions, chunk_sizes: tuple[int | None, ...], layer_idx: int) -> AttentionOptions:
    """``options`` with the layer's chunk size from its cache spec (``chunk_sizes``, by
    layer; empty when no layer is chunked)."""
    if chunk_sizes and chunk_sizes[layer_idx] is not None:
        return replace(options, chunk_size=chunk_sizes[layer_idx])
    return options


def attention_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (key, value) caches of the layers that hold heads: recurrent layers'
    (engine/recurrent/) are empty; the first layer's alone when no layer attends."""
    return [(k, v) for k, v in kv_caches if k.shape[2]] or kv_caches[:1]


@dataclass(frozen=True)
class TorchBackend:
    """torch ops, with the native CPU kernels the engine chose where they take the
    step's requests. ``num_heads`` is the model's query heads (the kernels' limits
    depend on the grouping); ``chunk_sizes``: each layer's chunk size for chunked
    local attention (None: not chunked), empty when no layer is chunked."""

    num_heads: int
    native_decode: bool = False
    native_prefill: bool = False
    chunk_sizes: tuple[int | None, ...] = ()
    name: str = "torch"
    replays_decode_graphs: bool = False
    # Per set of cache tensors (by id, checked through weak references): whether the
    # native (decode, prefill) kernels take them; and aranges by size and device.
    _kernel_support: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _aranges: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def attends_sampled_rows(self) -> bool:
        return self.native_decode

    def build_context(self, step: StepBatch) -> AttentionContext:
        groups = tuple(AttentionContext(**vars(group), backend=self, work=self._plans(group))
                       for group in step.group_steps())
        return AttentionContext(**vars(step), backend=self, work=self._plans(step), group_contexts=groups)

    def _plans(self, step: StepBatch) -> TorchPlans:
        caches = attention_caches(step.kv_caches)
        native_decode, native_prefill = self._kernels_take(caches)
        # Queries that see later keys (an image attending both ways): the prefill kernel
        # takes their limits; without it their chunks go through SDPA plans with masks,
        # not the causal fresh path.
        bidirectional = step.key_limits is not None
        block_tables = step.block_tables.contiguous()
        if native_decode and step.max_query_len == 1:
            # Every request decodes one token: the decode kernel takes them all (request
            # b's query is packed row b), and there is nothing to group: the common step,
            # planned without reading the query lengths.
            requests = self._indices(step.num_requests, step.seq_lens.device)
            return TorchPlans(DecodeBatch(requests, requests, step.seq_lens, block_tables), None, [], [])
        query_lens = step.query_start_loc[1:] - step.query_start_loc[:-1]
        decode = prefill = None
        if native_decode:
            requests = (query_lens == 1).nonzero().flatten()
            if requests.numel():
                decode = DecodeBatch(requests, step.query_start_loc[:-1].contiguous(), step.seq_lens, block_tables)
        if native_prefill and bool((query_lens > 1).any()):
            prefill = PrefillBatch((query_lens > 1).nonzero().flatten(), step.query_start_loc.contiguous(),
                                   step.seq_lens, block_tables,
                                   None if step.key_limits is None else step.key_limits.contiguous())
        groups = attention_groups(query_lens, step.seq_lens, group_decoding=decode is None,
                                  group_chunks=not native_prefill, group_fresh=bidirectional)
        fresh = [] if native_prefill or bidirectional else fresh_prompts(step.query_start_loc, step.seq_lens)
        block_size = caches[0][0].shape[1]
        return TorchPlans(decode, prefill, [TorchAttentionPlan.build(step, group, block_size) for group in groups],
                          fresh)

    def _kernels_take(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[bool, bool]:
        """Whether the native decode and prefill kernels this backend may use take every
        attention layer's cache: a step's plan serves every layer, and layers may differ
        in heads and head sizes (gemma4). Decided once per set of cache tensors (held
        weakly: a throwaway cache is freed as usual)."""
        if not (self.native_decode or self.native_prefill):
            return False, False
        key = tuple(id(k) for k, _ in caches)
        known = self._kernel_support.get(key)
        if known is not None and all(ref() is k for ref, (k, _) in zip(known[0], caches)):
            return known[1]
        from ..kernels.cpu_attention import decode_kernel_available
        from ..kernels.cpu_prefill_attention import prefill_kernel_available

        taken = (self.native_decode and all(decode_kernel_available(k, self.num_heads, v.shape[3]) for k, v in caches),
                 self.native_prefill and all(prefill_kernel_available(k, self.num_heads, v.shape[3])
                                             for k, v in caches))
        if len(self._kernel_support) >= 8:
            self._kernel_support.clear()
        self._kernel_support[key] = ([weakref.ref(k) for k, _ in caches], taken)
        return taken

    def _indices(self, num: int, device: torch.device) -> torch.Tensor:
        """arange(num) on ``device``, made once per size (read only)."""
        indices = self._aranges.get((num, device))
        if indices is None:
            indices = self._aranges[(num, device)] = torch.arange(num, device=device)
        return indices

    def attend(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        options = layer_options(options, self.chunk_sizes, layer_idx)
        ctx = ctx.for_layer(layer_idx, options)
        k_cache, v_cache = ctx.kv_caches[layer_idx]
        write_kv_cache(key, value, k_cache, v_cache, ctx.slot_mapping)
        work = ctx.work
        assert isinstance(work, TorchPlans), "a context built by another backend"
        if options.position_bias is not None:  # a bias table, which the native kernels do not take
            work = work.without_kernels(lambda: replace(self, native_decode=False, native_prefill=False)._plans(ctx))
        return torch_paged_attention(query, key, value, k_cache, v_cache, work, options)

    def attend_sampled_rows(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        """See AttentionBackend: the native decode kernel where it takes the step's caches
        (and the layer has no bias table), else SDPA over the gathered contexts."""
        options = layer_options(options, self.chunk_sizes, layer_idx)
        ctx = ctx.for_layer(layer_idx, options)
        assert ctx.sampled_requests is not None and ctx.sampled_query_rows is not None, "no sampled rows marked"
        k_cache, v_cache = ctx.kv_caches[layer_idx]
        write_kv_cache(key, value, k_cache, v_cache, ctx.slot_mapping)
        native = options.position_bias is None and self._kernels_take(attention_caches(ctx.kv_caches))[0]
        requests = DecodeBatch(ctx.sampled_requests, ctx.sampled_query_rows, ctx.seq_lens, ctx.block_tables)
        return attend_last_tokens(query, k_cache, v_cache, requests, options, native)


@dataclass(frozen=True)
class TritonIndices:
    """The int32 per-request indices the Triton kernels read."""

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32


@dataclass(frozen=True)
class TritonBackend:
    """The Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1). ``chunk_sizes``
    as TorchBackend's."""

    chunk_sizes: tuple[int | None, ...] = ()
    name: str = "triton"
    replays_decode_graphs: bool = True
    attends_sampled_rows: bool = False

    def build_context(self, step: StepBatch, indices: TritonIndices | None = None) -> AttentionContext:
        """``indices``: int32 buffers already holding the step's indices (the CUDA
        graphs' static ones); else they are converted from the step's. A step where some
        query sees later keys (``key_limits``: an image attending both ways), which the
        kernel does not take, gets the torch path's context: its layers attend there."""
        if step.key_limits is not None:
            return TorchBackend(num_heads=0, chunk_sizes=self.chunk_sizes).build_context(step)
        indices = indices or TritonIndices(step.query_start_loc.to(torch.int32), step.seq_lens.to(torch.int32))
        groups = tuple(AttentionContext(**vars(group), backend=self, work=indices) for group in step.group_steps())
        return AttentionContext(**vars(step), backend=self, work=indices, group_contexts=groups)

    def attend(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        if options.position_bias is not None:
            raise ValueError(f"attention layer {layer_idx} adds a bias table by key position (falcon's "
                             "bfloat16-rounded ALiBi), which the Triton kernels do not take; run it with "
                             "attention_backend='torch'")
        from ..kernels import paged_attention, store_kv_cache

        options = layer_options(options, self.chunk_sizes, layer_idx)
        ctx = ctx.for_layer(layer_idx, options)
        indices = ctx.work
        assert isinstance(indices, TritonIndices), "a context built by another backend"
        k_cache, v_cache = ctx.kv_caches[layer_idx]
        store_kv_cache(key.contiguous(), value.contiguous(), k_cache, v_cache, ctx.slot_mapping)
        return paged_attention(query.contiguous(), k_cache, v_cache, indices.query_start_loc, indices.seq_lens,
                               ctx.block_tables, options.scale, sliding_window=options.sliding_window,
                               softcap=options.softcap, sinks=options.sinks, alibi_slopes=options.alibi_slopes,
                               chunk_size=options.chunk_size, max_query_len=ctx.max_query_len)

    def attend_sampled_rows(self, ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        """See AttentionBackend: the sampled rows as a step of one query token per
        request, through the same kernel."""
        if options.position_bias is not None:
            raise ValueError(f"attention layer {layer_idx} adds a bias table by key position, which the Triton "
                             "kernels do not take; run it with attention_backend='torch'")
        from ..kernels import paged_attention, store_kv_cache

        options = layer_options(options, self.chunk_sizes, layer_idx)
        ctx = ctx.for_layer(layer_idx, options)
        indices = ctx.work
        assert isinstance(indices, TritonIndices), "a context built by another backend"
        assert ctx.sampled_requests is not None and ctx.sampled_query_rows is not None, "no sampled rows marked"
        k_cache, v_cache = ctx.kv_caches[layer_idx]
        store_kv_cache(key.contiguous(), value.contiguous(), k_cache, v_cache, ctx.slot_mapping)
        requests = ctx.sampled_requests
        rows = ctx.sampled_query_rows.index_select(0, requests)  # [S] each request's query row
        attended = paged_attention(
            query.index_select(0, rows).contiguous(), k_cache, v_cache,
            torch.arange(rows.numel() + 1, device=rows.device, dtype=torch.int32),
            indices.seq_lens.index_select(0, requests), ctx.block_tables.index_select(0, requests), options.scale,
            sliding_window=options.sliding_window, softcap=options.softcap, sinks=options.sinks,
            alibi_slopes=options.alibi_slopes, chunk_size=options.chunk_size, max_query_len=1)
        return torch.empty_like(attended).index_copy_(0, rows, attended)


def choose_attention_backend(requested: str | None, device: torch.device, dtype: torch.dtype, num_heads: int,
                             native_decode: bool, native_prefill: bool,
                             chunk_sizes: tuple[int | None, ...] = (),
                             position_bias: bool = False) -> AttentionBackend:
    """The engine's backend: ``requested`` ("triton", "cpu": torch with the native CPU
    kernels the engine chose, "torch": torch ops alone), else Triton on CUDA except in
    float64 (the kernels take 16- and 32-bit floats) or where some layer attends with
    a bias table by key position (``position_bias``: falcon's ALiBi; only the torch
    path takes one), and torch with the chosen native kernels elsewhere.
    ``chunk_sizes``: each layer's chunked-attention chunk size (KVCacheSpec.chunk_sizes)."""
    if requested is None:
        requested = "triton" if device.type == "cuda" and dtype != torch.float64 else "cpu"
        if requested == "triton" and position_bias:
            logger.info("attention runs on the torch path: the model attends with a bias table by key position, "
                        "which the Triton kernels do not take")
            requested = "torch"
    if requested == "triton" and position_bias:
        raise ValueError("attention_backend='triton' cannot run this model: it attends with a bias table by key "
                         "position (falcon's ALiBi), which only the torch path takes; use attention_backend='torch'")
    if requested == "triton":
        return TritonBackend(chunk_sizes)
    if requested == "cpu":
        return TorchBackend(num_heads, native_decode=native_decode, native_prefill=native_prefill,
                            chunk_sizes=chunk_sizes, name="cpu")
    if requested == "torch":
        return TorchBackend(num_heads, chunk_sizes=chunk_sizes)
    raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {requested!r}")
