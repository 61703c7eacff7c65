"""Split a step's requests into single-token continuations and chunks.

State-space layers update a state one token at a time cheaply (no chunk padding), and
their Hugging Face modules take a different branch for it, so a step's requests with
one token that continue a saved state are decode requests, and the rest chunk
requests. Both groups keep their batch order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeSplit:
    """Which requests and tokens take the single-token update, and which the chunked scan."""

    decode_requests: torch.Tensor  # [Bd] request indices
    decode_tokens: torch.Tensor  # [Bd] their tokens (one each)
    chunk_requests: torch.Tensor  # [Bc]
    chunk_tokens: torch.Tensor  # [Tc] their tokens, in packed order
    chunk_cu_seqlens: torch.Tensor  # [Bc + 1] over chunk_tokens

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor) -> DecodeSplit:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        is_decode = has_initial_state & (lengths == 1)
        decode_requests = is_decode.nonzero().squeeze(1)
        chunk_requests = (~is_decode).nonzero().squeeze(1)
        decode_tokens = cu_seqlens[decode_requests]
        token_is_decode = torch.zeros(int(cu_seqlens[-1]), dtype=torch.bool, device=cu_seqlens.device)
        token_is_decode[decode_tokens] = True
        return cls(
            decode_requests=decode_requests,
            decode_tokens=decode_tokens,
            chunk_requests=chunk_requests,
            chunk_tokens=(~token_is_decode).nonzero().squeeze(1),
            chunk_cu_seqlens=F.pad(torch.cumsum(lengths[chunk_requests], 0), (1, 0)),
        )

    @property
    def all_decode(self) -> bool:
        return self.chunk_requests.numel() == 0

    @property
    def no_decode(self) -> bool:
        return self.decode_requests.numel() == 0


def scan_split(
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    state: torch.Tensor,
    token_inputs: tuple[torch.Tensor, ...],
    decode: Callable[..., torch.Tensor],
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Run a step's requests through ``decode(state, *inputs)`` (one token each, the
    state [Bd, ...] updated in place) and ``chunk(initial_state, cu_seqlens, *inputs)``
    (returning outputs and final states), each on its own requests' slice of
    ``token_inputs`` ([T, ...] tensors); ``state`` [B, ...] is read where
    has_initial_state and left holding every request's final state. Returns [T, ...]."""
    if token_inputs[0].shape[0] == cu_seqlens.shape[0] - 1 and bool(has_initial_state.all()):
        return decode(state, *token_inputs)  # a decode step: one token per request, each continuing
    split = DecodeSplit.of(cu_seqlens, has_initial_state)
    if split.all_decode:
        return decode(state, *token_inputs)
    if split.no_decode:
        initial = torch.where(_expand(has_initial_state, state), state, 0.0)
        out, final = chunk(initial, cu_seqlens, *token_inputs)
        state.copy_(final)
        return out
    decoding, d_tokens = split.decode_requests, split.decode_tokens
    decode_state = state[decoding]
    out_decode = decode(decode_state, *(t[d_tokens] for t in token_inputs))
    state[decoding] = decode_state
    chunking, c_tokens = split.chunk_requests, split.chunk_tokens
    initial = torch.where(_expand(has_initial_state[chunking], state), state[chunking], 0.0)
    out_chunk, final = chunk(initial, split.chunk_cu_seqlens, *(t[c_tokens] for t in token_inputs))
    state[chunking] = final.to(state.dtype)
    out = out_chunk.new_empty(int(cu_seqlens[-1]), *out_chunk.shape[1:])
    out[d_tokens] = out_decode.to(out.dtype)
    out[c_tokens] = out_chunk
    return out


def _expand(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flags.reshape(-1, *([1] * (like.dim() - 1)))
