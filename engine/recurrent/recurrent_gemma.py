"""RecurrentGemma's recurrent block (Griffin / Hawk): a causal conv and the RG-LRU.

    y = act(linear_y(x));   u = conv1d(linear_x(x))
    i_t = sigmoid(u_t W_i + b_i),   r_t = sigmoid(u_t W_r + b_r)   (block-diagonal per head)
    log a_t = -8 r_t softplus(Lambda);   h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t * u_t)
    out = linear_out(h * y)
At a sequence's first token (position 0) a_t is 0 and the input is not rescaled.
The recurrence is diagonal, so a chunk of Q tokens is scanned in log2(Q) doubling
steps (selective_scan.doubling_scan), all requests' c-th chunks together.

Per request and layer the state is the conv window (the last K-1 inputs of the conv,
in the model's dtype) and h [lru_width] in float32, which is where the Hugging Face
block accumulates. The block returns (output, None), as the Hugging Face one does.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from .base import RecurrentKind, StateShapes, projection_weight, register_kind
from .chunk_layout import ChunkLayout
from .conv_varlen import causal_conv1d_varlen
from .decode_split import scan_split
from .selective_scan import doubling_scan

CHUNK = 32  # a token's state is one vector: the doubling scan's extra work is cheap


def linear_recurrence_varlen(decay, inputs, cu_seqlens, initial_state, chunk_size: int = CHUNK):
    """h_t = decay_t * h_{t-1} + inputs_t per request, from initial_state [B, ...];
    decay, inputs: [T, ...]. Returns (every h_t [T, ...], final states [B, ...])."""
    num_tokens = decay.shape[0]
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)
    decay_chunks, input_chunks = layout.gather(decay), layout.gather(inputs)  # padding: decay 0, input 0
    # A padded slot must carry the state through: decay 1 there.
    decay_chunks = torch.where(layout.token_index[..., None] < num_tokens, decay_chunks, 1.0)
    decay_product, local = doubling_scan(decay_chunks, input_chunks)
    state = initial_state.clone()
    states = torch.empty_like(local)
    for position in range(layout.max_chunks):
        chunks = layout.chunks_at(position)
        requests = layout.request[chunks]
        states[chunks] = local[chunks] + decay_product[chunks] * state[requests][:, None]
        state[requests] = states[chunks, -1]
    return layout.scatter(states), state


def _rg_lru_inputs(rg_lru, u: torch.Tensor, is_first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence's decay a_t and normalised input [T, W] from the conv output u [T, W]."""
    heads, width = rg_lru.num_attention_heads, rg_lru.block_width
    per_head = u.reshape(-1, heads, width)
    input_gate = torch.sigmoid(torch.einsum("thi,hij->thj", per_head, rg_lru.input_gate_weight)
                               + rg_lru.input_gate_bias).reshape(u.shape)
    recurrent_gate = torch.sigmoid(torch.einsum("thi,hij->thj", per_head, rg_lru.recurrent_gate_weight)
                                   + rg_lru.recurrent_gate_bias).reshape(u.shape)
    log_decay = -8.0 * recurrent_gate * F.softplus(rg_lru.recurrent_param)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_decay))
    multiplier = torch.where(is_first[:, None], 1.0, multiplier)
    decay = torch.exp(log_decay) * ~is_first[:, None]
    return decay, u * input_gate * multiplier.to(u.dtype)


class RecurrentBlockModule(Protocol):
    """What the kind reads of transformers' RecurrentGemmaRecurrentBlock; projections
    typed as any module (LoRA wraps them), its RG-LRU read by ``_rg_lru_inputs``."""

    linear_x: nn.Module
    linear_y: nn.Module
    linear_out: nn.Module
    act_fn: nn.Module
    conv_1d: nn.Conv1d  # depthwise, weight [W, 1, K]
    rg_lru: nn.Module
    conv1d_width: int
    lru_width: int


class RGLRUBlockKind(RecurrentKind):
    """RecurrentGemmaRecurrentBlock."""

    name = "rg_lru"
    # The convolution runs through the CPU kernel where it takes the step's tensors,
    # once chosen.
    has_native_core = True
    # RecurrentGemma's decoder layer unpacks (output, state) from its temporal block.
    returns_tuple = True
    reference_dtype = torch.float32  # HF accumulates the recurrence in float32

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(RecurrentBlockModule, hf_module)
        return {
            "conv": ((m.conv1d_width - 1, m.lru_width), projection_weight(m.linear_x).dtype),
            "recurrent": ((m.lru_width,), torch.float32),
        }

    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["conv"]: [B, K-1, W]; states["recurrent"]: [B, W]
        m = cast(RecurrentBlockModule, hf_module)
        y = m.act_fn(m.linear_y(hidden_states))
        u = causal_conv1d_varlen(
            m.linear_x(hidden_states), m.conv_1d.weight.squeeze(1), m.conv_1d.bias, cu_seqlens, has_initial_state,
            states["conv"], native=self.native_core,
        )
        is_first = torch.zeros(u.shape[0], dtype=torch.bool, device=u.device)
        is_first[cu_seqlens[:-1][~has_initial_state]] = True  # position 0 of a fresh request
        decay, inputs = _rg_lru_inputs(m.rg_lru, u, is_first)
        decay, inputs = decay.float(), inputs.float()

        def decode(state, decay, inputs):
            state.copy_(decay * state + inputs)
            return state.clone()

        def chunk(initial, cu, decay, inputs):
            return linear_recurrence_varlen(decay, inputs, cu, initial)

        h = scan_split(cu_seqlens, has_initial_state, states["recurrent"], (decay, inputs), decode, chunk)
        return m.linear_out(h.to(u.dtype) * y)


RG_LRU = register_kind(
    RGLRUBlockKind(),
    module_classes=("RecurrentGemmaRecurrentBlock",),
    model_types=("recurrent_gemma",),
    layer_types=("linear_attention",),
)
