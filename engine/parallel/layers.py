"""The modules a tensor-parallel rank runs in place of a model's own.

A column-parallel linear needs no module of its own: it is an nn.Linear holding its
rank's rows of the weight (its heads, its share of the intermediate size), built by
``column_linear`` (or ``column_share``, which also splits a quantized linear with its
scales). The modules here add the one collective each split needs:
- RowParallelLinear: the rank's columns of the weight; the partial products summed
  over ranks, then the bias added once.
- VocabParallelEmbedding: the rank's rows of the vocabulary; a token outside them
  looks up zeros, and the sum over ranks is the full embedding.
- GatheredLMHead: the rank's rows of the vocabulary (padded to an equal share); the
  logits gathered from every rank and cut to the vocabulary size, on every rank.
- ReducedOutput: a module computing a partial sum per rank (experts split over their
  intermediate size), its output summed over ranks.
- SpanningGatedNorm: a Mamba-2 gated RMS norm whose groups span several ranks' channels;
  each group's sum of squares summed over ranks.
- SpanningRMSNorm: an RMS norm over every head of a layer (MiniMax's lightning
  attention) on this rank's heads; the sum of squares summed over ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..lora.layers import SHARE_ATTRIBUTE, LayerShare
from ..quantization.linear import QuantizedLinear
from .group import RankGroup, ShardingError
from .quantized import split_quantized


def vocab_share(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary each of ``size`` ranks holds (the last ones padded)."""
    return -(-vocab_size // size)


def column_linear(linear: nn.Linear, rows: slice | torch.Tensor) -> nn.Linear:
    """An nn.Linear holding ``rows`` of ``linear``'s output."""
    weight = linear.weight.detach()[rows].contiguous()
    new = nn.Linear(linear.in_features, weight.shape[0], bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype)
    new.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach()[rows].contiguous(), requires_grad=False)
    return new


def column_share(module: nn.Module, name: str, rows: slice | torch.Tensor, group: RankGroup) -> nn.Module:
    """Output ``rows`` of a linear (nn.Linear, or QuantizedLinear with its scales),
    marked with its LayerShare (an adapter's B keeps those rows); ShardingError, naming
    ``name``, for another module or a share a quantized layout cannot cut."""
    if isinstance(module, QuantizedLinear):
        part = split_quantized(module, name, rows, group)
    elif isinstance(module, nn.Linear):
        part = column_linear(module, rows)
    else:
        raise ShardingError(f"{name}: a {type(module).__name__} is not split over ranks")
    setattr(part, SHARE_ATTRIBUTE, LayerShare(module.in_features, module.out_features, rows=rows))
    return part


def row_share(module: nn.Module, name: str, group: RankGroup) -> nn.Module:
    """This rank's share of a linear's input (nn.Linear, or QuantizedLinear with its
    scales), its output summed over ranks; its inner linear marked with its LayerShare
    (an adapter's A keeps those columns); ShardingError as ``column_share``."""
    if isinstance(module, QuantizedLinear):
        part = split_quantized(module, name, None, group)
    elif isinstance(module, nn.Linear):
        if module.in_features % group.size:
            raise ShardingError(f"{name}: {module.in_features} input features do not split over {group.size} ranks")
        part = RowParallelLinear(module, group)
    else:
        raise ShardingError(f"{name}: a {type(module).__name__} is not split over ranks")
    share = module.in_features // group.size
    setattr(part.get_submodule("linear"), SHARE_ATTRIBUTE, LayerShare(
        module.in_features, module.out_features, columns=slice(group.rank * share, (group.rank + 1) * share),
        named_by_parent=True))
    return part


class RowParallelLinear(nn.Module):
    """An nn.Linear split along its input: this rank's columns of the weight."""

    def __init__(self, linear: nn.Linear, group: RankGroup) -> None:
        super().__init__()
        if linear.in_features % group.size:
            raise ValueError(f"in_features {linear.in_features} of {linear} does not split over {group.size} ranks")
        share = linear.in_features // group.size
        columns = slice(group.rank * share, (group.rank + 1) * share)
        self.linear = nn.Linear(share, linear.out_features, bias=False, device=linear.weight.device,
                                dtype=linear.weight.dtype)
        self.linear.weight = nn.Parameter(linear.weight.detach()[:, columns].contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """This rank's columns of the weight (code reading a linear's weight reads these)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features / size], this rank's share of the input features.
        out = self.group.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding split along the vocabulary: this rank's rows."""

    def __init__(self, embedding: nn.Embedding, group: RankGroup) -> None:
        super().__init__()
        share = vocab_share(embedding.num_embeddings, group.size)
        self.start = group.rank * share
        rows = embedding.weight.detach()[self.start : self.start + share]
        self.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.group.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class GatheredLMHead(nn.Module):
    """A vocabulary-projecting nn.Linear split along its output: this rank's rows of the
    vocabulary, the logits gathered on every rank."""

    def __init__(self, linear: nn.Linear, group: RankGroup) -> None:
        super().__init__()
        vocab_size = linear.out_features
        share = vocab_share(vocab_size, group.size)
        weight = linear.weight.detach()[group.rank * share : (group.rank + 1) * share]
        bias = None if linear.bias is None else linear.bias.detach()[group.rank * share : (group.rank + 1) * share]
        padding = share - weight.shape[0]  # the last ranks' rows past the vocabulary
        if padding:
            weight = F.pad(weight, (0, 0, 0, padding))
            bias = None if bias is None else F.pad(bias, (0, padding))
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> logits [..., V], the same on every rank
        logits = self.group.all_gather(F.linear(hidden, self.weight, self.bias))
        return logits[..., : self.out_features]


class ReducedOutput(nn.Module):
    """``inner``, whose output on each rank is a partial sum, with the sum over ranks."""

    def __init__(self, inner: nn.Module, group: RankGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.group.all_reduce(self.inner(*args, **kwargs))


class SpanningGatedNorm(nn.Module):
    """A Mamba-2 gated RMS norm (``weight * norm(x * silu(gate))`` over groups of
    ``group_size`` channels, in float32) on this rank's channels, which lie inside group
    ``group_index`` of ``num_groups``, a group spanning several ranks: each rank's sum of
    squares of its part of the group is summed over ranks (the sum transformers' mean
    takes, added in another order)."""

    def __init__(self, weight: torch.Tensor, group_size: int, eps: float, num_groups: int, group_index: int,
                 group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.group_size, self.variance_epsilon = group_size, eps
        self.num_groups, self.group_index = num_groups, group_index
        self.group = group

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        # hidden_states, gate: [..., C], this rank's C channels of one group
        input_dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        if gate is not None:
            hidden = hidden * F.silu(gate.to(torch.float32))
        sums = hidden.new_zeros((*hidden.shape[:-1], self.num_groups))
        sums[..., self.group_index] = hidden.pow(2).sum(-1)
        self.group.all_reduce(sums)
        variance = sums[..., self.group_index : self.group_index + 1] / self.group_size
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(input_dtype)


class SpanningRMSNorm(nn.Module):
    """An RMS norm (``weight * x / sqrt(mean(x^2) + eps)``, in float32, the weight applied
    in the input's dtype, or with ``weight_in_float32`` before the cast back as OLMo's)
    over ``width`` channels of which this rank holds its share: the sum of squares of its
    channels summed over ranks (the sum transformers' mean takes, added in another order;
    divided by ``replicas`` where each share sits on that many ranks: key heads fewer
    than ranks)."""

    def __init__(self, weight: torch.Tensor, width: int, eps: float, group: RankGroup, *, replicas: int = 1,
                 weight_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.width, self.variance_epsilon = width, eps
        self.replicas, self.weight_in_float32 = replicas, weight_in_float32
        self.group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [..., C], this rank's C of the norm's width channels
        input_dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        squares = self.group.all_reduce(hidden.pow(2).sum(-1, keepdim=True))
        if self.replicas > 1:
            squares = squares / self.replicas
        hidden = hidden * torch.rsqrt(squares / self.width + self.variance_epsilon)
        if self.weight_in_float32:
            return (self.weight * hidden).to(input_dtype)
        return self.weight * hidden.to(input_dtype)
