"""Lightning attention (minimax): linear attention with a fixed per-head decay.

Per head h, with slope s_h, the state S [d_k, d_v] evolves as
    S_t = exp(-s_h) S_{t-1} + k_t^T v_t,    o_t = q_t S_t
where q, k, v = act(qkv_proj(x)) split per head. That is Mamba-2's SSD recurrence
with dt = 1, A = -s_h, x = v, B = k, C = q and one group per head, so the chunked
scan of ssd.py runs it (in the model's dtype, float32 at least; the Hugging Face
module computes in the model's dtype). The output is RMS-normed, gated by
sigmoid(output_gate(x)) and projected.

Per request and layer the state is S, kept transposed as [H, d_v, d_k] (the SSD
layout). The Hugging Face module returns (output, state); the kind returns the output.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.selective_scan import ssd_decode_packed
from .base import RecurrentKind, StateShapes, projection_weight, register_kind
from .decode_split import scan_split
from .ssd import ssd_chunk_scan_varlen, ssd_decode_step

CHUNK = 64


class LightningAttentionModule(Protocol):
    """What the kind reads of transformers' MiniMaxLightningAttention; projections and
    norms typed as any module (LoRA wraps them)."""

    qkv_proj: nn.Module
    output_gate: nn.Module
    out_proj: nn.Module
    norm: nn.Module
    act_fn: nn.Module
    slope_rate: torch.Tensor  # [H, 1, 1]: each head's decay rate
    num_attention_heads: int
    head_dim: int


class LightningAttentionKind(RecurrentKind):
    """MiniMax's lightning attention layers."""

    name = "lightning_attention"
    reference_dtype = torch.float32  # HF's block path reads decay tables it built in float32
    # MiniMax's decoder layer unpacks (output, state) from its attention (engine/recurrent/state.py).
    returns_tuple = True

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(LightningAttentionModule, hf_module)
        dtype = torch.promote_types(projection_weight(m.qkv_proj).dtype, torch.float32)
        return {"kv": ((m.num_attention_heads, m.head_dim, m.head_dim), dtype)}

    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["kv"]: [B, H, d_v, d_k]
        m = cast(LightningAttentionModule, hf_module)
        heads, head_dim = m.num_attention_heads, m.head_dim
        qkv = m.act_fn(m.qkv_proj(hidden_states)).reshape(-1, heads, 3 * head_dim)
        q, k, v = qkv.split(head_dim, dim=-1)
        kv_state = states["kv"]
        compute_dtype = kv_state.dtype
        A = -m.slope_rate.reshape(heads).to(compute_dtype)
        dt = torch.ones(q.shape[:2], dtype=compute_dtype, device=q.device)

        on_triton = q.is_cuda and triton_available() and compute_dtype == torch.float32 and q.dtype in KERNEL_DTYPES

        def decode(state, q, k, v, dt):
            if on_triton:  # kernels/selective_scan.py
                return ssd_decode_packed(state, v, dt, A, k, q, None)
            return ssd_decode_step(state, v, dt, A, k, q, None, decay_dtype=compute_dtype)

        def chunk(initial, cu, q, k, v, dt):
            return ssd_chunk_scan_varlen(v, dt, A, k, q, None, CHUNK, cu, initial, compute_dtype=compute_dtype)

        out = scan_split(cu_seqlens, has_initial_state, kv_state, (q, k, v, dt), decode, chunk)
        out = m.norm(out.reshape(-1, heads * head_dim).to(hidden_states.dtype))
        out = F.sigmoid(m.output_gate(hidden_states)) * out
        return m.out_proj(out)


LIGHTNING = register_kind(
    LightningAttentionKind(),
    module_classes=("MiniMaxLightningAttention",),
    model_types=("minimax",),
    layer_types=("linear_attention",),
)
