"""CUDA graphs for decode steps: one recorded forward pass per padded batch size.

A decode step runs the whole model for a handful of tokens, so on a GPU its time
goes to launching a few hundred small kernels from Python. Recording the forward
once per batch size and replaying it launches them all at once.

A graph replays fixed addresses and fixed launch grids, so everything a step
varies lives in static buffers that the step fills before replay: token ids,
positions, KV slots, the int32 query starts and context lengths the Triton
kernels read, and the block tables. A batch of n requests replays the graph of
the smallest recorded size >= n; the padding rows write no KV (slot -1), attend
to nothing (query length 0, context 0), and their logits are dropped.

Only steps in which every request computes exactly one token and samples from it
qualify (no prefill chunks, no prompt logprobs); everything else runs eagerly.
Latent attention layers (engine/model/adapters/latent.py) record their absorbed
decode (the Triton MLA kernel, kernels/mla_decode.py) over the same buffers; padding
rows' context 0 gives them zeros.
Graphs need the Triton attention path; the engine does not record them with LoRA
adapters (their per-step slot tensors are built on the host) or with
``enforce_eager``. Without CUDA the same static-buffer path runs eagerly, which
is how the tests check it on CPU through Triton's interpreter.
"""

from __future__ import annotations

import logging
import math

import torch

from ..attention.backends import AttentionBackend, StepBatch, TritonBackend, TritonIndices
from ..attention.context import AttentionContext
from ..core.scheduler import SchedulerOutput
from .input_batch import PackedBatch

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to record: 1, 2, 4, then every multiple of 8, up to max_num_seqs."""
    limit = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {size for size in (1, 2, 4, *range(8, limit + 1, 8)) if size <= limit}
    sizes.add(limit)
    return sorted(sizes)


class DecodeGraphs:
    """Static input buffers for decode steps, and the graphs recorded over them."""

    def __init__(self, model: torch.nn.Module, attention: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device) -> None:
        # Only the Triton backend replays decode graphs: its kernels read the static
        # int32 index buffers below, which _context hands it.
        assert isinstance(attention, TritonBackend), f"the {attention.name} backend replays no decode graphs"
        self.model = model
        self.attention: TritonBackend = attention
        self.block_size = block_size
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        largest = self.sizes[-1]
        max_blocks = math.ceil(max_model_len / block_size)
        self.input_ids = torch.zeros((1, largest), dtype=torch.int64, device=device)
        self.positions = torch.zeros((1, largest), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
        self._steps = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._contexts = {size: self._context(size, kv_caches) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output buffer

    def _context(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionContext:
        """The attention context of a ``size``-row step: views of the static buffers."""
        query_start_loc, seq_lens = self.query_start_loc[: size + 1], self.seq_lens[:size]
        step = StepBatch(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_tables[:size],
            kv_caches=kv_caches,
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
        )
        # The kernels read the static int32 buffers themselves, which each step refills.
        return self.attention.build_context(step, TritonIndices(query_start_loc, seq_lens))

    def padded_size(self, num_requests: int) -> int | None:
        """The smallest recorded size that holds ``num_requests`` rows, None if none does."""
        return next((size for size in self.sizes if size >= num_requests), None)

    @staticmethod
    def qualifies(scheduler_output: SchedulerOutput) -> bool:
        """Every request computes one token and samples from it (no prompt logprobs)."""
        for item in scheduler_output.scheduled:
            if item.num_new_tokens != 1 or not item.is_last_chunk:
                return False
            request = item.request
            if getattr(request.params, "prompt_logprobs", None) is not None \
                    and item.start < request.num_prompt_tokens - 1:
                return False
        return True

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first so smaller ones reuse its memory."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill_padding(0, size)
            self._forward(size)  # warm-up: compiles the kernels this size launches
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("recorded CUDA graphs for decode batches of %s", self.sizes)

    @torch.inference_mode()
    def run(self, scheduler_output: SchedulerOutput, packed: PackedBatch,
            pending_token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, int]]:
        """Run a step that ``qualifies`` (the caller checks), laid out as ``packed``
        (engine/model/input_batch.py); ``pending_token_ids``: the previous step's sampled
        ids its pending rows read. Return its logits [n, V] (row i samples request i)
        and the request id -> row map."""
        items = scheduler_output.scheduled
        num = len(items)
        size = self.padded_size(num)
        assert size is not None, f"{num} requests exceed the largest recorded batch {self.sizes[-1]}"
        width = packed.block_tables.shape[1]
        self.input_ids[0, :num].copy_(torch.tensor(packed.token_ids, dtype=torch.int64), non_blocking=True)
        if packed.pending_positions:
            assert pending_token_ids is not None, "pending rows read the previous step's sampled ids"
            positions = torch.tensor(packed.pending_positions, dtype=torch.int64).to(self.device, non_blocking=True)
            rows = torch.tensor(packed.pending_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            self.input_ids[0].index_copy_(0, positions, pending_token_ids[rows])
        self.positions[0, :num].copy_(torch.from_numpy(packed.positions), non_blocking=True)
        self.slot_mapping[:num].copy_(torch.from_numpy(packed.slot_mapping), non_blocking=True)
        self.seq_lens[:num].copy_(torch.from_numpy(packed.seq_lens), non_blocking=True)
        self.block_tables[:num, :width].copy_(torch.from_numpy(packed.block_tables), non_blocking=True)
        self._fill_padding(num, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            logits = self._logits[size]
        else:
            logits = self._forward(size)
        return logits[:num], {item.request.request_id: row for row, item in enumerate(items)}

    def _fill_padding(self, num: int, size: int) -> None:
        """Rows num..size-1 are padding: no KV write, no query, no context."""
        self.slot_mapping[num:size].fill_(-1)
        self.seq_lens[num:size].zero_()
        torch.clamp(self._steps[: size + 1], max=num, out=self.query_start_loc[: size + 1])

    def _forward(self, size: int) -> torch.Tensor:
        output = self.model(
            input_ids=self.input_ids[:, :size], position_ids=self.positions[:, :size],
            shardline_ctx=self._contexts[size], use_cache=False, logits_to_keep=0,
        )
        return output.logits[0]
