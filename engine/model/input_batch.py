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
- A steady decode step (the previous step's requests in the same order, each one
  token further, in a step that computed one token for each of them and sampled them
  all) reuses that step's rows without a pass over its requests' rows: only rows
  whose table a new block reached are brought up to date. Its input tokens are the
  previous step's samples: appended ones, or (async scheduling) all still pending in
  the previous step's sampled ids, in the same order.
- Rows of requests that left are reclaimed lazily: when no row is free, those of
  requests absent from the step being built are freed, and only then do the arrays
  grow. A reclaimed request that comes back gets a fresh row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


def _token_layout(scheduled: list[ScheduledRequest], row_index: np.ndarray, starts: np.ndarray,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(query_start_loc [B+1], positions [T], seq_lens [B], each token's row [T],
    max_query_len) of a step whose requests start at ``starts`` [B] in rows
    ``row_index`` [B]."""
    num_requests = len(scheduled)
    if num_tokens == num_requests:  # every request computes one token (decoding)
        return np.arange(num_requests + 1, dtype=np.int64), starts, starts + 1, row_index, 1
    lengths = np.array([item.num_new_tokens for item in scheduled], dtype=np.int64)
    query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(lengths, out=query_start_loc[1:])
    request_of_token = np.repeat(np.arange(num_requests), lengths)
    positions = np.arange(num_tokens) - query_start_loc[:-1][request_of_token] + starts[request_of_token]
    return query_start_loc, positions, starts + lengths, row_index[request_of_token], int(lengths.max())


@dataclass
class SteadyRows:
    """A decode step that a next one may reuse: its requests in order, their rows,
    what a next step reads of them, and the ids and last-chunk indices the steps'
    PackedBatches share (read only)."""

    requests: list[Request]
    row_index: np.ndarray
    next_positions: np.ndarray  # each request's position in a steady next step
    capacity: np.ndarray  # tokens each request's row holds blocks for
    width: int  # the most blocks a row holds
    request_ids: list[str]
    last_chunks: list[int]  # 0 .. B-1: every request samples


class InputRows:
    """Per-request block-table rows, kept across steps (see the module's invariants)."""

    def __init__(self, num_rows: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = [0] * num_rows
        self.block_counts = np.zeros(num_rows, dtype=np.int64)  # num_blocks as an array
        self.tables: list[list[int] | None] = [None] * num_rows
        # The request each row was written for, and whether it asks for prompt logprobs.
        self.owners: list[Request | None] = [None] * num_rows
        self.prompt_logprobs = [False] * num_rows
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self._steady: SteadyRows | None = None  # the last step, when a next one may reuse it

    def pack(self, scheduled: list[ScheduledRequest], pending_rows: dict[str, int] | None = None) -> PackedBatch:
        """The packed layout of ``scheduled`` (in order). ``pending_rows``: request id ->
        row of the previous step's sampled ids, for requests whose last token is still
        pending there (async scheduling); their input at that position comes from it."""
        steady = self._steady
        if steady is not None and len(scheduled) == len(steady.requests):
            packed = self._pack_steady(scheduled, steady, pending_rows)
            if packed is not None:
                return packed
        self._steady = None
        token_ids: list[int] = []
        rows, starts, request_ids, last_chunks = [], [], [], []
        pending_positions, pending_sources = [], []
        width = 0
        any_prompt_logprobs = False
        row_of, owners, tables, num_blocks = self.row_of, self.owners, self.tables, self.num_blocks
        prompt_logprobs = self.prompt_logprobs
        for index, item in enumerate(scheduled):
            request = item.request
            request_id = request.request_id
            start, num_new_tokens = item.start, item.num_new_tokens
            end = start + num_new_tokens
            if end == item.num_tokens:
                last_chunks.append(index)
                if num_new_tokens == 1 and not request.num_pending_tokens:
                    # One token, the request's last known one: most decoding requests.
                    outputs = request.output_token_ids
                    token_ids.append(outputs[-1] if outputs else request.prompt_token_ids[-1])
                else:
                    self._add_tokens(token_ids, item, pending_rows, pending_positions, pending_sources)
            else:
                self._add_tokens(token_ids, item, pending_rows, pending_positions, pending_sources)
            blocks = item.block_ids
            num_table_blocks = len(blocks)
            row = row_of.get(request_id)
            if row is None or owners[row] is not request or tables[row] is not blocks \
                    or num_blocks[row] != num_table_blocks:
                row = self._row(item, scheduled)
            any_prompt_logprobs |= prompt_logprobs[row]
            rows.append(row)
            starts.append(start)
            request_ids.append(request_id)
            if num_table_blocks > width:
                width = num_table_blocks
        row_index = np.array(rows, dtype=np.int64)
        query_start_loc, positions, seq_lens, token_rows, max_query_len = _token_layout(
            scheduled, row_index, np.array(starts, dtype=np.int64), len(token_ids))
        if len(token_ids) == len(last_chunks) == len(scheduled) and not any_prompt_logprobs:
            self._steady = SteadyRows([item.request for item in scheduled], row_index, seq_lens,
                                      self.block_counts[row_index] * self.block_size, width, request_ids, last_chunks)
        return PackedBatch(token_ids, positions, self._slots(token_rows, positions), query_start_loc, seq_lens,
                           self.block_tables[row_index, :width], max_query_len, pending_positions, pending_sources,
                           request_ids, last_chunks, any_prompt_logprobs)

    def _pack_steady(self, scheduled: list[ScheduledRequest], steady: SteadyRows,
                     pending_rows: dict[str, int] | None) -> PackedBatch | None:
        """The layout of a steady decode step (see the module's invariants), or None
        when ``scheduled`` is not one. Each request computes the token the step before
        sampled for it: known (appended), or pending in the step in flight, whose
        sampled ids are then the step's inputs in the same order."""
        requests = [item.request for item in scheduled]
        if requests != steady.requests:  # Request compares by identity
            return None
        positions = np.array([item.start for item in scheduled], dtype=np.int64)
        if not np.array_equal(positions, steady.next_positions):
            return None
        seq_lens = positions + 1
        num_known = np.array([request.num_tokens for request in requests], dtype=np.int64)
        pending_positions: list[int] = []
        if np.array_equal(num_known, seq_lens):
            token_ids = [request.output_token_ids[-1] for request in requests]
        elif (pending_rows is not None and np.array_equal(num_known, positions)
              and list(pending_rows) == steady.request_ids and list(pending_rows.values()) == steady.last_chunks):
            token_ids, pending_positions = [0] * len(requests), steady.last_chunks
        else:
            return None
        row_index = steady.row_index
        for index in np.flatnonzero(positions >= steady.capacity).tolist():  # a new block reached
            row = self._row(scheduled[index], scheduled)
            steady.capacity[index] = self.num_blocks[row] * self.block_size
            steady.width = max(steady.width, self.num_blocks[row])
        steady.next_positions = seq_lens
        return PackedBatch(token_ids, positions, self._slots(row_index, positions),
                           np.arange(len(scheduled) + 1, dtype=np.int64), seq_lens,
                           self.block_tables[row_index, : steady.width], 1, pending_positions, pending_positions,
                           steady.request_ids, steady.last_chunks)

    def _slots(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV-cache slot of each token: [T] rows and positions -> [T] int64."""
        block_index, offsets = np.divmod(positions, self.block_size)
        slots = self.block_tables[token_rows, block_index].astype(np.int64)
        slots *= self.block_size
        slots += offsets
        return slots

    @staticmethod
    def _add_tokens(token_ids: list[int], item: ScheduledRequest, pending_rows: dict[str, int] | None,
                    pending_positions: list[int], pending_sources: list[int]) -> None:
        """Append the item's input tokens; a position whose token the step in flight
        sampled (async scheduling) gets 0 and is listed to be filled on the device."""
        request = item.request
        start, end = item.start, item.start + item.num_new_tokens
        known = request.num_tokens
        if end <= known:
            token_ids += request.token_ids_slice(start, end)
            return
        assert end == known + 1, (request.request_id, end, known)
        assert pending_rows is not None, f"{request.request_id} reads a token no step in flight samples"
        token_ids += request.token_ids_slice(start, known)
        token_ids.append(0)
        pending_positions.append(len(token_ids) - 1)
        pending_sources.append(pending_rows[request.request_id])

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
            self.num_blocks[row] = self.block_counts[row] = 0
        have = self.num_blocks[row]
        if have < len(blocks):
            if len(blocks) > self.block_tables.shape[1]:
                self._grow(self.block_tables.shape[0], len(blocks))
            self.block_tables[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = self.block_counts[row] = len(blocks)
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
        self.block_counts = np.concatenate([self.block_counts, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.tables += [None] * (num_rows - old_rows)
        self.owners += [None] * (num_rows - old_rows)
        self.prompt_logprobs += [False] * (num_rows - old_rows)


class WindowedRows:
    """Rows of each windowed group's tables (engine/core/window_blocks.py), one InputRows
    per group over ScheduledRequest.group_block_ids. A table whose entries were dropped is
    a new list, so its row is rewritten at the next step that is not a steady decode step;
    a steady one keeps the old ids until the table gains a block, and those entries lie
    before the window, where every attention path masks or skips keys."""

    def __init__(self, num_groups: int, block_size: int) -> None:
        self.groups = [InputRows(64, 16, block_size) for _ in range(num_groups)]

    def pack(self, scheduled: list[ScheduledRequest],
             pending_rows: dict[str, int] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group, the step's (slot mapping [T], block tables [B, max_blocks] int32)."""
        tables = []
        for group, rows in enumerate(self.groups):
            packed = rows.pack([replace(item, block_ids=item.group_block_ids[group]) for item in scheduled],
                               pending_rows)
            tables.append((packed.slot_mapping, packed.block_tables))
        return tables
