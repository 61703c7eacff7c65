"""RWKV-4's WKV recurrence in plain torch: the one-token step and a packed-batch scan.

Per channel, with w = -exp(time_decay) and u = time_first, the state is a numerator
a, a denominator b and the exponent p both are scaled by (a running maximum, so the
exponentials never overflow). A token (k, v) gives

    q = max(p, u + k);   out = (e^(p-q) a + e^(u+k-q) v) / (e^(p-q) b + e^(u+k-q))
    q' = max(p + w, k);  a = e^(p+w-q') a + e^(k-q') v;  b = e^(p+w-q') b + e^(k-q');  p = q'

A fresh request starts from a = b = 0 and p = -1e38. Keys are taken in float32 and
the state computed in float32 or the values' wider dtype, as transformers does; the
caller's state tensors (float32) receive it after each request's last token.
"""

from __future__ import annotations

import torch

FRESH_MAX = -1e38  # the running maximum of an empty state


def wkv_step(decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             num: torch.Tensor, den: torch.Tensor, maximum: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row: decay = -exp(time_decay) and first [A]; key (float32), value,
    num, den, maximum [N, A]. Returns (output, num, den, maximum) after the token."""
    output_max = torch.maximum(maximum, key + first)
    scale_state = torch.exp(maximum - output_max)
    scale_token = torch.exp(key + first - output_max)
    output = (scale_state * num + scale_token * value) / (scale_state * den + scale_token)
    state_max = torch.maximum(maximum + decay, key)
    scale_state = torch.exp(maximum + decay - state_max)
    scale_token = torch.exp(key - state_max)
    return output, scale_state * num + scale_token * value, scale_state * den + scale_token, state_max


def wkv_varlen(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, num: torch.Tensor, den: torch.Tensor,
               maximum: torch.Tensor) -> torch.Tensor:
    """The WKV output [T, A] (value's dtype) of a packed batch: key, value [T, A];
    request b's tokens are rows cu_seqlens[b]:cu_seqlens[b+1]. num, den, maximum [B, A]
    (float32) are read where has_initial_state [B] and updated in place. The requests'
    j-th tokens run together, one step per position of the longest request."""
    decay, first = -torch.exp(time_decay), time_first
    compute = torch.promote_types(torch.promote_types(torch.float32, value.dtype), decay.dtype)
    compute = torch.promote_types(compute, first.dtype)
    keep = has_initial_state[:, None]
    a = torch.where(keep, num, 0.0).to(compute)
    b = torch.where(keep, den, 0.0).to(compute)
    p = torch.where(keep, maximum, FRESH_MAX).to(compute)
    key = key.float()
    output = torch.empty_like(value)
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    for position in range(int(lengths.max()) if lengths.numel() else 0):
        rows = None if bool((lengths > position).all()) else (lengths > position).nonzero().squeeze(1)
        if rows is None:
            tokens = starts + position
            out, a, b, p = wkv_step(decay, first, key[tokens], value[tokens], a, b, p)
        else:
            tokens = starts[rows] + position
            out, a_rows, b_rows, p_rows = wkv_step(decay, first, key[tokens], value[tokens], a[rows], b[rows],
                                                   p[rows])
            a, b, p = a.index_copy(0, rows, a_rows), b.index_copy(0, rows, b_rows), p.index_copy(0, rows, p_rows)
        output[tokens] = out.to(output.dtype)
    num.copy_(a)
    den.copy_(b)
    maximum.copy_(p)
    return output
