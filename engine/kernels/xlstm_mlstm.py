"""xLSTM's mLSTM recurrence in plain torch: the one-token step, the chunkwise form
and a packed-batch driver that splits each request's tokens between them.

Per head, the state is a matrix memory C [DQK, DV], a normaliser n [DQK] and a
running maximum m of the log gates (it keeps the exponentials in range). A token
(q, k, v, input gate i, forget gate f, both pre-activations) gives

    g = logsigmoid(f);  m' = max(g + m, i);  a = exp(g + m - m');  b = exp(i - m')
    C = a C + b k v^T;  n = a n + b k
    h = (q' C) / (max(|q' n|, exp(-m')) + eps)       with q' = q / sqrt(DQK)

A fresh request starts from C = n = 0 and m = 0. The chunkwise form computes the same
outputs for a run of whole chunks: the state once per chunk, the outputs inside a
chunk as a masked, gate-weighted attention over it.

transformers computes a forward call's tokens so: whole chunks of ``chunk_size`` in
the chunkwise form (in the inputs' dtype), the rest token by token with the step (its
state and outputs in ``state_dtype``, float32, whatever the inputs' dtype), and keeps
the state between calls in the model's dtype. ``mlstm_varlen`` does the same for each
request's scheduled tokens, so a prompt run whole takes transformers' arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH, 1])
MlstmState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# A replacement for the step loop over a packed batch (the C kernel), same arguments
# as ``step_loop_varlen``.
StepLoop = Callable[..., torch.Tensor]


def mlstm_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
               state: MlstmState, eps: float, state_dtype: torch.dtype) -> tuple[torch.Tensor, MlstmState]:
    """One token per row: q, k [B, NH, DQK]; v [B, NH, DV]; i, f [B, NH, 1]. Returns
    h [B, NH, DV] (q's dtype) and the state after the token (``state_dtype``)."""
    io_dtype = q.dtype
    c_old, n_old, m_old = (tensor.to(state_dtype) for tensor in state)
    log_f = F.logsigmoid(f)
    m_new = torch.maximum(log_f + m_old, i)
    decay = torch.exp(log_f + m_old - m_new)
    gain = torch.exp(i - m_new)
    q_scaled = q * q.shape[-1] ** -0.5
    c_new = decay[..., None] * c_old + gain[..., None] * (k[..., :, None] @ v[..., None, :])
    n_new = decay * n_old + gain * k
    numerator = (q_scaled[..., None, :] @ c_new.to(io_dtype)).squeeze(-2).to(state_dtype)
    qn = (q_scaled[..., None, :] @ n_new[..., None].to(io_dtype)).squeeze(-2)
    denominator = (torch.maximum(qn.abs(), torch.exp(-m_new)) + eps).to(state_dtype)
    h = (numerator / denominator).to(io_dtype)
    return h, (c_new.to(state_dtype), n_new.to(state_dtype), m_new.to(state_dtype))


def _chunk_states(k: torch.Tensor, v: torch.Tensor, log_f_cum: torch.Tensor, i: torch.Tensor,
                  state: MlstmState) -> tuple[list[MlstmState], MlstmState]:
    """Each chunk's entering state and the state after the last: k [NH, NC, L, DQK],
    v [NH, NC, L, DV]; log_f_cum, i [NH, NC, L]; state (C [NH, DQK, DV], n, m [NH])."""
    c, n, m = state
    weight = log_f_cum[..., -1:] - log_f_cum + i  # [NH, NC, L]: a key's weight at its chunk's end
    total_decay = log_f_cum[..., -1]
    weight_max = weight.max(-1).values
    entering = []
    for chunk in range(k.shape[1]):
        entering.append((c, n, m))
        m_next = torch.maximum(total_decay[:, chunk] + m, weight_max[:, chunk])
        gated_k = k[:, chunk] * torch.exp(weight[:, chunk] - m_next[:, None])[..., None]
        carry = torch.exp(total_decay[:, chunk] + m - m_next)[:, None]
        c = carry[..., None] * c + gated_k.transpose(-2, -1) @ v[:, chunk]
        n = carry * n + gated_k.transpose(-2, -1).sum(-1)
        m = m_next
    return entering, (c, n, m)


def mlstm_chunkwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                    state: MlstmState, chunk_size: int, eps: float) -> tuple[torch.Tensor, MlstmState]:
    """One request's whole chunks: q, k [NH, S, DQK]; v [NH, S, DV]; i, f [NH, S] with S
    a multiple of ``chunk_size``; state (C [NH, DQK, DV], n [NH, DQK], m [NH]). Returns
    h [NH, S, DV] and the state after the last token."""
    heads, length, dqk = q.shape
    chunks = length // chunk_size
    assert chunks * chunk_size == length, f"{length} tokens are not whole chunks of {chunk_size}"
    q, k = q.view(heads, chunks, chunk_size, dqk), k.view(heads, chunks, chunk_size, dqk)
    v = v.view(heads, chunks, chunk_size, -1)
    i = i.view(heads, chunks, chunk_size)
    log_f_cum = F.logsigmoid(f.view(heads, chunks, chunk_size)).cumsum(-1)
    entering, last = _chunk_states(k, v, log_f_cum, i, state)
    c_in = torch.stack([s[0] for s in entering], 1)  # [NH, NC, DQK, DV]
    n_in = torch.stack([s[1] for s in entering], 1)  # [NH, NC, DQK]
    m_in = torch.stack([s[2] for s in entering], 1)  # [NH, NC]
    scale = dqk ** -0.5
    causal = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    log_d = torch.where(causal, log_f_cum[..., :, None] - log_f_cum[..., None, :], -float("inf")) + i[..., None, :]
    m_inter = log_f_cum + m_in[..., None]  # [NH, NC, L]
    m_combined = torch.maximum(m_inter, log_d.max(-1).values)[..., None]
    weights = (q @ k.transpose(-2, -1)) * scale * torch.exp(log_d - m_combined)
    q_gated = q * torch.exp(m_inter[..., None] - m_combined) * scale
    numerator = q_gated @ c_in + weights @ v
    denominator = q_gated @ n_in[..., None] + weights.sum(-1, keepdim=True)
    denominator = torch.maximum(denominator.abs(), torch.exp(-m_combined))
    h = numerator / (denominator + eps)
    return h.reshape(heads, length, -1), last


def step_loop_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor, c: torch.Tensor, n: torch.Tensor, m: torch.Tensor,
                     eps: float, state_dtype: torch.dtype) -> torch.Tensor:
    """The step over each request's tokens [starts[b], starts[b] + lengths[b]) of the
    packed q, k [T, NH, DQK], v [T, NH, DV], i, f [T, NH], all requests' t-th tokens in
    one batched step. c [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH] hold each request's
    entering state and receive its last (in their dtype; ``state_dtype`` in between, as
    transformers keeps it through a call). Returns h [T, NH, DV]."""
    h = torch.zeros_like(v)
    starts_list, lengths_list = starts.tolist(), lengths.tolist()
    work = [c.to(state_dtype), n.to(state_dtype), m.to(state_dtype)[..., None]]
    for t in range(max(lengths_list, default=0)):
        rows = [b for b, length in enumerate(lengths_list) if length > t]
        tokens = torch.tensor([starts_list[b] + t for b in rows], device=q.device)
        index = torch.tensor(rows, device=q.device)
        state = (work[0][index], work[1][index], work[2][index])
        h[tokens], updated = mlstm_step(q[tokens], k[tokens], v[tokens], i[tokens][..., None], f[tokens][..., None],
                                        state, eps, state_dtype)
        for tensor, new in zip(work, updated):
            tensor[index] = new
    moved = [b for b, length in enumerate(lengths_list) if length]
    index = torch.tensor(moved, device=q.device)
    c[index], n[index] = work[0][index].to(c.dtype), work[1][index].to(n.dtype)
    m[index] = work[2][index, :, 0].to(m.dtype)
    return h


def mlstm_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                 cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, c: torch.Tensor, n: torch.Tensor,
                 m: torch.Tensor, chunk_size: int, eps: float, state_dtype: torch.dtype,
                 step_loop: StepLoop = step_loop_varlen) -> torch.Tensor:
    """The mLSTM over a packed batch: q, k [T, NH, DQK]; v [T, NH, DV]; i, f [T, NH]
    (gate pre-activations); cu_seqlens [B+1]; has_initial_state [B] bool; c, n, m
    [B, NH, DQK, DV], [B, NH, DQK], [B, NH], read where has_initial_state and updated in
    place. Each request's whole chunks of ``chunk_size`` run chunkwise (the inputs'
    dtype), the rest through ``step_loop``. Returns h [T, NH, DV] (q's dtype)."""
    fresh = ~has_initial_state.to(torch.bool)
    for state in (c, n, m):
        state[fresh] = 0
    bounds = cu_seqlens.tolist()
    h = torch.empty_like(v)
    starts, lengths = [], []
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        whole = (end - start) // chunk_size * chunk_size if end - start > 1 else 0
        if whole:
            span = slice(start, start + whole)
            heads_first = [tensor[span].transpose(0, 1) for tensor in (q, k, v, i, f)]
            out, (c_b, n_b, m_b) = mlstm_chunkwise(*heads_first, (c[b].to(q.dtype), n[b].to(q.dtype),
                                                                  m[b].to(q.dtype)), chunk_size, eps)
            h[span] = out.transpose(0, 1)
            c[b], n[b], m[b] = c_b.to(c.dtype), n_b.to(n.dtype), m_b.to(m.dtype)
        starts.append(start + whole)
        lengths.append(end - start - whole)
    if any(lengths):
        device = cu_seqlens.device
        rest = step_loop(q, k, v, i, f, torch.tensor(starts, device=device), torch.tensor(lengths, device=device),
                         c, n, m, eps, state_dtype)
        for start, length in zip(starts, lengths):
            h[start:start + length] = rest[start:start + length]
    return h
