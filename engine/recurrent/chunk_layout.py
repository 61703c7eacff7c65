"""A step's packed requests cut into fixed-size chunks, for the chunked scans.

Every chunked recurrence (the gated delta rule, Kimi delta attention, Mamba's
selective scan, Mamba-2's SSD, RG-LRU's linear recurrence) computes each chunk's
inner part for all chunks at once and hands the state from one chunk of a request
to the next. ``ChunkLayout`` says which tokens each chunk holds and orders the
chunks so that hand-over reads slices instead of gathers.

Invariants: request b's chunk j holds its tokens j*C .. j*C+C-1 (a chunk never holds
two requests' tokens); a slot past a request's last token is padding
(``token_index == num_tokens``, ``valid`` False); requests are ranked by chunk count,
most first (``order``: rank -> request), and the chunks are laid out chunk index
first, then rank, so the requests with a chunk at index j are ranks
``[0, active[j])`` and their chunks are ``offsets[j] + rank``: ``chunks_at(j)``.
"""

from __future__ import annotations

import torch


class ChunkLayout:
    """Where each chunk of a packed batch sits (see the module docstring).

    ``token_index`` [N, C]: each chunk slot's packed token (``num_tokens`` for padding);
    ``valid`` [N, C]; ``request`` [N] and ``position`` [N]: each chunk's request and its
    index among that request's chunks; ``order`` [B]: rank -> request."""

    def __init__(self, cu_seqlens: torch.Tensor, chunk_size: int, num_tokens: int) -> None:
        device = cu_seqlens.device
        self.num_tokens = num_tokens
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        chunks_per_request = (lengths + chunk_size - 1) // chunk_size
        self.num_requests = lengths.shape[0]
        self.num_chunks = int(chunks_per_request.sum())
        self.max_chunks = int(chunks_per_request.max()) if self.num_requests else 0
        self.order = torch.argsort(chunks_per_request, descending=True, stable=True)
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(self.num_requests, device=device)
        active = (chunks_per_request[:, None] > torch.arange(self.max_chunks, device=device)).sum(0)
        offset = torch.cumsum(active, 0) - active
        self.active: list[int] = active.tolist()
        self.offsets: list[int] = offset.tolist()
        # Chunks in request order first, then moved to their place in the layout.
        request = torch.repeat_interleave(torch.arange(self.num_requests, device=device), chunks_per_request,
                                          output_size=self.num_chunks)
        first_chunk = torch.cumsum(chunks_per_request, 0) - chunks_per_request
        local = torch.arange(self.num_chunks, device=device) - first_chunk[request]
        index = (cu_seqlens[:-1][request] + local * chunk_size)[:, None] + torch.arange(chunk_size, device=device)
        valid = index < cu_seqlens[1:][request][:, None]
        place = offset[local] + rank[request]
        self.request = torch.empty_like(request)
        self.request[place] = request
        self.position = torch.empty_like(local)
        self.position[place] = local
        self.valid = torch.empty_like(valid)
        self.valid[place] = valid
        self.token_index = torch.empty_like(index)
        self.token_index[place] = torch.where(valid, index, num_tokens)

    def chunks_at(self, position: int) -> slice:
        """The chunks at index ``position`` of their requests: those of ranks [0, active[position])."""
        return slice(self.offsets[position], self.offsets[position] + self.active[position])

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [N, C, ...], zero in padding slots."""
        padded = torch.cat([packed, packed.new_zeros((1, *packed.shape[1:]))])
        return padded[self.token_index]

    def gather_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [N, H, C, D], contiguous, in one copy; padding slots hold another
        token's values (finite, not zero: for inputs whose padding a zero elsewhere
        silences, such as a delta rule's keys next to a zero write strength)."""
        num_tokens, heads, size = packed.shape
        if num_tokens == 0:
            return packed.new_zeros((self.num_chunks, heads, self.token_index.shape[1], size))
        rows = self.token_index.clamp(max=num_tokens - 1)[:, None, :] * heads  # [N, 1, C]
        rows = rows + torch.arange(heads, device=rows.device)[:, None]  # [N, H, C]: rows of packed [T*H, D]
        return packed.reshape(num_tokens * heads, size).index_select(0, rows.flatten()).view(*rows.shape, size)

    def scatter(self, chunks: torch.Tensor) -> torch.Tensor:
        """[N, C, ...] -> [T, ...]: each valid slot's value at its token."""
        out = chunks.new_empty((self.num_tokens, *chunks.shape[2:]))
        out[self.token_index[self.valid]] = chunks[self.valid]
        return out
