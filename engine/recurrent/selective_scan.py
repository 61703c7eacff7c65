"""Mamba-1's selective scan over a packed batch, in plain torch.

Per channel d the state h [N] evolves as
    h_t = exp(dt_t,d * A_d) * h_{t-1} + dt_t,d * B_t x_t,d,    y_t,d = h_t . C_t + D_d x_t,d
(B and C are shared by the channels of a group: all of them in Mamba, one head's in
Zamba). The decay differs per channel and state entry, so there is no attention-like
chunk form as in Mamba-2; instead each chunk of Q tokens is scanned in log2(Q)
vectorised doubling steps (pairs (a, b) composed as (a_l a_r, a_r b_l + b_r)), all
requests' c-th chunks together, and chunk c+1 starts from chunk c's last state.

Invariants: chunks never hold two requests' tokens (ssd.ChunkLayout); padded
positions have decay 1 and input 0, so a request's last state is its chunk's last
slot; a request starts from its initial state (zero on a first chunk). The scan runs
in float32 at least, and y is read from the state in the inputs' dtype, as Hugging
Face's torch path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ssd import ChunkLayout

SCAN_CHUNK = 32


def doubling_scan(decay: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan over dim 1 of h_t = decay_t * h_{t-1} + inputs_t from h = 0;
    returns (prod of decays up to t, h_t)."""
    shift = 1
    while shift < decay.shape[1]:
        inputs = torch.cat([inputs[:, :shift], decay[:, shift:] * inputs[:, :-shift] + inputs[:, shift:]], 1)
        decay = torch.cat([decay[:, :shift], decay[:, shift:] * decay[:, :-shift]], 1)
        shift *= 2
    return decay, inputs


def selective_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, dt (softplus'd), z: [T, Dc]; A: [Dc, N]; B, C: [T, G, N]; initial_state [Bq, Dc, N].
    Returns y [T, Dc] (with the D skip and the silu(z) gate) and the final states."""
    num_tokens, channels = x.shape
    input_dtype = x.dtype
    per_group = channels // B.shape[1]
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)
    state = initial_state.to(torch.promote_types(dt.dtype, torch.float32)).clone()
    y = x.new_empty(num_tokens, channels)
    padded = {name: torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C))}
    for position in range(layout.max_chunks):
        chunks = (layout.position == position).nonzero().squeeze(1)
        requests = layout.request[chunks]
        tokens = layout.token_index[chunks]  # [n, Q]
        dt_c = padded["dt"][tokens][..., None]  # [n, Q, Dc, 1]
        B_c = padded["B"][tokens].float().repeat_interleave(per_group, dim=2, output_size=channels)
        C_c = padded["C"][tokens].repeat_interleave(per_group, dim=2, output_size=channels)
        decay = torch.exp(A * dt_c)  # [n, Q, Dc, N]
        inputs = dt_c * B_c * padded["x"][tokens].float()[..., None]
        decay_product, local = doubling_scan(decay, inputs)
        states = local + decay_product * state[requests][:, None]
        valid = tokens < num_tokens
        y[tokens[valid]] = torch.einsum("nqdk,nqdk->nqd", states.to(input_dtype), C_c)[valid]
        state[requests] = states[:, -1]
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y, state


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
) -> torch.Tensor:
    """One token per request, in float32 as Hugging Face's update runs it: state
    [Bq, Dc, N] updated in place; x, dt (softplus'd), z: [Bq, Dc]; B, C: [Bq, G, N]."""
    channels = x.shape[1]
    per_group = channels // B.shape[1]
    B = B.repeat_interleave(per_group, dim=1, output_size=channels)  # [Bq, Dc, N]
    C = C.repeat_interleave(per_group, dim=1, output_size=channels)
    decay = torch.exp(dt.float()[..., None] * A.float())
    new_state = state.float() * decay + dt.float()[..., None] * B.float() * x.float()[..., None]
    state.copy_(new_state)
    y = torch.einsum("bdn,bdn->bd", new_state.to(C.dtype), C)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)
