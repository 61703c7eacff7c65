"""xLSTM's mLSTM step recurrence over a packed batch as one Triton kernel (CUDA): the
tokens transformers computes one at a time (decode tokens, and what is left of a
prompt chunk after its whole chunks).

One program runs one request's tokens in order for one head, a pass per BLOCK_V of its
value columns: that slice of the matrix memory C [DQK, BLOCK_V] stays in registers
through the tokens, beside the head's normaliser n and maximum m, which each pass
computes alike from their entering values (written once, after the last pass). The arithmetic is xlstm_mlstm.py's
``mlstm_step``, which with ``step_loop_varlen`` is the plain-torch reference the tests
compare this kernel with.

Layout (asserted by the launcher): q, k [T, NH, DQK] and v [T, NH, DV] float32 with
heads and elements packed (any token stride); i, f [T, NH] float32 with a unit head
stride; starts, lengths [B] int64; c [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH]
contiguous float32, updated in place for requests with tokens.
"""

from __future__ import annotations

import torch

from ._triton import launcher, next_power_of_2, require_triton, tl, triton

MAX_BLOCK_V = 32  # value columns per pass

if triton is not None:

    @triton.jit
    def _mlstm_steps_kernel(
        q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, h_ptr, starts_ptr, lengths_ptr, c_ptr, n_ptr, m_ptr,
        stride_q, stride_k, stride_v, stride_i, stride_f, stride_h, scale, eps,
        HEADS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, BLOCK_K)
        ok_k = rows < DQK
        start = tl.load(starts_ptr + request)
        count = tl.load(lengths_ptr + request)
        state = request * HEADS + head
        n_entering = tl.load(n_ptr + state * DQK + rows, mask=ok_k, other=0.0)
        m_entering = tl.load(m_ptr + state)
        n = n_entering
        m = m_entering
        # One pass over the tokens per block of value columns, each from the entering n and m.
        for first_col in range(0, DV, BLOCK_V):
            cols = first_col + tl.arange(0, BLOCK_V)
            ok_v = cols < DV
            c_offs = state * DQK * DV + rows[:, None] * DV + cols[None, :]
            ok_c = ok_k[:, None] & ok_v[None, :]
            c = tl.load(c_ptr + c_offs, mask=ok_c, other=0.0)
            n = n_entering
            m = m_entering
            for token in range(start, start + count):
                q = tl.load(q_ptr + token * stride_q + head * DQK + rows, mask=ok_k, other=0.0) * scale
                k = tl.load(k_ptr + token * stride_k + head * DQK + rows, mask=ok_k, other=0.0)
                v = tl.load(v_ptr + token * stride_v + head * DV + cols, mask=ok_v, other=0.0)
                gate_i = tl.load(i_ptr + token * stride_i + head)
                gate_f = tl.load(f_ptr + token * stride_f + head)
                log_f = tl.minimum(gate_f, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(gate_f)))
                m_new = tl.maximum(log_f + m, gate_i)
                decay = tl.exp(log_f + m - m_new)
                gain = tl.exp(gate_i - m_new)
                c = decay * c + gain * (k[:, None] * v[None, :])
                n = decay * n + gain * k
                numerator = tl.sum(q[:, None] * c, axis=0)
                qn = tl.sum(q * n, axis=0)
                denominator = tl.maximum(tl.abs(qn), tl.exp(-m_new)) + eps
                tl.store(h_ptr + token * stride_h + head * DV + cols, numerator / denominator, mask=ok_v)
                m = m_new
            if count > 0:
                tl.store(c_ptr + c_offs, c, mask=ok_c)
        if count > 0:
            tl.store(n_ptr + state * DQK + rows, n, mask=ok_k)
            tl.store(m_ptr + state, m)


def _packed(tensor: torch.Tensor, name: str, dim: int) -> None:
    assert tensor.dim() == dim and tensor.dtype == torch.float32, f"{name}: {tuple(tensor.shape)} {tensor.dtype}"
    assert tensor[0].is_contiguous(), f"{name} needs its heads and elements packed (any token stride)"


def mlstm_step_loop_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                           starts: torch.Tensor, lengths: torch.Tensor, c: torch.Tensor, n: torch.Tensor,
                           m: torch.Tensor, eps: float, state_dtype: torch.dtype,
                           block_v: int = MAX_BLOCK_V) -> torch.Tensor:
    """xlstm_mlstm.step_loop_varlen as one kernel launch, float32: q, k [T, NH, DQK];
    v [T, NH, DV]; i, f [T, NH]; starts, lengths [B] int64; c, n, m [B, NH, DQK, DV],
    [B, NH, DQK], [B, NH] contiguous float32, updated in place for requests with
    tokens. Returns h [T, NH, DV] (zero at tokens no request runs here)."""
    require_triton()
    assert state_dtype == torch.float32, f"the Triton step loop computes in float32, not {state_dtype}"
    for name, tensor, dim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("igate", i, 2), ("fgate", f, 2)):
        _packed(tensor, name, dim)
    tokens, heads, dqk = q.shape
    dv = v.shape[2]
    assert k.shape == q.shape and v.shape[:2] == (tokens, heads), f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert i.shape == f.shape == (tokens, heads), f"gates {tuple(i.shape)}, {tuple(f.shape)} for {tokens} tokens"
    requests = starts.shape[0]
    assert starts.dtype == lengths.dtype == torch.int64 and lengths.shape == (requests,), "bad starts or lengths"
    for name, state, shape in (("c", c, (requests, heads, dqk, dv)), ("n", n, (requests, heads, dqk)),
                               ("m", m, (requests, heads))):
        assert state.shape == shape and state.dtype == torch.float32 and state.is_contiguous(), \
            f"mLSTM state {name} must be {list(shape)} contiguous float32, got {tuple(state.shape)} {state.dtype}"
    h = torch.zeros((tokens, heads, dv), dtype=v.dtype, device=v.device)
    if requests == 0 or tokens == 0:
        return h
    block_v = min(block_v, next_power_of_2(dv))
    launcher(_mlstm_steps_kernel, (requests, heads))(
        q, k, v, i, f, h, starts, lengths, c, n, m, q.stride(0), k.stride(0), v.stride(0), i.stride(0), f.stride(0),
        h.stride(0), dqk ** -0.5, eps, HEADS=heads, DQK=dqk, DV=dv, BLOCK_K=next_power_of_2(dqk), BLOCK_V=block_v,
    )
    return h
