"""The packed batch of one step, built from per-request rows kept across steps.

Each request the runner has seen keeps a row in preallocated arrays: its block
table, written once and extended in place as the KV cache grows the request's table,
so a step copies only new block ids instead of rebuilding every table. Positions,
KV slots and block tables of the whole step are then array operations over the
step's rows, not Python loops over its tokens.

Invariants:
- A row holds the first ``num_blocks[row]`` ids of the block table ``tables[row]``
  (the KV cache's own list, KVCacheManager.live_block_ids). The cache only ever
  extends that list; a table rebuilt after a free is another list, so a row whose
  list is not the scheduled one is rewritten whole.
- A row serves one Request object (``owners[row]``), whose parameters never change:
  what the row keeps of them (whether it asks for prompt logprobs) is read when the
  row is bound to it; a request id taken by another request rebinds the row.
- Rows of requests that left are reclaimed lazily: when no row is free, those of
  requests absent from the step being built are freed, and only then do the arrays
  grow. A reclaimed request that comes back gets a fresh row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.request import Request
from ..core.scheduler import ScheduledRequest


@dataclass
class PackedBatch:
    """One step's packed layout on the host (numpy, int64 unless stated)."""

    token_ids: list[int]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    # Packed index of each token whose input is the request's pending token (sampled
    # by the step before, still on the device), and that token's row in that step's
    # sampled ids; empty when no request has one.
    pending_positions: list[int]
    pending_rows: list[int]
    # Each request's id, in step order; the indices of those whose chunk reaches their
    # last token (is_last_chunk: they sample); whether any asks for prompt logprobs.
    request_ids: list[str] = field(default_factory=list)
    last_chunks: list[int] = field(default_factory=list)
    any_prompt_logprobs: bool = False


class InputRows:
    """Per-request block-table rows, kept across steps (see the module's invariants)."""

    def __init__(self, num_rows: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = [0] * num_rows
        self.tables: list[list[int] | None] = [None] * num_rows
        # The request each row was written for, and whether it asks for prompt logprobs.
        self.owners: list[Request | None] = [None] * num_rows
        self.prompt_logprobs = [False] * num_rows
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def pack(self, scheduled: list[ScheduledRequest], pending_rows: dict[str, int] | None = None) -> PackedBatch:
        """The packed layout of ``scheduled`` (in order). ``pending_rows``: request id ->
        row of the previous step's sampled ids, for requests whose last token is still
        pending there (async scheduling); their input at that position comes from it."""
        token_ids: list[int] = []
        rows, starts, lengths, request_ids, last_chunks = [], [], [], [], []
        pending_positions, pending_sources = [], []
        width = 0
        any_prompt_logprobs = False
        row_of, owners, tables, num_blocks = self.row_of, self.owners, self.tables, self.num_blocks
        for index, item in enumerate(scheduled):
            request = item.request
            request_id = request.request_id
            start, num_new_tokens = item.start, item.num_new_tokens
            end = start + num_new_tokens
            if end == item.num_tokens:
                last_chunks.append(index)
            if num_new_tokens == 1 and end == item.num_tokens and not request.num_pending_tokens:
                # One token, the request's last known one: most decoding requests.
                outputs = request.output_token_ids
                token_ids.append(outputs[-1] if outputs else request.prompt_token_ids[-1])
            else:
                known = request.num_tokens
                if end <= known:
                    token_ids += request.token_ids_slice(start, end)
                else:
                    # The last position's token was sampled by the step in flight.
                    assert end == known + 1, (request_id, end, known)
                    token_ids += request.token_ids_slice(start, known)
                    token_ids.append(0)
                    pending_positions.append(len(token_ids) - 1)
                    pending_sources.append(pending_rows[request_id])
            blocks = item.block_ids
            row = row_of.get(request_id)
            if row is None or owners[row] is not request or tables[row] is not blocks \
                    or num_blocks[row] != len(blocks):
                row = self._row(item, scheduled)
            any_prompt_logprobs |= self.prompt_logprobs[row]
            rows.append(row)
            starts.append(start)
            lengths.append(num_new_tokens)
            request_ids.append(request_id)
            if len(blocks) > width:
                width = len(blocks)
        row_index = np.array(rows, dtype=np.int64)
        start_array = np.array(starts, dtype=np.int64)
        length_array = np.array(lengths, dtype=np.int64)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(length_array, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == len(scheduled):  # every request computes one token (decoding)
            positions, token_rows, max_query_len = start_array, row_index, 1
        else:
            request_of_token = np.repeat(np.arange(len(scheduled)), length_array)
            positions = (np.arange(num_tokens) - query_start_loc[:-1][request_of_token]
                         + start_array[request_of_token])
            token_rows = row_index[request_of_token]
            max_query_len = int(length_array.max())
        block_size = self.block_size
        slots = self.block_tables[token_rows, positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        return PackedBatch(token_ids, positions, slots, query_start_loc, start_array + length_array,
                           self.block_tables[row_index, :width], max_query_len, pending_positions,
                           pending_sources, request_ids, last_chunks, any_prompt_logprobs)

    def _row(self, item: ScheduledRequest, scheduled: list[ScheduledRequest]) -> int:
        """The request's row, its block table brought up to date."""
        request_id = item.request.request_id
        blocks = item.block_ids
        row = self.row_of.get(request_id)
        if row is None:
            row = self._new_row(scheduled)
            self.row_of[request_id] = row
        if self.owners[row] is not item.request:
            self.owners[row] = item.request
            self.prompt_logprobs[row] = getattr(item.request.params, "prompt_logprobs", None) is not None
            self.tables[row] = None
        if self.tables[row] is not blocks:
            self.tables[row] = blocks
            self.num_blocks[row] = 0
        have = self.num_blocks[row]
        if have < len(blocks):
            if len(blocks) > self.block_tables.shape[1]:
                self._grow(self.block_tables.shape[0], len(blocks))
            self.block_tables[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = len(blocks)
        return row

    def _new_row(self, scheduled: list[ScheduledRequest]) -> int:
        if not self.free_rows:
            in_step = {item.request.request_id for item in scheduled}
            for request_id in [r for r in self.row_of if r not in in_step]:
                row = self.row_of.pop(request_id)
                self.tables[row] = None
                self.owners[row] = None
                self.free_rows.append(row)
        if not self.free_rows:
            num_rows = self.block_tables.shape[0]
            self._grow(2 * num_rows, self.block_tables.shape[1])
            self.free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self.free_rows.pop()

    def _grow(self, num_rows: int, max_blocks: int) -> None:
        old_rows, old_blocks = self.block_tables.shape
        tables = np.zeros((num_rows, max(max_blocks, old_blocks)), dtype=np.int32)
        tables[:old_rows, :old_blocks] = self.block_tables
        self.block_tables = tables
        self.num_blocks += [0] * (num_rows - old_rows)
        self.tables += [None] * (num_rows - old_rows)
        self.owners += [None] * (num_rows - old_rows)
        self.prompt_logprobs += [False] * (num_rows - old_rows)
