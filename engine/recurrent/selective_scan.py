"""Mamba-1's selective scan over a packed batch, in plain torch.

Per channel d the state h [N] evolves as
    h_t = exp(dt_t,d * A_d) * h_{t-1} + dt_t,d * B_t x_t,d,    y_t,d = h_t . C_t + D_d x_t,d
(B and C are shared by the channels of a group: all of them in Mamba, one head's in
Zamba). The decay differs per channel and state entry, so there is no attention-like
chunk form as in Mamba-2. All requests' c-th chunks of Q tokens are taken together:
their decays, inputs and outputs are computed for the whole chunk at once, and the
recurrence itself steps through the chunk's Q positions, each step over every
channel, state entry and request (a parallel doubling scan does log2(Q) times the
work, which loses on CPU at real widths: 5 s against 0.4 s for 4 x 256 tokens at
1024 channels x 16 states). Chunk c+1 starts from chunk c's last state.

Invariants: chunks never hold two requests' tokens (chunk_layout.py); padded
positions have decay 1 and input 0, so a request's last state is its chunk's last
slot; a request starts from its initial state (zero on a first chunk). The scan runs
in float32 at least, and y is read from the state in the inputs' dtype, as Hugging
Face's torch path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk_layout import ChunkLayout

SCAN_CHUNK = 16


def doubling_scan(decay: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan over dim 1 of h_t = decay_t * h_{t-1} + inputs_t from h = 0, in
    log2(length) vectorised steps (pairs composed as (a_l a_r, a_r b_l + b_r));
    returns (prod of decays up to t, h_t). Worth it where a token's state is small."""
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
    groups, state_size = B.shape[1], B.shape[2]
    per_group = channels // groups
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)
    # Channels viewed as [G, Dc/G] so B and C broadcast over their group's channels.
    state_dtype = torch.promote_types(dt.dtype, torch.float32)
    state = initial_state.to(state_dtype).reshape(-1, groups, per_group, state_size).clone()
    A = A.reshape(groups, per_group, state_size)
    y = x.new_empty(num_tokens, groups, per_group)
    padded = {name: torch.cat([t, t.new_zeros(1, *t.shape[1:])])
              for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C))}
    for position in range(layout.max_chunks):
        chunks = layout.chunks_at(position)
        requests = layout.request[chunks]
        tokens = layout.token_index[chunks]  # [n, Q]
        dt_c = padded["dt"][tokens].reshape(*tokens.shape, groups, per_group, 1)
        x_c = padded["x"][tokens].float().reshape(*tokens.shape, groups, per_group, 1)
        B_c = padded["B"][tokens].float()[..., None, :]  # [n, Q, G, 1, N]
        C_c = padded["C"][tokens][..., None, :]  # [n, Q, G, 1, N]
        decay = torch.exp(A * dt_c)  # [n, Q, G, Dc/G, N]
        inputs = dt_c * B_c * x_c
        states = torch.empty_like(inputs)
        h = state[requests]
        for offset in range(chunk_size):
            h = decay[:, offset] * h + inputs[:, offset]
            states[:, offset] = h
        valid = tokens < num_tokens
        y[tokens[valid]] = (states.to(input_dtype) * C_c).sum(-1)[valid]
        state[requests] = h
    y = y.reshape(num_tokens, channels)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y, state.reshape(-1, channels, state_size)


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
    num_requests, channels = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    grouped = (num_requests, groups, channels // groups)
    A = A.float().reshape(groups, -1, state_size)
    dt32 = dt.float().reshape(*grouped, 1)
    decay = torch.exp(dt32 * A)
    inputs = dt32 * B.float()[:, :, None] * x.float().reshape(*grouped, 1)
    new_state = state.float().reshape(*grouped, state_size) * decay + inputs
    state.copy_(new_state.reshape(state.shape))
    y = (new_state.to(C.dtype) @ C[..., None]).reshape(num_requests, channels)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)
