"""Kimi delta attention (kimi_linear, bailing_hybrid): the gated delta rule with a
decay per key channel.

Per head the state S [K, V] evolves, with q and k L2-normalised and q scaled by K^-1/2:
    S'_t = diag(exp(g_t)) S_{t-1},   u_t = beta_t (v_t - S'_t^T k_t),
    S_t = S'_t + k_t u_t^T,           o_t = S_t^T q_t.
Inside a chunk of C tokens with cumulative log-decays G_t [K] (from the chunk's start)
and A_ts = sum_c k_t[c] k_s[c] e^(G_t[c] - G_s[c]):
    u_t + beta_t sum_{s<t} A_ts u_s = beta_t v_t - beta_t S_0^T (e^G_t * k_t),
a unit lower-triangular system solved for all chunks at once as u = U0 - W S_0; then
    o_t = (e^G_t * q_t)^T S_0 + sum_{s<=t} (q_t . (k_s * e^(G_t - G_s))) u_s,
    S_C = diag(e^G_C) S_0 + sum_s (k_s * e^(G_C - G_s)) u_s^T.
Only the hand-over of S between a request's chunks is sequential (one iteration per
chunk index, batched over requests). The pairwise decays are [C, C, K] per chunk and
head, so chunks are short.

Invariants: chunks never hold two requests' tokens; padding slots carry k = v = beta
= g = 0, which writes and decays nothing. As the Hugging Face module does, the rule
runs in float32 whatever the model's dtype, and the state is kept in float32. On the
CPU, where the engine takes the recurrent kernel, a float32 model's convolution, norms
and rule run as one C call per layer and step (engine/kernels/cpu_recurrent.py).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.cpu_recurrent import delta_rule_core, recurrent_kernel_available
from ..kernels.delta_rule_step import delta_rule_step_triton
from ..kernels.kda import chunk_kda_triton
from ..kernels.recurrent_reference import kda_step_reference
from .base import RecurrentKind, StateShapes, projection_weight, register_kind
from .chunk_layout import ChunkLayout
from .conv_varlen import causal_conv1d_varlen
from .decode_split import scan_split

CHUNK = 16


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the Hugging Face module's form)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, initial_state, chunk_size: int = CHUNK):
    """q, k, g: [T, H, K] (q, k normalised and q scaled); v: [T, H, V]; beta: [T, H];
    initial_state [B, H, K, V]. Returns (o [T, H, V], final states [B, H, K, V])."""
    if q.is_cuda and triton_available() and q.dtype in KERNEL_DTYPES:  # kernels/kda.py
        return chunk_kda_triton(q, k, v, g, beta, cu_seqlens, initial_state)
    num_tokens = q.shape[0]
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)
    # [N, H, C, D] / [N, H, C]
    q, k, v, g = (layout.gather(x).transpose(1, 2) for x in (q, k, v, g))
    beta = layout.gather(beta).transpose(1, 2)
    cum = torch.cumsum(g, dim=2)  # [N, H, C, K]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (cum[:, :, :, None] - cum[:, :, None, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    key_pairs = (k[:, :, :, None] * k[:, :, None, :] * pair_decay).sum(-1)  # [N, H, C, C]: A_ts
    system = (beta[..., None] * key_pairs).tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u0 = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * k * cum.exp(), upper=False, unitriangular=True)
    attn = (q[:, :, :, None] * k[:, :, None, :] * pair_decay).sum(-1)  # [N, H, C, C], s <= t
    q_decayed = q * cum.exp()
    k_to_end = k * (cum[:, :, -1:] - cum).exp()
    chunk_decay = cum[:, :, -1].exp()[..., None]  # [N, H, K, 1]

    state = initial_state.clone()
    out = torch.empty_like(v)
    for position in range(layout.max_chunks):
        chunks = layout.chunks_at(position)
        requests = layout.request[chunks]
        s0 = state[requests]
        u = u0[chunks] - w[chunks] @ s0
        out[chunks] = q_decayed[chunks] @ s0 + attn[chunks] @ u
        state[requests] = s0 * chunk_decay[chunks] + k_to_end[chunks].transpose(-1, -2) @ u
    return layout.scatter(out.transpose(1, 2)), state


def kda_decode_step(state, q, k, v, g, beta) -> torch.Tensor:
    """One token per request: state [B, H, K, V] updated in place; q, k, g [B, H, K];
    v [B, H, V]; beta [B, H]. Returns o [B, H, V]."""
    if q.is_cuda and triton_available() and state.dtype == q.dtype == torch.float32:  # kernels/delta_rule_step.py
        return delta_rule_step_triton(q, k, v, g, beta, state)
    return kda_step_reference(state, q, k, v, g, beta)  # the recurrence itself, batched


class KimiDeltaAttentionModule(Protocol):
    """What the kind reads of the transformers modules registered for it (below);
    projections and norms typed as any module (LoRA wraps them). The output gate is
    ``g_proj`` where the module has one, else ``g_b_proj(g_a_proj(x))`` (a low-rank gate)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    b_proj: nn.Module
    forget_gate: nn.Module
    o_norm: nn.Module
    o_proj: nn.Module
    conv1d: nn.Conv1d  # depthwise, weight [3 H K, 1, W]
    activation: str
    num_heads: int
    head_dim: int
    qkv_dim: int  # H * K
    conv_dim: int  # 3 H K
    conv_kernel_size: int


class _LowRankGate(Protocol):
    """Kimi Linear's output gate, ``g_b_proj(g_a_proj(x))``."""

    g_a_proj: nn.Module
    g_b_proj: nn.Module


class KimiDeltaAttentionKind(RecurrentKind):
    """KimiLinearDeltaAttention and BailingHybridDeltaAttention."""

    name = "kimi_delta_attention"
    # The convolution, norms and delta rule run through the CPU kernel where it takes
    # the step's tensors, once chosen.
    has_native_core = True
    reference_dtype = torch.float32  # HF runs the delta rule in float32 whatever the model's dtype

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(KimiDeltaAttentionModule, hf_module)
        return {
            "conv": ((m.conv_kernel_size - 1, m.conv_dim), projection_weight(m.q_proj).dtype),
            "recurrent": ((m.num_heads, m.head_dim, m.head_dim), torch.float32),
        }

    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["conv"]: [B, W-1, 3*H*K]; states["recurrent"]: [B, H, K, V]
        m = cast(KimiDeltaAttentionModule, hf_module)
        heads, head_dim = m.num_heads, m.head_dim
        mixed = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states)], dim=-1)
        g = m.forget_gate(hidden_states[None])[0].float()
        beta = torch.sigmoid(m.b_proj(hidden_states)).float()
        if self._takes_native_core(m, mixed, states):
            out = delta_rule_core(mixed, m.conv1d.weight[:, 0, :], m.conv1d.bias, g.contiguous(), beta.contiguous(),
                                  cu_seqlens, has_initial_state, states["conv"], states["recurrent"], heads)
        else:
            out = self._torch_core(m, mixed, g, beta, cu_seqlens, has_initial_state, states)
        g_proj = getattr(m, "g_proj", None)  # bailing_hybrid's full-rank gate
        if g_proj is not None:
            gate = g_proj(hidden_states)
        else:
            low_rank = cast(_LowRankGate, hf_module)
            gate = low_rank.g_b_proj(low_rank.g_a_proj(hidden_states))
        out = m.o_norm(out.to(hidden_states.dtype), gate.reshape(-1, heads, head_dim))
        return m.o_proj(out.reshape(-1, heads * head_dim))


    def _takes_native_core(self, m: KimiDeltaAttentionModule, mixed: torch.Tensor,
                           states: dict[str, torch.Tensor]) -> bool:
        """The kernel runs float32 throughout (the state's dtype), SiLU, no gradients."""
        return (self.native_core and mixed.device.type == "cpu" and not mixed.requires_grad
                and mixed.dtype == states["conv"].dtype == states["recurrent"].dtype == m.conv1d.weight.dtype
                and m.activation == "silu" and recurrent_kernel_available(mixed.dtype, m.head_dim, m.head_dim))

    @staticmethod
    def _torch_core(m: KimiDeltaAttentionModule, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]
                    ) -> torch.Tensor:
        """The convolution, l2 norms and delta rule in torch ops: mixed [T, 3 H K] -> [T, H, V]."""
        heads, head_dim = m.num_heads, m.head_dim
        mixed = causal_conv1d_varlen(
            mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias, cu_seqlens, has_initial_state, states["conv"],
            m.activation,
        )
        q, k, v = (t.reshape(-1, heads, head_dim).float() for t in mixed.split(m.qkv_dim, dim=-1))
        q = l2norm(q) * head_dim**-0.5
        k = l2norm(k)

        def chunk(initial, cu, q, k, v, g, beta):
            return chunk_kda_varlen(q, k, v, g, beta, cu, initial)

        return scan_split(cu_seqlens, has_initial_state, states["recurrent"], (q, k, v, g, beta), kda_decode_step,
                          chunk)


KIMI_DELTA = register_kind(
    KimiDeltaAttentionKind(),
    module_classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
    model_types=("kimi_linear", "bailing_hybrid"),
    layer_types=("linear_attention",),
)
