"""RWKV-4's block (transformers' RwkvBlock): a time mix and a channel mix, each behind
a token shift, the time mix over the WKV recurrence.

    x = ln1(h);  s = shift(x)      (the previous token's x; zero before a request's first)
    k, v, r = key(mix_k(x, s)), value(mix_v(x, s)), sigmoid(receptance(mix_r(x, s)))
    h = h + output(r * wkv(k, v))
    x = ln2(h);  s = shift(x)
    h = h + sigmoid(receptance(mix_r(x, s))) * value(relu(key(mix_k(x, s)))^2)
where mix(x, s) = x * mu + s * (1 - mu). The WKV recurrence keeps, per channel, a
numerator, a denominator and the running maximum exponent that keeps both in range
(engine/kernels/rwkv_wkv.py holds its step, the one place its arithmetic is written).

The whole block is one kind (both halves keep state, and the engine keeps one
recurrent layer per decoder layer). Per request and layer the state is the two shifts'
last inputs (in the model's dtype) and the WKV numerator, denominator and maximum in
float32, where transformers keeps them between calls. The block returns (output, None,
None), as transformers' does.

transformers' model rescales the blocks' output weights by powers of two at its first
forward in eval mode (``rescale_every``), reaching into the blocks; ``prepare_model``
runs that rescale before the blocks are wrapped, so the model's own forward finds them
rescaled and halves the residual stream where the rescaled weights expect it.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.cpu_rwkv import rwkv_kernel_available, wkv_varlen_cpu
from ..kernels.rwkv_wkv import wkv_varlen
from ..kernels.rwkv_wkv_triton import wkv_varlen_triton
from .base import RecurrentKind, StateShapes, projection_out_features, projection_weight, register_kind


class TimeMixModule(Protocol):
    """What the kind reads of transformers' RwkvSelfAttention (projections typed as
    any module: LoRA and the CPU paths wrap them)."""

    time_decay: nn.Parameter  # [A]
    time_first: nn.Parameter  # [A]
    time_mix_key: nn.Parameter  # [1, 1, hidden]
    time_mix_value: nn.Parameter
    time_mix_receptance: nn.Parameter
    key: nn.Module
    value: nn.Module
    receptance: nn.Module
    output: nn.Module


class ChannelMixModule(Protocol):
    """What the kind reads of transformers' RwkvFeedForward."""

    time_mix_key: nn.Parameter  # [1, 1, hidden]
    time_mix_receptance: nn.Parameter
    key: nn.Module
    receptance: nn.Module
    value: nn.Module


class RwkvBlockModule(Protocol):
    """What the kind reads of transformers' RwkvBlock (``pre_ln`` on block 0 only)."""

    layer_id: int
    pre_ln: nn.Module  # block 0 only
    ln1: nn.Module
    ln2: nn.Module
    attention: nn.Module
    feed_forward: nn.Module


def token_shift(x: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """Each token's predecessor in its request [T, D]: the saved last input ``state``
    [B, D] before a continuing request's first token, zero before a fresh one's.
    Leaves ``state`` holding each request's last token."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:] - 1
    assert bool((ends >= starts).all()), "every request of a step has at least one token"
    shifted = torch.empty_like(x)
    shifted[1:] = x[:-1]
    shifted[starts] = torch.where(has_initial_state[:, None], state, 0.0).to(x.dtype)
    state.copy_(x[ends])
    return shifted


def _mix(x: torch.Tensor, shifted: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    mu = mu.reshape(-1)
    return x * mu + shifted * (1 - mu)


def _wkv(m: TimeMixModule, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
         has_initial_state: torch.Tensor, states: dict[str, torch.Tensor], native: bool) -> torch.Tensor:
    """The WKV scan: where the model computes it in float32 (its decay and bonus
    float32), the Triton kernel on CUDA (inputs of a kernel dtype) or, with ``native``,
    the C kernel on the CPU (float32 inputs); else the torch scan."""
    wkv_states = (states["num"], states["den"], states["max"])
    float32_scan = m.time_decay.dtype == m.time_first.dtype == torch.float32
    if (native and float32_scan and key.device.type == "cpu" and key.dtype == value.dtype == torch.float32
            and all(state.is_contiguous() for state in wkv_states) and rwkv_kernel_available()):
        return wkv_varlen_cpu(-torch.exp(m.time_decay), m.time_first.contiguous(), key, value, cu_seqlens,
                              has_initial_state, *wkv_states)
    if (key.is_cuda and triton_available() and value.dtype in KERNEL_DTYPES
            and float32_scan and all(state.is_contiguous() for state in wkv_states)):
        return wkv_varlen_triton(-torch.exp(m.time_decay), m.time_first.contiguous(), key, value, cu_seqlens.long(),
                                 has_initial_state, *wkv_states)
    return wkv_varlen(m.time_decay, m.time_first, key, value, cu_seqlens, has_initial_state, *wkv_states)


class RwkvBlockKind(RecurrentKind):
    """RwkvBlock: time mix (WKV) and channel mix with their token shifts."""

    name = "rwkv"
    # The WKV scan runs through the C kernel (kernels/cpu_rwkv.c) once the CPU paths
    # choose the recurrent kernel.
    has_native_core = True
    # transformers keeps the WKV state in float32 between calls in every model dtype.
    reference_dtype = torch.float32

    def prepare_model(self, model: nn.Module) -> None:
        for module in model.modules():
            rescale = getattr(module, "_rescale_layers", None)
            if type(module).__name__ == "RwkvModel" and callable(rescale) and not module.training:
                rescale()  # transformers' own rescale, as its first eval forward would run it

    def state_shapes(self, hf_module: nn.Module, hf_config) -> StateShapes:
        m = cast(RwkvBlockModule, hf_module)
        attention = cast(TimeMixModule, m.attention)
        hidden_dtype = projection_weight(attention.key).dtype
        hidden = projection_weight(attention.key).shape[1]
        width = projection_out_features(attention.key)
        return {
            "att_shift": ((hidden,), hidden_dtype),
            "ffn_shift": ((hidden,), hidden_dtype),
            "num": ((width,), torch.float32),
            "den": ((width,), torch.float32),
            "max": ((width,), torch.float32),
        }

    def module_output(self, hf_module: nn.Module, output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return output, None, None  # RwkvModel unpacks (hidden, state, attentions)

    def forward(
        self,
        hf_module: nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        # hidden_states: [T, hidden]; shifts [B, hidden]; num, den, max [B, A] float32
        m = cast(RwkvBlockModule, hf_module)
        if m.layer_id == 0:
            hidden_states = m.pre_ln(hidden_states)
        hidden_states = hidden_states + self._time_mix(cast(TimeMixModule, m.attention), m.ln1(hidden_states),
                                                       cu_seqlens, has_initial_state, states)
        return hidden_states + self._channel_mix(cast(ChannelMixModule, m.feed_forward), m.ln2(hidden_states),
                                                 cu_seqlens, has_initial_state, states["ffn_shift"])

    def _time_mix(self, m: TimeMixModule, x: torch.Tensor, cu_seqlens: torch.Tensor,
                  has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        shifted = token_shift(x, cu_seqlens, has_initial_state, states["att_shift"])
        key = m.key(_mix(x, shifted, m.time_mix_key))
        value = m.value(_mix(x, shifted, m.time_mix_value))
        receptance = torch.sigmoid(m.receptance(_mix(x, shifted, m.time_mix_receptance)))
        wkv = _wkv(m, key, value, cu_seqlens, has_initial_state, states, self.native_core)
        return m.output(receptance * wkv)

    def _channel_mix(self, m: ChannelMixModule, x: torch.Tensor, cu_seqlens: torch.Tensor,
                     has_initial_state: torch.Tensor, shift_state: torch.Tensor) -> torch.Tensor:
        shifted = token_shift(x, cu_seqlens, has_initial_state, shift_state)
        key = torch.square(torch.relu(m.key(_mix(x, shifted, m.time_mix_key))))
        receptance = torch.sigmoid(m.receptance(_mix(x, shifted, m.time_mix_receptance)))
        return receptance * m.value(key)


# RWKV's config names no layer types: every layer is a block of this kind.
RWKV = register_kind(RwkvBlockKind(), module_classes=("RwkvBlock",), model_types=("rwkv",),
                     layer_types=("recurrent",))
