"""Turns a SchedulerOutput into tensors and runs the model on them.

All scheduled tokens of all requests form one packed sequence (batch dimension 1):
token ids, their absolute positions, and the KV-cache slot each new token writes.
Logits are computed only at the last scheduled token of requests that reach the end
of their known tokens this step (``is_last_chunk``); partial prefill chunks sample
nothing. This is the only component that builds tensors.

A model with recurrent layers (engine/recurrent/) also keeps per-request state in
state slots beside the KV blocks: the step tells each such layer its requests' slots
and whether each continues a saved state (it does unless it computes from token 0).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers

from ..attention.backends import AttentionBackend, StepBatch
from ..config import EngineConfig
from ..core.partial_blocks import BlockCopy
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..core.window_blocks import WindowedLayout
from ..multimodal.encoder_cache import fills_images, image_key_limits
from ..multimodal.mrope import step_mrope_positions
from ..multimodal.qwen_vl import DEEPSTACK_KEY
from ..recurrent.state import RecurrentStateSpec, RecurrentStep
from .cuda_graphs import DecodeGraphs
from .input_batch import InputRows, PackedBatch, WindowedRows
from .kv_cache_spec import KVCacheSpec, plan_num_blocks
from .step_io import LogitsPlan, ModelInputs, ModelOutput, PendingTokens, RankFollowers, to_device

if TYPE_CHECKING:
    from ..lora.manager import LoRAManager
    from ..lora.request import LoRARequest
    from ..multimodal.encoder_cache import EncoderCache

logger = logging.getLogger(__name__)

# A step's inputs and outputs (model/step_io.py) are imported from here too.
__all__ = ["DEFAULT_CPU_KV_CACHE_BYTES", "LogitsPlan", "ModelInputs", "ModelOutput", "ModelRunner", "PendingTokens",
           "RankFollowers", "model_max_len", "plan_kv_cache"]

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def model_max_len(hf_config: transformers.PretrainedConfig) -> int:
    text_config = hf_config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def plan_kv_cache(config: EngineConfig, spec: KVCacheSpec, model_len: int, free_bytes: int,
                  state_spec: RecurrentStateSpec | None = None) -> tuple[int, int]:
    """(KV blocks, recurrent-state slots) for ``config``'s sequences.

    Without recurrent layers: no slots, and the blocks of kv_cache_spec.plan_num_blocks.
    With them, every running request needs a slot: the budget first keeps the blocks
    one request of ``model_len`` tokens needs, then holds up to max_num_seqs slots
    (fewer where fewer fit: the scheduler then runs that many requests at once), and
    the blocks take what is left. Raises ValueError, naming the sizes, when not even
    one request fits."""
    if state_spec is None or state_spec.is_empty:
        return plan_num_blocks(spec, config.block_size, config.max_num_seqs, model_len, free_bytes), 0
    per_slot = state_spec.bytes_per_slot()
    one_request_blocks = math.ceil(model_len / config.block_size) + 1
    kv_bytes = one_request_blocks * spec.bytes_per_block(config.block_size)
    num_slots = min(config.max_num_seqs, max(0, free_bytes - kv_bytes) // per_slot)
    if num_slots < 1:
        raise ValueError(
            f"the cache budget of {free_bytes} bytes cannot hold one request: its recurrent state takes "
            f"{per_slot} bytes and its {one_request_blocks} KV blocks for {model_len} tokens {kv_bytes} bytes; "
            "raise kv_cache_memory_bytes or gpu_memory_utilization, or lower max_model_len")
    if num_slots < config.max_num_seqs:
        logger.warning("recurrent state for %d requests fits the cache budget (%d bytes each); running at most "
                       "%d requests at once instead of max_num_seqs=%d", num_slots, per_slot, num_slots,
                       config.max_num_seqs)
    num_blocks = plan_num_blocks(spec, config.block_size, num_slots, model_len, free_bytes - num_slots * per_slot)
    return num_blocks, num_slots


class ModelRunner:
    """Owns the model and its paged KV cache; runs one packed forward per step."""

    def __init__(self, model: torch.nn.Module, spec: KVCacheSpec, num_blocks: int, block_size: int,
                 device: torch.device, attention: AttentionBackend, state_spec: RecurrentStateSpec | None = None,
                 num_state_slots: int = 0, lora_manager: LoRAManager | None = None,
                 windowed: WindowedLayout | None = None) -> None:
        self.model = model
        self.attention = attention  # how attention runs, chosen once (engine/attention/backends.py)
        self.spec = spec
        self.lora_manager = lora_manager  # set when enable_lora
        self.decode_graphs: DecodeGraphs | None = None  # see enable_decode_graphs
        # Vision-language models: the encoder outputs scattered at image placeholders.
        self.encoder_cache: EncoderCache | None = None
        self.block_size = block_size
        self.device = device
        # Written in full now, not left to the first write of each page: the free queue
        # is least recently freed first, so a long job cycles through every block, and
        # a step that wrote to fresh pages would pay their faults.
        # Windowed layer groups hold their own blocks (engine/core/window_blocks.py).
        self.num_blocks, self.windowed = num_blocks, windowed
        self.kv_caches = spec.allocate(num_blocks, block_size, device,
                                       windowed.layer_num_blocks(num_blocks) if windowed is not None else None)
        self.windowed_rows = WindowedRows(len(windowed.groups), block_size) if windowed is not None else None
        # Per recurrent layer: state name -> [num_state_slots, *shape]; empty without such layers.
        self.state_spec = state_spec
        self.num_state_slots = num_state_slots
        self.recurrent_states: dict[int, dict[str, torch.Tensor]] = {}
        if num_state_slots:
            assert state_spec is not None, f"{num_state_slots} recurrent-state slots without a state spec"
            self.recurrent_states = state_spec.allocate(num_state_slots, device)
        # Per-request block-table rows kept across steps (engine/model/input_batch.py).
        self.input_rows = InputRows(64, 16, block_size)
        # The other ranks of a tensor-parallel engine (engine/parallel/ranks.py), which run
        # each step's forward and each cache copy beside this runner; None on one rank.
        self.followers: RankFollowers | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Run decode steps over static buffers, replaying CUDA graphs when ``capture``
        (see engine/model/cuda_graphs.py); without capture the same path runs eagerly."""
        self.decode_graphs = DecodeGraphs(self.model, self.attention, self.kv_caches, self.block_size,
                                          max_num_seqs, max_model_len, self.device)
        if capture:
            self.decode_graphs.capture()

    @property
    def uses_mrope(self) -> bool:
        """Whether the model's rotary positions follow its images' grids (M-RoPE)."""
        return self.encoder_cache is not None and self.encoder_cache.spec.grid is not None

    def _decode_graphs_for(self, scheduler_output: SchedulerOutput) -> DecodeGraphs | None:
        """The decode graphs this step runs over, None when it runs eagerly (also with
        windowed groups: the static buffers hold one block table)."""
        graphs = self.decode_graphs
        if (graphs is not None and self.attention.replays_decode_graphs and self.lora_manager is None
                and self.windowed is None
                and graphs.padded_size(len(scheduler_output.scheduled)) is not None
                and not fills_images(scheduler_output.scheduled) and not self.uses_mrope
                and graphs.qualifies(scheduler_output)):
            return graphs
        return None

    def prepare_inputs(self, scheduler_output: SchedulerOutput,
                       pending: PendingTokens | None = None) -> tuple[ModelInputs, LogitsPlan]:
        """Build the packed batch: model kwargs, and which positions need logits.
        ``pending``: the previous step's sampled ids, for requests whose last token
        they hold (async scheduling)."""
        scheduled = scheduler_output.scheduled
        packed = self.input_rows.pack(scheduled, pending.rows if pending is not None else None)
        plan = LogitsPlan.of(scheduled, packed)
        dev = self.device
        sampled = self._sampled_rows(packed, plan)
        key_limits = image_key_limits(scheduled, packed.query_start_loc, packed.positions)
        ctx = self.attention.build_context(StepBatch(
            slot_mapping=to_device(packed.slot_mapping, dev),
            query_start_loc=to_device(packed.query_start_loc, dev),
            seq_lens=to_device(packed.seq_lens, dev),
            block_tables=to_device(packed.block_tables, dev),
            kv_caches=self.kv_caches,
            max_query_len=packed.max_query_len,
            max_seq_len=int(packed.seq_lens.max()),
            **sampled,
            key_limits=to_device(key_limits, dev) if key_limits is not None else None,
            **self._group_tables(scheduled, pending),
        ))
        # [1, T] each, shaped on the host: a step makes as few torch calls as it can.
        num_tokens, num_pending = len(packed.token_ids), len(packed.pending_positions)
        if pending is not None and num_pending == num_tokens == len(pending.rows) \
                and packed.pending_positions == packed.pending_rows:
            # Every input is a pending token, token i from sampled row i (a steady step
            # under async scheduling): the sampled ids are the input ids as they are.
            input_ids = pending.token_ids[None]
        else:
            input_ids = to_device(np.array(packed.token_ids, dtype=np.int64)[None], dev)
            if num_pending:
                assert pending is not None, "pending positions without the step in flight's sampled ids"
                input_ids[0, to_device(packed.pending_positions, dev)] = \
                    pending.token_ids[to_device(packed.pending_rows, dev)]
        # [1, T], or [3, 1, T] M-RoPE ids (engine/multimodal/mrope.py) for models that take them.
        positions = (step_mrope_positions(scheduled, packed.query_start_loc, packed.positions) if self.uses_mrope
                     else packed.positions[None])
        model_inputs = ModelInputs(position_ids=to_device(positions, dev), shardline_ctx=ctx)
        images = (self.encoder_cache.step_embeddings(input_ids, scheduled, packed.query_start_loc)
                  if self.encoder_cache is not None else None)
        if images is not None:
            model_inputs["inputs_embeds"] = images.embeddings  # the ids' embeddings with image rows scattered in
            if images.deepstack is not None:
                model_inputs[DEEPSTACK_KEY] = images.deepstack  # type: ignore[literal-required]
        else:
            model_inputs["input_ids"] = input_ids
        if self.recurrent_states:
            model_inputs["shardline_state"] = self._recurrent_step(scheduler_output)
        return model_inputs, plan

    def _recurrent_step(self, scheduler_output: SchedulerOutput) -> RecurrentStep:
        scheduled = scheduler_output.scheduled
        assert all(item.state_slot >= 0 for item in scheduled), "a request runs without a state slot"
        return RecurrentStep(
            slots=torch.tensor([item.state_slot for item in scheduled], dtype=torch.int64, device=self.device),
            has_initial_state=torch.tensor([item.start > 0 for item in scheduled], dtype=torch.bool,
                                           device=self.device),
            states=self.recurrent_states,
            num_prompt_tokens=torch.tensor(
                [min(max(item.request.num_prompt_tokens - item.start, 0), item.num_new_tokens) for item in scheduled],
                dtype=torch.int64, device=self.device))

    def _group_tables(self, scheduled: list[ScheduledRequest], pending: PendingTokens | None) -> dict:
        """The StepBatch fields of the windowed groups' tables, or none."""
        if self.windowed is None or self.windowed_rows is None:
            return {}
        dev = self.device
        tables = self.windowed_rows.pack(scheduled, pending.rows if pending is not None else None)
        return dict(layer_groups=self.windowed.layer_groups,
                    group_tables=tuple((to_device(slots, dev), to_device(ids, dev)) for slots, ids in tables),
                    group_spans=tuple((group.kind, group.span or 0) for group in self.windowed.groups))

    def _sampled_rows(self, packed: PackedBatch, plan: LogitsPlan) -> dict:
        """Steps that sample fewer rows than they run (prefill chunks) let a backend that
        attends sampled rows alone skip the rest in the last layer (engine/cpu/layers.py);
        decode steps sample every row. The StepBatch fields, or none."""
        if (not self.attention.attends_sampled_rows or plan.prompt_rows or self.lora_manager is not None
                or len(plan.keep) >= len(packed.token_ids)):
            return {}
        sampled = packed.last_chunks
        query_rows = [0] * len(packed.request_ids)
        for row, index in enumerate(sampled):
            query_rows[index] = row
        dev = self.device
        return dict(sampled_rows=torch.tensor(plan.keep, dtype=torch.int64, device=dev),
                    sampled_requests=torch.tensor(sampled, dtype=torch.int64, device=dev),
                    sampled_query_rows=torch.tensor(query_rows, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, pending: PendingTokens | None = None) -> ModelOutput:
        """Run the model on the scheduled tokens; return the logits the step needs.
        ``pending``: the previous step's sampled ids, where a scheduled request's last
        token is one of them (async scheduling)."""
        self.copy_block_prefixes([item.block_copy for item in scheduler_output.scheduled if item.block_copy])
        graphs = self._decode_graphs_for(scheduler_output)
        if graphs is not None:
            packed = self.input_rows.pack(scheduler_output.scheduled, pending.rows if pending is not None else None)
            logits, sample_rows = graphs.run(scheduler_output, packed,
                                             pending.token_ids if pending is not None else None)
            return ModelOutput(logits, sample_rows, {})
        model_inputs, plan = self.prepare_inputs(scheduler_output, pending)
        # Kept positions are increasing: as many as the step's tokens is all of them.
        num_tokens = model_inputs["position_ids"].shape[-1]
        keep = 0 if len(plan.keep) == num_tokens else to_device(plan.keep, self.device)
        if self.lora_manager is not None:
            items = scheduler_output.scheduled
            self.prepare_lora_step([i.request.lora_request for i in items], [i.num_new_tokens for i in items])
        forward = partial(self.model, **model_inputs, use_cache=False, logits_to_keep=keep)
        outputs = forward() if self.followers is None else self.followers.run_step(model_inputs, keep, forward)
        return ModelOutput(outputs.logits[0], plan.sample_rows, plan.prompt_rows)

    def prepare_lora_step(self, lora_requests: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """Activate a step's adapters and set its tokens' slots (LoRAManager.prepare_step),
        on every tensor-parallel rank: each loads its share of the adapters in the same order."""
        assert self.lora_manager is not None, "a LoRA step on a runner without enable_lora"
        self.lora_manager.prepare_step(lora_requests, num_tokens)  # first: an adapter it refuses reaches no rank
        if self.followers is not None:
            self.followers.mirror("prepare_lora_step", lora_requests, num_tokens)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]], group_pairs: list[list[tuple[int, int]]] | None = None) -> None:
        """Copy whole KV blocks src -> dst in every layer (forked samples): ``pairs`` in
        the primary table's layers, ``group_pairs[g]`` in windowed group g's."""
        if self.followers is not None:
            self.followers.mirror("copy_blocks", pairs, group_pairs)
        by_group = [pairs, *(group_pairs or ())]
        layer_groups = self.windowed.layer_groups if self.windowed is not None else ()
        for index, (k_cache, v_cache) in enumerate(self.kv_caches):
            group_copies = by_group[layer_groups[index]] if layer_groups else pairs
            if not group_copies:
                continue
            src = torch.tensor([p[0] for p in group_copies], device=self.device)
            dst = torch.tensor([p[1] for p in group_copies], device=self.device)
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def copy_block_prefixes(self, copies: list[BlockCopy]) -> None:
        """Copy slots [0, num_tokens) of each copy's source block into its destination
        block in every layer's caches (token-granular prefix hits). Every source is read
        before any destination is written, so a block that is one copy's destination and
        another's source gives the latter its old contents."""
        if not copies:
            return
        if self.followers is not None:
            self.followers.mirror("copy_block_prefixes", copies)
        size = self.block_size
        src = [copy.src_block * size + offset for copy in copies for offset in range(copy.num_tokens)]
        dst = [copy.dst_block * size + offset for copy in copies for offset in range(copy.num_tokens)]
        src_slots = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_slots = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for layer_caches in self.kv_caches:
            for cache in layer_caches:  # [num_blocks, block_size, ...]
                assert cache.shape[1] == size, (cache.shape, size)
                # By the slot count, not -1: a latent layer's value cache holds no numbers.
                slots = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
                slots[dst_slots] = slots[src_slots]

    @torch.inference_mode()
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent-state slots src -> dst in every recurrent layer (forked samples)."""
        if not pairs or not self.recurrent_states:
            return
        if self.followers is not None:
            self.followers.mirror("copy_states", pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for states in self.recurrent_states.values():
            for tensor in states.values():
                tensor[dst] = tensor[src]
