"""Plain-torch references of the recurrent kernels: the CPU recurrent kernel
(cpu_recurrent.py's ``delta_rule_core`` and ``causal_conv1d``) and the Triton
convolution, delta-rule and Kimi delta attention kernels (causal_conv1d.py,
delta_rule.py, delta_rule_step.py, kda.py) are tested against these.

Each runs one request token by token, the recurrence as written, with none of the
chunking or batching the kernels and engine/recurrent/'s torch paths do:
- the depthwise causal convolution over a request's last W - 1 inputs and its tokens;
- the gated delta rule (one log decay per head):
      S'_t = exp(g_t) S_{t-1},  u_t = beta_t (v_t - S'_t^T k_t),  S_t = S'_t + k_t u_t^T,  o_t = S_t^T q_t;
- Kimi delta attention's step, the same rule with one log decay per key channel.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            initial_state: torch.Tensor | None, activation: str | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, token by token: x [L, D], weight [D, W], initial_state [W-1, D] or
    None. Returns (output [L, D], the last W-1 inputs [W-1, D])."""
    width = weight.shape[1]
    window = (initial_state.clone() if initial_state is not None
              else x.new_zeros((width - 1, x.shape[1])))
    outputs = []
    for token in x:
        taps = torch.cat([window, token[None]])  # [W, D], oldest first
        value = (taps.t() * weight).sum(-1)
        if bias is not None:
            value = value + bias
        outputs.append(value)
        window = taps[1:]
    out = torch.stack(outputs)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out, window


def gated_delta_rule_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, token by token (the rule in the module docstring): query, key
    [L, H, K], value [L, H, V], g, beta [L, H], initial_state [H, K, V] or None.
    Returns (output [L, H, V], the final state [H, K, V])."""
    num_heads, k_dim, v_dim = key.shape[1], key.shape[2], value.shape[2]
    state = (initial_state.clone() if initial_state is not None
             else value.new_zeros((num_heads, k_dim, v_dim)))
    outputs = []
    for t in range(query.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = (state * key[t][:, :, None]).sum(1)  # [H, V]
        update = (value[t] - predicted) * beta[t][:, None]
        state = state + key[t][:, :, None] * update[:, None, :]
        outputs.append((state * query[t][:, :, None]).sum(1))
    return torch.stack(outputs), state


def kda_step_reference(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
    """One token per request of the rule with a log decay per key channel: state
    [B, H, K, V] updated in place; q, k, g [B, H, K]; v [B, H, V]; beta [B, H].
    Returns o [B, H, V]."""
    decayed = state * g.exp()[..., None]
    predicted = (decayed * k[..., None]).sum(-2)  # [B, H, V]
    update = (v - predicted) * beta[..., None]
    new_state = decayed + k[..., None] * update[..., None, :]
    state.copy_(new_state)
    return (new_state * q[..., None]).sum(-2)


def delta_rule_core_reference(mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                              g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                              has_initial_state: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                              num_key_heads: int) -> torch.Tensor:
    """cpu_recurrent.py's ``delta_rule_core`` (same arguments, same in-place updates of
    conv_state and state), one request at a time, token by token: the convolution's
    reference, then the gated delta rule's (g [T, H]: one decay per head) or Kimi delta
    attention's step (g [T, H, K]: one per key channel) on each token in turn."""
    num_heads, key_dim, value_dim = state.shape[1:]
    key_channels = num_key_heads * key_dim
    outputs = []
    for b in range(cu_seqlens.shape[0] - 1):
        tokens = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
        length = tokens.stop - tokens.start
        initial = bool(has_initial_state[b])
        convolved, conv_state[b] = causal_conv1d_reference(mixed_qkv[tokens], conv_weight, conv_bias,
                                                           conv_state[b] if initial else None, "silu")
        query, key, value = torch.split(convolved, [key_channels, key_channels, num_heads * value_dim], dim=-1)
        query, key = (l2_normalize(x.reshape(length, num_key_heads, key_dim)).repeat_interleave(
            num_heads // num_key_heads, dim=1) for x in (query, key))
        query, value = query * key_dim ** -0.5, value.reshape(length, num_heads, value_dim)
        if g.dim() == 2:
            out, state[b] = gated_delta_rule_reference(query, key, value, g[tokens], beta[tokens],
                                                       state[b] if initial else None)
        else:
            if not initial:
                state[b] = 0
            out = torch.cat([kda_step_reference(state[b : b + 1], query[t : t + 1], key[t : t + 1], value[t : t + 1],
                                                g[tokens][t : t + 1], beta[tokens][t : t + 1]) for t in range(length)])
        outputs.append(out)
    return torch.cat(outputs)
