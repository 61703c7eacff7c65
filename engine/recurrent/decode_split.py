"""Split a step's requests into single-token continuations and chunks.

State-space layers update a state one token at a time cheaply (no chunk padding), and
their Hugging Face modules take a different branch for it, so a step's requests with
one token that continue a saved state are decode requests, and the rest chunk
requests. Both groups keep their batch order.
"""

from __future__ import annotations

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
    def of(cls, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor) -> "DecodeSplit":
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
