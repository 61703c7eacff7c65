"""Mamba-2's state-space dual (SSD) scan over a packed batch, in plain torch.

Per head h the state S [P, N] evolves token by token as
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T,    y_t = S_t C_t + D_h x_t
(B and C are shared by the heads of a group). The chunked form computes the same
thing a chunk of Q tokens at a time: inside a chunk, an attention-like product masked
by the decays; across chunks, a recurrence over chunk boundary states.

Invariants: every request's chunks start at its own first token (chunk c of request
b covers its tokens c*Q .. c*Q+Q-1), so no chunk holds two requests' tokens; padded
positions carry dt = 0 (decay 1, no input), so they change no state and no output;
each request's scan starts from its initial state (zero on a first chunk). The scan
runs in the caller's compute dtype: float32 for Mamba-2, as the Hugging Face torch
path runs it (dt and D in their own dtype), the model's own for float64 linear
attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.ssd_scan import ssd_chunk_scan_triton
from .chunk_layout import ChunkLayout


def segment_sum(values: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[..., l, s] = sum of values[s+1 .. l] for s <= l, -inf above."""
    size = values.shape[-1]
    expanded = values[..., None].expand(*values.shape, size)  # [..., r, s] = values[r]
    strictly_lower = torch.tril(torch.ones(size, size, dtype=torch.bool, device=values.device), -1)
    sums = torch.cumsum(expanded.masked_fill(~strictly_lower, 0), dim=-2)
    lower = torch.tril(torch.ones(size, size, dtype=torch.bool, device=values.device), 0)
    return sums.masked_fill(~lower, -torch.inf)


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of every request from its initial state, in ``compute_dtype``
    (float32, as HF's Mamba-2 runs it).

    x: [T, H, P], dt: [T, H] (already biased, softplus'd and clamped), A: [H] (negative),
    B, C: [T, G, N], D: [H], initial_state: [Bq, H, P, N] (zeros for a fresh request).
    Returns y [T, H, P] and the final states [Bq, H, P, N].
    """
    if x.is_cuda and triton_available() and compute_dtype == torch.float32 and x.dtype in KERNEL_DTYPES:
        return ssd_chunk_scan_triton(x, dt, A, B, C, D, cu_seqlens, initial_state)  # kernels/ssd_scan.py
    num_tokens, num_heads, head_dim = x.shape
    heads_per_group = num_heads // B.shape[1]
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)
    x, dt = x.to(compute_dtype), dt.to(compute_dtype)
    D_residual = D[:, None] * x if D is not None else None
    xdt = layout.gather(x * dt[..., None])  # [K, Q, H, P]
    dtA = layout.gather(A.to(compute_dtype) * dt).permute(0, 2, 1)  # [K, H, Q]
    B = layout.gather(B.to(compute_dtype).repeat_interleave(heads_per_group, dim=1, output_size=num_heads))
    C = layout.gather(C.to(compute_dtype).repeat_interleave(heads_per_group, dim=1, output_size=num_heads))
    A_cumsum = torch.cumsum(dtA, dim=-1)  # [K, H, Q]

    # 1. Inside each chunk: attention-like scores C_l . B_s masked by the decay from s to l.
    decay = torch.exp(segment_sum(dtA))  # [K, H, Q, Q]
    scores = torch.einsum("klhn,kshn->klsh", C, B) * decay.permute(0, 2, 3, 1)
    y_diag = torch.einsum("klsh,kshp->klhp", scores, xdt)

    # 2. Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [K, H, Q]
    chunk_states = torch.einsum("klhn,khl,klhp->khpn", B, decay_to_end, xdt)

    # 3. Across chunks, per request: the state entering each chunk. Chunks are laid out
    # [request, 1 + position] after the initial state; missing chunks decay by 1 and add 0.
    num_requests, max_chunks = layout.num_requests, layout.max_chunks
    states = chunk_states.new_zeros(num_requests, max_chunks + 1, num_heads, head_dim, chunk_states.shape[-1])
    states[:, 0] = initial_state.to(states.dtype)
    states[layout.request, layout.position + 1] = chunk_states
    chunk_decays = A_cumsum.new_zeros(num_requests, num_heads, max_chunks + 1)
    chunk_decays[layout.request, :, layout.position + 1] = A_cumsum[:, :, -1]
    across = torch.exp(segment_sum(chunk_decays))  # [Bq, H, z', z]
    boundary_states = torch.einsum("bhcz,bzhpn->bchpn", across, states)
    final_state = boundary_states[:, -1]
    entering = boundary_states[layout.request, layout.position]  # [K, H, P, N]

    # 4. The entering state's contribution to each position of its chunk.
    y_off = torch.einsum("klhn,khpn->klhp", C, entering) * torch.exp(A_cumsum).permute(0, 2, 1)[..., None]
    y = layout.scatter(y_diag + y_off)
    if D_residual is not None:
        y = y + D_residual
    return y, final_state


def ssd_decode_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    decay_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One token per request: state [Bq, H, P, N] updated in place; x [Bq, H, P],
    dt [Bq, H] (biased and softplus'd), B, C [Bq, G, N]. Returns y [Bq, H, P]. The
    decay is computed in ``decay_dtype`` (float32, as HF's Mamba-2 update does)."""
    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    B = B.repeat_interleave(heads_per_group, dim=1, output_size=num_heads)  # [Bq, H, N]
    C = C.repeat_interleave(heads_per_group, dim=1, output_size=num_heads)
    decay = torch.exp(dt.to(decay_dtype) * A.to(decay_dtype))[..., None, None]  # [Bq, H, 1, 1]
    new_state = state * decay + dt[..., None, None] * B[:, :, None, :] * x[..., None]
    state.copy_(new_state)
    y = torch.einsum("bhpn,bhn->bhp", new_state.to(C.dtype), C)
    if D is not None:
        y = y + x * D[:, None]
    return y


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Mamba's time step: softplus(dt + dt_bias), in dt's dtype."""
    return F.softplus(dt + dt_bias.to(dt.dtype))
