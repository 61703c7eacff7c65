"""The engine's paged attention, plugged into transformers' attention interface.

A model loaded with ``attn_implementation="shardline"`` calls ``paged_attention_forward``
from every attention layer. The call carries an ``AttentionContext`` (through the
model's ``**kwargs``) describing the packed batch: all scheduled tokens of all
requests form one sequence of T tokens. Each layer writes its new K/V into the
paged cache at ``slot_mapping`` and then attends, per request, over that request's
whole context read back through its block table: with the Triton kernels on CUDA,
else with the plain-torch path of ``torch_attention``.

Masking is ours, so the mask interface entry returns None: transformers builds no
[T, T] mask for the packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .torch_attention import (DecodeBatch, PrefillBatch, TorchAttentionPlan, TorchPlans, attention_groups,
                              fresh_prompts, torch_paged_attention, write_kv_cache)

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
    # float64 ones (the kernels take 16- and 32-bit floats), and on CPU the torch
    # path with the native kernels below where the engine chose them.
    backend: str = "auto"
    # On CPU, on the "auto" backend: decoding requests attend through the native decode
    # kernel (kernels/cpu_attention.py) and prefill chunks through the native prefill
    # kernel (kernels/cpu_prefill_attention.py), as the engine chose at load
    # (engine/cpu_paths.py) and where the kernel takes the cache's layout.
    native_decode: bool = False
    native_prefill: bool = False
    # Set when the step reads the final hidden state of sampling requests' last tokens
    # only (no prompt logprobs, no LoRA): those packed rows in the order their logits
    # are kept, [n] int64; the requests they end, [n] int64 indices; and per request
    # its row in that list, [B] int64 (0 for the others). The last decoder layer then
    # needs queries, attention and MLP at these rows alone (engine/cpu_layers.py).
    sampled_rows: torch.Tensor | None = None
    sampled_requests: torch.Tensor | None = None
    sampled_query_rows: torch.Tensor | None = None
    # int32 copies of the per-request indices, which the Triton kernels take.
    _kernel_indices: "tuple[torch.Tensor, torch.Tensor] | None" = field(default=None, repr=False)
    # The torch path's work, built lazily once per step and shared by all layers.
    _plans: TorchPlans | None = field(default=None, repr=False)

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

    def torch_plans(self, num_heads: int) -> TorchPlans:
        """The torch path's work for this step (see TorchPlans)."""
        if self._plans is None:
            native_prefill = self._native_prefill(num_heads)
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            decode = self._native_decode_batch(query_lens, num_heads)
            prefill = None
            if native_prefill and bool((query_lens > 1).any()):
                prefill = PrefillBatch((query_lens > 1).nonzero().flatten(), self.query_start_loc.contiguous(),
                                       self.seq_lens, self.block_tables.contiguous())
            groups = attention_groups(query_lens, self.seq_lens, group_decoding=decode is None,
                                      group_chunks=not native_prefill)
            fresh = [] if native_prefill else fresh_prompts(self.query_start_loc, self.seq_lens)
            self._plans = TorchPlans(decode, prefill, [TorchAttentionPlan.build(self, group) for group in groups],
                                     fresh)
        return self._plans

    def _native_prefill(self, num_heads: int) -> bool:
        from .kernels.cpu_prefill_attention import prefill_kernel_available

        return (self.backend == "auto" and self.native_prefill
                and prefill_kernel_available(self.kv_caches[0][0], num_heads))

    def _native_decode_batch(self, query_lens: torch.Tensor, num_heads: int) -> DecodeBatch | None:
        from .kernels.cpu_attention import decode_kernel_available

        if (self.backend != "auto" or not self.native_decode
                or not decode_kernel_available(self.kv_caches[0][0], num_heads)):
            return None
        requests = (query_lens == 1).nonzero().flatten()
        if requests.numel() == 0:
            return None
        return DecodeBatch(requests, self.query_start_loc[:-1].contiguous(), self.seq_lens,
                           self.block_tables.contiguous())


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
        out = torch_paged_attention(q, k, v, k_cache, v_cache, shardline_ctx.torch_plans(q.shape[1]), scaling,
                                    sliding_window, softcap)
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
