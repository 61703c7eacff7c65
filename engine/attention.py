"""The engine's paged attention, plugged into transformers' attention interface.

A model loaded with ``attn_implementation="shardline"`` calls ``paged_attention_forward``
from every attention layer. The call carries an ``AttentionContext`` (through the
model's ``**kwargs``) describing the packed batch: all scheduled tokens of all
requests form one sequence of T tokens. Each layer writes its new K/V into the
paged cache at ``slot_mapping`` and then attends, per request, over that request's
whole context read back through its block table.

Masking is ours, so the mask interface entry returns None: transformers builds no
[T, T] mask for the packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "shardline"


@dataclass
class AttentionContext:
    """Everything one forward pass needs to find and extend the paged KV cache.

    Built once per step by the model runner and shared by all layers.
    """

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
    # "triton" runs the Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1),
    # "torch" the plain torch path; "auto" picks Triton for CUDA tensors, except
    # float64 ones (the kernels take 16- and 32-bit floats).
    backend: str = "auto"
    # int32 copies of the per-request indices, which the Triton kernels take.
    _kernel_indices: "tuple[torch.Tensor, torch.Tensor] | None" = field(default=None, repr=False)
    # Torch-path gather plans, built lazily once per step and shared by all layers.
    _plans: "list[TorchAttentionPlan] | None" = field(default=None, repr=False)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    def uses_triton(self, query: torch.Tensor) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and query.is_cuda
                                            and query.dtype != torch.float64)

    def kernel_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens) as int32, built once per step."""
        if self._kernel_indices is None:
            self._kernel_indices = (self.query_start_loc.to(torch.int32), self.seq_lens.to(torch.int32))
        return self._kernel_indices

    def torch_plans(self) -> "list[TorchAttentionPlan]":
        if self._plans is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._plans = [TorchAttentionPlan.build(self, group)
                           for group in attention_groups(query_lens, self.seq_lens)]
        return self._plans


# Requests are padded to the longest context of their group; grouping requests of
# similar length bounds that waste without many small launches.
MAX_LENGTH_GROUPS = 4
MIN_GROUP_SIZE = 8


def attention_groups(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Request indices in groups that pad little: decoding requests (one query
    token) apart from prefill chunks, and each kind split into up to
    MAX_LENGTH_GROUPS groups of similar context length."""
    decoding = query_lens == 1
    if bool(decoding.all()) or not bool(decoding.any()):
        return length_groups(seq_lens, torch.arange(len(seq_lens), device=seq_lens.device))
    return [group for kind in (decoding, ~decoding)
            for group in length_groups(seq_lens, kind.nonzero().flatten())]


def length_groups(seq_lens: torch.Tensor, requests: torch.Tensor) -> list[torch.Tensor]:
    """``requests`` split into up to MAX_LENGTH_GROUPS groups of similar context length.
    One group keeps the given order (all requests in packed order: no scatter back)."""
    num_groups = max(1, min(MAX_LENGTH_GROUPS, len(requests) // MIN_GROUP_SIZE))
    if num_groups == 1:
        return [requests]
    order = requests[torch.argsort(seq_lens[requests])]
    return list(torch.tensor_split(order, num_groups))


@dataclass
class TorchAttentionPlan:
    """Index tensors that turn the packed batch into padded per-request tensors.

    Keys are gathered a whole block at a time through the block tables (a
    contiguous copy per block, far cheaper than a gather per token), padded to
    the longest context of the step; masks exclude padded keys, future keys and
    keys outside a sliding window.
    """

    query_index: torch.Tensor  # [B, Qmax] int64 into the packed tokens (0 where padded)
    query_valid: torch.Tensor  # [B, Qmax] bool
    block_index: torch.Tensor  # [B * max_blocks] int64 block ids to gather
    num_blocks: int  # max_blocks: blocks per request after padding
    query_pos: torch.Tensor  # [B, Qmax] int64 position of each query token
    key_pos: torch.Tensor  # [Lmax] int64, Lmax = max_blocks * block_size
    key_valid: torch.Tensor  # [B, Lmax] bool
    output_index: torch.Tensor  # [n] packed index of each valid query, in plan order
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, ctx: AttentionContext, requests: torch.Tensor) -> "TorchAttentionPlan":
        """The plan for the requests at indices ``requests`` of the step."""
        device = ctx.slot_mapping.device
        block_size = ctx.kv_caches[0][0].shape[1]
        query_starts = ctx.query_start_loc[:-1][requests]
        query_lens = (ctx.query_start_loc[1:] - ctx.query_start_loc[:-1])[requests]  # [b]
        seq_lens = ctx.seq_lens[requests]
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        q_offsets = torch.arange(max_query_len, device=device)
        query_valid = q_offsets[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, query_starts[:, None] + q_offsets, 0)
        query_pos = (seq_lens - query_lens)[:, None] + q_offsets
        num_blocks = -(-max_seq_len // block_size)
        block_index = ctx.block_tables[requests, :num_blocks].long().reshape(-1)
        key_pos = torch.arange(num_blocks * block_size, device=device)
        key_valid = key_pos[None, :] < seq_lens[:, None]
        return cls(query_index, query_valid, block_index, num_blocks, query_pos, key_pos, key_valid,
                   query_index[query_valid])

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """cache: [N, bs, Hkv, D] -> [B, Hkv, Lmax, D] keys or values of each request."""
        _, block_size, num_kv_heads, head_dim = cache.shape
        gathered = cache.index_select(0, self.block_index)
        return gathered.view(-1, self.num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Qmax, Lmax] bool, True where a query may attend to a key."""
        if sliding_window not in self._masks:
            allowed = self.key_valid[:, None, :] & (self.key_pos[None, None, :] <= self.query_pos[:, :, None])
            if sliding_window is not None:
                allowed &= self.query_pos[:, :, None] - self.key_pos[None, None, :] < sliding_window
            # Padded query rows attend to key 0 so softmax stays finite; they are dropped.
            allowed[:, :, 0] |= ~self.query_valid
            self._masks[sliding_window] = allowed[:, None]
        return self._masks[sliding_window]


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V into the paged cache. key/value: [T, Hkv, D]; caches: [N, bs, Hkv, D]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def torch_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plans: list[TorchAttentionPlan],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of the packed queries over each request's paged context.

    query: [T, H, D]; k_cache, v_cache: [N, bs, Hkv, D]; returns [T, H, D].
    """
    if len(plans) == 1:  # one plan over all requests in packed order
        return _attend(query, k_cache, v_cache, plans[0], scale, sliding_window, softcap)
    output = torch.empty_like(query)
    for plan in plans:
        output.index_copy_(0, plan.output_index,
                           _attend(query, k_cache, v_cache, plan, scale, sliding_window, softcap))
    return output


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchAttentionPlan,
            scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """One plan's attention; returns [n, H, D] for its valid queries in plan order."""
    q = query[plan.query_index].transpose(1, 2)  # [B, H, Qmax, D]
    k = plan.gather(k_cache).to(q.dtype)  # [B, Hkv, Lmax, D]
    v = plan.gather(v_cache).to(q.dtype)
    out = padded_attention(q, k, v, plan.mask(sliding_window), False, scale, softcap)
    return out.transpose(1, 2)[plan.query_valid]


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention over padded per-request tensors, GQA by head groups, optional softcap.

    q: [b, H, Q, D]; k, v: [b, Hkv, L, D]; mask: bool, broadcastable to [b, H, Q, L]
    (True = attend), or None with ``causal``; returns [b, H, Q, D]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal:
        length = q.shape[2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype), v)


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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention entry point. query: [1, H, T, D]; key/value: [1, Hkv, T, D]."""
    if shardline_ctx is None:
        raise RuntimeError(
            "shardline attention was called without an AttentionContext: run the model "
            "through shardline's model runner"
        )
    layer_idx = getattr(module, "layer_idx", None)
    assert layer_idx is not None, f"{type(module).__name__} has no layer_idx"
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    k_cache, v_cache = shardline_ctx.kv_caches[layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if shardline_ctx.uses_triton(q):
        from .kernels import paged_attention, store_kv_cache

        query_start_loc, seq_lens = shardline_ctx.kernel_indices()
        store_kv_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, shardline_ctx.slot_mapping)
        out = paged_attention(
            q.contiguous(), k_cache, v_cache, query_start_loc, seq_lens,
            shardline_ctx.block_tables, scaling, sliding_window=sliding_window, softcap=softcap,
            max_query_len=shardline_ctx.max_query_len,
        )
    else:
        write_kv_cache(k, v, k_cache, v_cache, shardline_ctx.slot_mapping)
        out = torch_paged_attention(
            q, k_cache, v_cache, shardline_ctx.torch_plans(), scaling, sliding_window, softcap
        )
    return out.unsqueeze(0), None  # [1, T, H, D]


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
