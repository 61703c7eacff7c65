"""The engine's paged attention, plugged into transformers' attention interface.

A model loaded with ``attn_implementation="shardline"`` calls ``paged_attention_forward``
from every attention layer. The call carries an ``AttentionContext`` (through the
model's ``**kwargs``) describing the packed batch: all scheduled tokens of all
requests form one sequence of T tokens. Each layer writes its new K/V into the
paged cache at ``slot_mapping`` and then attends, per request, over that request's
whole context read back through its block table: with the Triton kernels on CUDA,
else with the plain-torch path of ``torch_attention``.

Masking is ours, so the mask interface entry returns None: transformers builds no
[T, T] mask for the packed batch. What a layer's attention does beyond causal
softmax(q.k * scale) is one ``AttentionOptions`` (a sliding window, a softcap,
attention sinks, ALiBi slopes, chunked local attention), which every attention path
takes: the torch path, the CPU C kernels and the Triton kernel; and a bias table by
key position, which the torch path alone takes.

Calling the paged attention from a module transformers does not route through its
AttentionInterface (an adapter of one's own): call ``paged_attention_forward(module,
query, key, value, None, scaling=..., shardline_ctx=ctx, alibi_slopes=slopes)`` (or
``position_bias=table``) with
``module.layer_idx`` set (or the call's own ``shardline_layer_idx=``), query
[1, H, T, D], key [1, Hkv, T, D], value [1, Hkv, T, Dv]; it returns ([1, T, H, Dv], None).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

if TYPE_CHECKING:
    from .backends import AttentionBackend, TritonIndices
    from .torch_plans import TorchPlans

ATTN_IMPLEMENTATION = "shardline"


@dataclass(frozen=True)
class StepBatch:
    """The packed batch of one step, as the model runner lays it out: all scheduled
    tokens of all requests form one sequence of T tokens."""

    # [T] int64: cache slot of each new token (block_id * block_size + offset).
    slot_mapping: torch.Tensor
    # [B+1] int64: query tokens of request b are packed[query_start_loc[b]:query_start_loc[b+1]].
    query_start_loc: torch.Tensor
    # [B] int64: context length of each request after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: block ids of each request, padded with 0.
    block_tables: torch.Tensor
    # Per layer index: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    max_query_len: int
    max_seq_len: int
    # Set when the step reads the final hidden state of sampling requests' last tokens
    # only and the backend attends them alone: those packed rows in the order their
    # logits are kept, [n] int64; the requests they end, [n] int64 indices; and per
    # request its row in that list, [B] int64 (0 for the others). The last decoder
    # layer then needs queries, attention and MLP at these rows alone
    # (engine/cpu/layers.py).
    sampled_rows: torch.Tensor | None = None
    sampled_requests: torch.Tensor | None = None
    sampled_query_rows: torch.Tensor | None = None
    # [T] int64: the last key position each packed query sees, set when some query sees
    # keys after its own (the rows of an image attending both ways, Gemma 3: an image's
    # row sees the image's last); None: every query sees keys up to its own position.
    key_limits: torch.Tensor | None = None
    # Windowed layer groups with their own block tables (engine/core/window_blocks.py):
    # per cache layer its group (0: the fields above; g + 1: windowed group g), and per
    # windowed group its (slot_mapping [T], block_tables [B, max_blocks]) and its layers'
    # (kind, window or chunk size). Empty: every layer reads the fields above.
    layer_groups: tuple[int, ...] = ()
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    group_spans: tuple[tuple[str, int], ...] = ()

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    def group_steps(self) -> list[StepBatch]:
        """Each windowed group's view of the step: its slot mapping and block tables."""
        return [replace(self, slot_mapping=slots, block_tables=tables, layer_groups=(), group_tables=(),
                        group_spans=()) for slots, tables in self.group_tables]


@dataclass(frozen=True)
class AttentionContext(StepBatch):
    """Everything one forward pass needs to find and extend the paged KV cache: the
    step's batch, the backend that built it (engine/attention/backends.py) and that
    backend's own work for the step (the torch path's plans, the Triton kernels'
    int32 indices). Built once per step and shared by all layers."""

    backend: AttentionBackend | None = None
    # TorchBackend's plans or TritonBackend's int32 indices: each backend reads only the
    # work it built itself.
    work: TorchPlans | TritonIndices | None = None
    # Per windowed group (StepBatch.group_tables), the context its layers read.
    group_contexts: tuple[AttentionContext, ...] = ()

    def for_layer(self, layer_idx: int, options: AttentionOptions) -> AttentionContext:
        """The context of the layer's block table. A windowed group's table holds only the
        keys its window (or chunk) reaches, so a layer there attending further back
        (``options``, the layer's own) is refused, naming both."""
        group = self.layer_groups[layer_idx] if self.layer_groups else 0
        if group == 0:
            return self
        kind, span = self.group_spans[group - 1]
        reach = options.chunk_size if kind == "chunked" else options.sliding_window
        if reach is None or reach > span or (kind == "chunked" and span % reach):
            raise ValueError(f"attention layer {layer_idx} attends with sliding_window={options.sliding_window}, "
                             f"chunk_size={options.chunk_size}, but its cache group keeps only the {kind} span of "
                             f"{span} tokens; run it with free_windowed_blocks=False")
        return self.group_contexts[group - 1]


@dataclass(frozen=True)
class AttentionOptions:
    """How one attention layer weighs its keys beyond causal softmax(q.k * scale).
    Every attention path takes all of them; each is off when None and then costs
    nothing. Positions are absolute positions in the request's context."""

    scale: float
    # A query at position p sees keys p - sliding_window + 1 .. p.
    sliding_window: int | None = None
    # Scores become softcap * tanh(score / softcap) (after scaling and ALiBi).
    softcap: float | None = None
    # [H] one learned logit per query head that joins the softmax's denominator and
    # attends to no value (attention sinks: gpt_oss, granite_swa, flint; transformers
    # passes them as ``s_aux``).
    sinks: torch.Tensor | None = None
    # [H] ALiBi: slope_h * (key position - query position) is added to each scaled score
    # (bloom, mpt, falcon with alibi). Differs from the models' slope_h * key position
    # by a constant per query, which the softmax cancels.
    alibi_slopes: torch.Tensor | None = None
    # Chunked local attention: a query at p sees keys p - p % chunk_size .. p, its own
    # aligned chunk (llama4's chunked layers). Set per layer from the cache spec.
    chunk_size: int | None = None
    # [H, L] a bias table: position_bias[h, p] is added to each scaled score of head h
    # at key position p (L covers every key position of the step). A bias by the key's
    # position alone is any bias f(key) + g(query), the softmax being shift-invariant per
    # query row: a model's own ALiBi values where they are not slope * position (falcon
    # rounds its products to bfloat16). Only the torch path takes it; the backends route
    # a layer with one there (engine/attention/backends.py).
    position_bias: torch.Tensor | None = None

    def first_visible_key(self, position: int) -> int:
        """The first key position a query at ``position`` sees (window and chunk)."""
        first = 0
        if self.sliding_window is not None:
            first = max(first, position - self.sliding_window + 1)
        if self.chunk_size is not None:
            first = max(first, position - position % self.chunk_size)
        return first


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    shardline_ctx: AttentionContext | None = None,
    s_aux: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    shardline_layer_idx: int | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention entry point, and the one entry for adapters of modules
    transformers does not route here. query: [1, H, T, D]; key: [1, Hkv, T, D];
    value: [1, Hkv, T, Dv]; returns ([1, T, H, Dv], None).

    ``s_aux``: [H] attention-sink logits (transformers' name for them); ``alibi_slopes``:
    [H] ALiBi slopes and ``position_bias``: [H, L] a bias by key position (see
    AttentionOptions); ``shardline_layer_idx``: the cache layer
    of this call, for a module several layers call (else ``module.layer_idx``). The
    layer's chunk size, if any, comes from its cache spec through the backend."""
    if shardline_ctx is None:
        raise RuntimeError(
            "shardline attention was called without an AttentionContext: run the model "
            "through shardline's model runner"
        )
    layer_idx = shardline_layer_idx if shardline_layer_idx is not None else getattr(module, "layer_idx", None)
    assert isinstance(layer_idx, int) and layer_idx >= 0, f"{type(module).__name__} has no layer_idx"
    scale = scaling if scaling is not None else float(query.shape[-1]) ** -0.5
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    options = AttentionOptions(scale, sliding_window, softcap, s_aux, alibi_slopes, position_bias=position_bias)
    return attend_in_context(shardline_ctx, layer_idx, q, k, v, options).unsqueeze(0), None  # [1, T, H, Dv]


def attend_in_context(ctx: AttentionContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
    """What ``paged_attention_forward`` runs, for callers that hold the tokens-first
    layout already (the CPU path's fused decoder layers): the context's backend.
    query: [T, H, D]; key: [T, Hkv, D]; value: [T, Hkv, Dv]; returns [T, H, Dv]."""
    backend = ctx.backend
    assert backend is not None, "an AttentionContext built without its backend"
    return backend.attend(ctx, layer_idx, query, key, value, options)


def no_mask(*args, **kwargs) -> None:
    """The engine masks inside its attention; transformers must not build a mask."""
    return None


def register_implementation(name: str, attention_function) -> str:
    """Register ``attention_function`` with transformers under ``name``, with no mask
    construction (idempotent); return the name."""
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, no_mask)
    return name


def register() -> str:
    """Register the engine's paged attention; return its implementation name."""
    return register_implementation(ATTN_IMPLEMENTATION, paged_attention_forward)
