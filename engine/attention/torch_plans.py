"""The torch path's per-step plans: which requests are attended together, and how.

Each step's requests are split into groups (``attention_groups``) that pad little.
Decoding requests (one query token) are grouped DECODE_GROUP_SIZE at a time in order
of context length, so a group's copied K/V is still in the CPU's caches when SDPA
reads it and padding to the group's longest context stays small. Prefill chunks
with a cached context are grouped by similar context length, since padding costs
Q x L work. Fresh prompts (no cached context) need no group: ``fresh_prompts`` lists
their packed rows, attended straight from the step's own keys and values.

A group's ``TorchAttentionPlan`` holds the index tensors that turn it into padded
tensors and its masks; ``TorchPlans`` is a step's whole work on the torch path,
built once per step by the backend (engine/attention/backends.py) and read by every
layer through torch_path.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .context import AttentionOptions, StepBatch

# Decoding requests per group: few enough that a group's K/V copy stays in cache until
# SDPA reads it, enough that per-group overhead stays small.
DECODE_GROUP_SIZE = 4
# A prefill group holds requests whose context is at least this fraction of its
# longest one's, bounding the padded Q x L work of each request.
PREFILL_LENGTH_RATIO = 0.7


def attention_groups(query_lens: torch.Tensor, seq_lens: torch.Tensor, group_decoding: bool = True,
                     group_chunks: bool = True, group_fresh: bool = False) -> list[torch.Tensor]:
    """Request indices in groups that pad little: decoding requests (one query token)
    in runs of DECODE_GROUP_SIZE of similar context length (left out when not
    ``group_decoding``: the native decode kernel takes them); prefill chunks with a
    cached context by similar length (left out when not ``group_chunks``: the native
    prefill kernel takes them). Fresh prompts are left out (``fresh_prompts``), or
    grouped with the chunks where ``group_fresh``."""
    query_list, seq_list = query_lens.tolist(), seq_lens.tolist()
    by_length = sorted(range(len(seq_list)), key=seq_list.__getitem__)
    decoding = [r for r in by_length if query_list[r] == 1] if group_decoding else []
    groups = [decoding[i : i + DECODE_GROUP_SIZE] for i in range(0, len(decoding), DECODE_GROUP_SIZE)]
    if group_chunks:
        groups += _split_by_length([r for r in reversed(by_length) if 1 < query_list[r] and
                                    (group_fresh or query_list[r] < seq_list[r])], seq_list)
    device = seq_lens.device
    return [torch.tensor(group, dtype=torch.int64, device=device) for group in groups]


def fresh_prompts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> list[tuple[int, int]]:
    """(first, end) packed rows of each request whose context is its query tokens
    alone, more than one: a fresh prompt, attended straight from the step's keys."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    return [(starts[b], starts[b + 1]) for b, length in enumerate(lens)
            if length > 1 and starts[b + 1] - starts[b] == length]


def _split_by_length(requests: list[int], seq_lens: list[int]) -> list[list[int]]:
    """``requests`` (longest first) cut where a context falls below PREFILL_LENGTH_RATIO
    of its group's longest."""
    groups: list[list[int]] = []
    for request in requests:
        if groups and seq_lens[request] >= PREFILL_LENGTH_RATIO * seq_lens[groups[-1][0]]:
            groups[-1].append(request)
        else:
            groups.append([request])
    return groups


@dataclass
class DecodeBatch:
    """The step's decoding requests, attended in place by the native CPU kernel
    (kernels/cpu_attention.py) instead of through gathered copies."""

    requests: torch.Tensor  # [n] int64 indices of the decoding requests
    query_rows: torch.Tensor  # [B] int64 packed row of each request's first query token
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32


@dataclass
class PrefillBatch:
    """The step's prefill chunks (several query tokens), attended in place by the
    native CPU kernel (kernels/cpu_prefill_attention.py)."""

    requests: torch.Tensor  # [n] int64 indices of the requests
    query_start_loc: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    key_limits: torch.Tensor | None = None  # [T] int64 (StepBatch.key_limits) or None


@dataclass(frozen=True)
class TorchPlans:
    """A step's work on the torch path, for ``torch_paged_attention``: decoding
    requests for the native decode kernel and prefill chunks for the native prefill
    kernel (each None when its kernel does not take them), SDPA plans of grouped
    requests, and the packed rows of fresh prompts SDPA attends one by one."""

    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    plans: list[TorchAttentionPlan]
    fresh: list[tuple[int, int]]
    # The same step's plans with no native kernel, made by the backend on the first
    # layer that needs them (``without_kernels``) and shared by the step's later ones.
    _without_kernels: list = field(default_factory=list, repr=False, compare=False)

    def without_kernels(self, make: Callable[[], TorchPlans]) -> TorchPlans:
        """These plans if no native kernel takes a request, else the step's plans that
        leave the kernels out, made by ``make`` once per step."""
        if self.decode is None and self.prefill is None:
            return self
        if not self._without_kernels:
            self._without_kernels.append(make())
        return self._without_kernels[0]


@dataclass
class TorchAttentionPlan:
    """Index tensors that turn one group of the packed batch into padded tensors.

    Keys are gathered a whole block at a time through the block tables (a
    contiguous copy per block, far cheaper than a gather per token), padded to
    the longest context of the group; masks exclude padded keys, future keys and
    keys outside a sliding window.
    """

    query_index: torch.Tensor  # [b * Qmax] int64 into the packed tokens (0 where padded)
    query_valid: torch.Tensor  # [b, Qmax] bool
    block_index: torch.Tensor  # [b * max_blocks] int64 block ids to gather
    num_blocks: int  # max_blocks: blocks per request after padding
    query_pos: torch.Tensor  # [b, Qmax] int64 position of each query token
    key_pos: torch.Tensor  # [Lmax] int64, Lmax = max_blocks * block_size
    key_valid: torch.Tensor  # [b, Lmax] bool
    valid_rows: torch.Tensor | None  # [n] int64 rows of the flat [b * Qmax] queries that are real; None: all
    output_index: torch.Tensor  # [n] packed index of each valid query, in plan order
    # Every request's context is exactly its query tokens: causality alone masks.
    fresh: bool
    # [b, Qmax] int64 the last key each query sees (StepBatch.key_limits); None: its own position.
    key_limit: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, step: StepBatch, requests: torch.Tensor, block_size: int) -> TorchAttentionPlan:
        """The plan for the requests at indices ``requests`` of the step."""
        device = step.slot_mapping.device
        query_starts = step.query_start_loc[:-1][requests]
        query_lens = step.query_start_loc[1:][requests] - query_starts  # [b]
        seq_lens = step.seq_lens[requests]
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        q_offsets = torch.arange(max_query_len, device=device)
        query_valid = q_offsets[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, query_starts[:, None] + q_offsets, 0)
        query_pos = (seq_lens - query_lens)[:, None] + q_offsets
        num_blocks = -(-max_seq_len // block_size)
        block_index = step.block_tables[requests, :num_blocks].long().reshape(-1)
        key_pos = torch.arange(num_blocks * block_size, device=device)
        key_valid = key_pos[None, :] < seq_lens[:, None]
        all_valid = bool(query_valid.all())
        valid_rows = None if all_valid else query_valid.flatten().nonzero().flatten()
        key_limit = None if step.key_limits is None else step.key_limits[query_index]
        return cls(query_index.flatten(), query_valid, block_index, num_blocks, query_pos, key_pos, key_valid,
                   valid_rows, query_index[query_valid],
                   fresh=key_limit is None and bool((query_lens == seq_lens).all()), key_limit=key_limit)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """cache: [N, bs, Hkv, D] -> [b, Hkv, Lmax, D] keys or values of each request."""
        _, block_size, num_kv_heads, head_dim = cache.shape
        gathered = cache.index_select(0, self.block_index)
        return gathered.view(-1, self.num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)

    def mask(self, options: AttentionOptions) -> torch.Tensor:
        """[b, 1, Qmax, Lmax] bool, True where a query may attend to a key."""
        key = (options.sliding_window, options.chunk_size)
        if key not in self._masks:
            limit = None if self.key_limit is None else self.key_limit[:, :, None]
            allowed = self.key_valid[:, None, :] & visible_keys(self.query_pos[:, :, None],
                                                                self.key_pos[None, None, :], options, limit)
            # Padded query rows attend to key 0 so softmax stays finite; they are dropped.
            allowed[:, :, 0] |= ~self.query_valid
            self._masks[key] = allowed[:, None]
        return self._masks[key]


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, options: AttentionOptions,
                 key_limit: torch.Tensor | None = None) -> torch.Tensor:
    """Bool, True where a query at ``query_pos`` sees the key at ``key_pos`` (broadcast):
    causal (up to ``key_limit`` where given: a later key of the query's own image),
    within the sliding window and within the query's chunk."""
    allowed = key_pos <= (query_pos if key_limit is None else key_limit)
    if options.sliding_window is not None:
        allowed = allowed & (query_pos - key_pos < options.sliding_window)
    if options.chunk_size is not None:
        allowed = allowed & (key_pos >= query_pos - query_pos % options.chunk_size)
    return allowed
