"""Attention over a packed batch without a KV cache, plugged into transformers.

The pooling engine runs whole prompts in one forward: all sequences are concatenated
into one [1, T] batch, with no padding between them. A model loaded with
``attn_implementation="shardline_packed"`` calls ``packed_attention_forward`` from
every attention layer, with a ``PackedAttentionContext`` (through the model's
``**kwargs``) holding the sequence boundaries ``cu_seqlens``.

Invariant: a token attends only to tokens of its own sequence, to all of them for
an encoder and to those at or before it for a decoder (``module.is_causal``).

The torch path gathers sequences into padded [b, L] tiles, bucketed by length (each
bucket holds sequences whose lengths share a power of two), so padding wastes at
most about 4x a sequence's own attention work, and only in the attention.

Masking is ours, so the mask interface entry returns None: transformers builds no
[T, T] mask for the packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.context import register_implementation
from ..attention.torch_path import padded_attention

PACKED_ATTN_IMPLEMENTATION = "shardline_packed"


@dataclass
class PackedBucket:
    """Sequences of similar length, gathered into one padded [b, L] tile.

    Gathers and scatters use index_select / index_copy_ on flat row indices, which
    copy whole [H, D] rows and are far cheaper than advanced indexing.
    """

    token_index: torch.Tensor  # [b*L] int64: packed token of each tile row (0 where padded)
    valid: torch.Tensor  # [b, L] bool, False on padding
    valid_rows: torch.Tensor  # [n] int64: tile rows that hold real tokens
    packed_index: torch.Tensor  # [n] int64: token_index[valid_rows], where those rows go back
    has_padding: bool
    _masks: dict = field(default_factory=dict, repr=False)

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """packed: [T, heads, D] -> tile [b, heads, L, D]."""
        num_seqs, length = self.valid.shape
        tile = packed.index_select(0, self.token_index).view(num_seqs, length, packed.shape[1], packed.shape[2])
        return tile.transpose(1, 2)

    def scatter(self, tile: torch.Tensor, out: torch.Tensor) -> None:
        """Write the real rows of tile [b, H, L, D] into out [T, H, D]."""
        rows = tile.transpose(1, 2).reshape(-1, tile.shape[1], tile.shape[3])  # [b*L, H, D]
        if self.has_padding:
            rows = rows.index_select(0, self.valid_rows)
        out.index_copy_(0, self.packed_index, rows.to(out.dtype))

    def mask(self, causal: bool, sliding_window: int | None) -> torch.Tensor | None:
        """[b, 1, L, L] bool (True = may attend), or None when only causality (if any)
        restricts attention, which SDPA's is_causal then applies."""
        if sliding_window is None and not self.has_padding:
            return None
        key = (causal, sliding_window)
        if key not in self._masks:
            length = self.valid.shape[1]
            pos = torch.arange(length, device=self.valid.device)
            distance = pos[:, None] - pos[None, :]  # [L, L]: query position - key position
            allowed = self.valid[:, None, :].expand(-1, length, -1).clone()  # [b, L, L]
            if causal:
                allowed &= distance >= 0
            if sliding_window is not None:
                # transformers' rule: a key is inside the window when it is fewer than
                # sliding_window positions away (causal: behind; encoder: either side).
                allowed &= distance.abs() < sliding_window
            # Padded query rows attend to key 0 so softmax stays finite; they are dropped.
            allowed[:, :, 0] |= ~self.valid
            self._masks[key] = allowed[:, None]
        return self._masks[key]


@dataclass
class PackedAttentionContext:
    """Where each sequence of the packed batch starts and ends; shared by all layers."""

    # Host copy of the sequence lengths, in packed order (no device sync to read them).
    seq_lens: tuple[int, ...]
    # [B+1] int64 on the model's device: sequence b is packed[cu_seqlens[b]:cu_seqlens[b+1]].
    cu_seqlens: torch.Tensor
    _buckets: list[PackedBucket] | None = field(default=None, repr=False)

    @classmethod
    def from_seq_lens(cls, seq_lens: list[int], device: torch.device) -> PackedAttentionContext:
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"a packed batch needs at least one non-empty sequence, got lengths {seq_lens}")
        offsets = [0]
        for length in seq_lens:
            offsets.append(offsets[-1] + length)
        return cls(tuple(seq_lens), torch.tensor(offsets, dtype=torch.int64, device=device))

    def buckets(self) -> list[PackedBucket]:
        """Length buckets, built once per forward and shared by all layers."""
        if self._buckets is None:
            self._buckets = _build_buckets(self.seq_lens, self.cu_seqlens.device)
        return self._buckets


def _build_buckets(seq_lens: tuple[int, ...], device: torch.device) -> list[PackedBucket]:
    """Group sequences by the power of two their length rounds up to."""
    starts = [0]
    for length in seq_lens[:-1]:
        starts.append(starts[-1] + length)
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(seq_lens):
        groups.setdefault((length - 1).bit_length(), []).append(index)
    buckets = []
    for members in groups.values():
        member_starts = torch.tensor([starts[i] for i in members], dtype=torch.int64)
        lens = torch.tensor([seq_lens[i] for i in members], dtype=torch.int64)
        pos = torch.arange(int(lens.max()))
        valid = pos[None, :] < lens[:, None]
        token_index = torch.where(valid, member_starts[:, None] + pos[None, :], 0)
        flat_valid = valid.flatten()
        valid_rows = flat_valid.nonzero().flatten()
        buckets.append(PackedBucket(
            token_index.flatten().to(device), valid.to(device), valid_rows.to(device),
            token_index.flatten()[valid_rows].to(device), has_padding=not bool(flat_valid.all()),
        ))
    return buckets


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    shardline_packed_ctx: PackedAttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention entry point. query: [1, H, T, D]; key/value: [1, Hkv, T, D];
    returns ([1, T, H, D], None)."""
    if shardline_packed_ctx is None:
        raise RuntimeError(
            "shardline packed attention was called without a PackedAttentionContext: run the "
            "model through shardline's pooling engine"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed sequence (batch 1), got batch {query.shape[0]}")
    # transformers' convention: an explicit is_causal kwarg wins, else the module's flag.
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    scale: float = scaling if scaling is not None else query.shape[-1] ** -0.5
    # Token-major and contiguous (free when the projections were only viewed as heads),
    # so each gather copies whole rows.
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).to(q.dtype).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).to(q.dtype).contiguous()
    out = torch.empty_like(q)
    for bucket in shardline_packed_ctx.buckets():
        tile = padded_attention(
            bucket.gather(q), bucket.gather(k), bucket.gather(v),  # [b, H|Hkv, L, D]
            bucket.mask(bool(causal), sliding_window), bool(causal), scale, softcap,
        )
        bucket.scatter(tile, out)
    return out.unsqueeze(0), None  # [1, T, H, D]


def register() -> str:
    """Register the packed attention with transformers; return its implementation name."""
    return register_implementation(PACKED_ATTN_IMPLEMENTATION, packed_attention_forward)
