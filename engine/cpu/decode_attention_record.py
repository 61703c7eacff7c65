"""A recorded decode step's attention, as kernel calls of the record itself.

A decode step's attention reads what changes every step: the new tokens' cache slots,
the context lengths and the block tables. Recorded as they are, its calls would
replay the first step's. ``StepTables`` are buffers a program keeps for them: the
record's attention calls (the KV write and the native decode kernel) read the buffers,
and every replay first copies the step's own slots, lengths and tables in. A whole
decode step, every layer's attention included, then replays as one C call (engine/
cpu/decode_programs.py).

Which steps: the torch backend's decode-only steps, whose plan is the native decode
kernel over every request (request b's query at packed row b), for every layer's
cache group. At each layer the step first attends as usual (unrecorded); the recorded
calls then write the same keys and values again and attend over the buffers into the
same output, which must come out bit for bit as the usual path's, else the size is
recorded again without them.

A replay's KV write cannot raise: it notes the count of slots out of range in a
counter the replay reads after (``kv_write_noting``), and the step then fails as the
usual path would. Block tables wider than the buffers, caches moved or replaced, or
a layer grouping other than the record's: the program is not replayed (the caller
records again, with wider tables where that was the cause).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.backends import layer_options
from ..attention.context import AttentionContext, AttentionOptions
from ..attention.torch_plans import TorchPlans
from ..kernels.cpu_attention import decode_attention
from ..kernels.cpu_fused import kv_slots_error, kv_write, kv_write_noting, kv_write_takes

# Block-table columns the buffers start with at least; wider steps double them.
MIN_WIDTH = 16


def foldable(ctx: AttentionContext) -> str | None:
    """Why a step's attention cannot be recorded into its program, or None where it can:
    every cache group's plan is the native decode kernel over all of the step's requests."""
    for context in (ctx, *ctx.group_contexts):
        work = context.work
        if not isinstance(work, TorchPlans) or work.decode is None or work.plans or work.prefill or work.fresh:
            return "the step's attention is not the native decode kernel's alone"
    if ctx.key_limits is not None:
        return "some query sees later keys"
    if ctx.seq_lens.shape[0] != ctx.slot_mapping.shape[0]:
        return "the step's requests are not one token each"
    return None


@dataclass
class StepTables:
    """A program's buffers of the step metadata its attention calls read, for a step of
    ``rows`` requests decoding a token each: per cache group (0: the context's own
    tables; g: its windowed group g - 1) the new tokens' slots [T] int64 and the block
    tables [T, width] int32; the context lengths [T] int64; the packed row of each
    request, arange(T); the counter of slots out of range [1] int64; and what the
    record's calls point at (the layer grouping, each layer's caches)."""

    slots: list[torch.Tensor]
    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    rows: torch.Tensor
    out_of_range: torch.Tensor
    layer_groups: tuple[int, ...]
    caches: tuple[int, ...]  # each layer's key and value caches' addresses

    @classmethod
    def for_step(cls, ctx: AttentionContext, width: int) -> StepTables:
        rows = ctx.seq_lens.shape[0]
        contexts = (ctx, *ctx.group_contexts)
        width = max(width, MIN_WIDTH, *(context.block_tables.shape[1] for context in contexts))
        tables = cls([torch.zeros(rows, dtype=torch.int64) for _ in contexts],
                     [torch.zeros((rows, width), dtype=torch.int32) for _ in contexts],
                     torch.zeros(rows, dtype=torch.int64), torch.arange(rows), torch.zeros(1, dtype=torch.int64),
                     ctx.layer_groups, _cache_addresses(ctx))
        tables.fill(ctx)
        return tables

    @property
    def width(self) -> int:
        return self.tables[0].shape[1]

    def held_bytes(self) -> int:
        return sum(tensor.untyped_storage().nbytes() for tensor in (*self.slots, *self.tables, self.seq_lens))

    def fits(self, ctx: AttentionContext) -> bool:
        """Whether a replay over these buffers can serve the step: the record's layer
        grouping and caches, block tables no wider than the buffers."""
        return (ctx.layer_groups == self.layer_groups and len(ctx.group_contexts) + 1 == len(self.tables)
                and all(context.block_tables.shape[1] <= self.width for context in (ctx, *ctx.group_contexts))
                and _cache_addresses(ctx) == self.caches and foldable(ctx) is None)

    def fill(self, ctx: AttentionContext) -> None:
        """Copy the step's slots, block tables and context lengths in (``fits`` first)."""
        for context, slots, tables in zip((ctx, *ctx.group_contexts), self.slots, self.tables, strict=True):
            slots.copy_(context.slot_mapping)
            tables[:, :context.block_tables.shape[1]].copy_(context.block_tables)
        self.seq_lens.copy_(ctx.seq_lens)
        self.out_of_range.zero_()

    def check_written(self, ctx: AttentionContext) -> None:
        """After a replay: the error of its KV writes, if any slot fell outside the cache."""
        out_of_range = int(self.out_of_range)
        if out_of_range:
            raise kv_slots_error(out_of_range, self.rows.shape[0], ctx.kv_caches[0][0])


@dataclass
class RecordedAttention:
    """One layer's attention as recorded calls: where they write, for the record's check
    (which overwrites the output and writes the step's keys and values back where a
    replay left others)."""

    layer_idx: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


def record_attention(tables: StepTables, ctx: AttentionContext, layer_idx: int, options: AttentionOptions,
                     query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attended: torch.Tensor) -> RecordedAttention | str:
    """Run the layer's KV write and decode attention over ``tables`` (a recorder on,
    the step already attended as usual into ``attended``): the same keys and values
    written again, the output computed again into ``attended``. Returns what was
    recorded, or why it cannot be: the calls do not take the layer, or their output
    differs from the usual path's (``attended`` is then the usual path's again)."""
    backend = ctx.backend
    chunk_sizes = getattr(backend, "chunk_sizes", ())
    options = layer_options(options, chunk_sizes, layer_idx)
    group = ctx.layer_groups[layer_idx] if ctx.layer_groups else 0
    k_cache, v_cache = ctx.for_layer(layer_idx, options).kv_caches[layer_idx]
    slots, block_tables = tables.slots[group], tables.tables[group]
    if options.position_bias is not None or not kv_write_takes(key, value, k_cache, v_cache, slots):
        return f"attention layer {layer_idx}'s KV write or options are not the native kernels'"
    expected = attended.clone()
    kv_write_noting(key, value, k_cache, v_cache, slots, tables.out_of_range)
    decode_attention(query, k_cache, v_cache, block_tables, tables.seq_lens, tables.rows, tables.rows, attended,
                     options.scale, options.sliding_window, options.softcap, sinks=options.sinks,
                     alibi_slopes=options.alibi_slopes, chunk_size=options.chunk_size)
    if int(tables.out_of_range) or not torch.equal(attended, expected):
        attended.copy_(expected)
        return f"attention layer {layer_idx}'s recorded calls did not give its usual output"
    return RecordedAttention(layer_idx, k_cache, v_cache, slots)


def write_back(recorded: RecordedAttention, key: torch.Tensor, value: torch.Tensor) -> None:
    """The step's own keys and values into the layer's cache again (after a check whose
    replay wrote others)."""
    kv_write(key, value, recorded.k_cache, recorded.v_cache, recorded.slots)


def _cache_addresses(ctx: AttentionContext) -> tuple[int, ...]:
    return tuple(pointer for k_cache, v_cache in ctx.kv_caches for pointer in (k_cache.data_ptr(), v_cache.data_ptr()))
