"""The parts a tensor-parallel rank keeps of a recurrent mixer: the index helpers and
the outcome ``RunWhole`` every mixer's share function (engine/parallel/recurrent.py,
engine/parallel/mixers.py) uses."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .group import RankGroup


class RunWhole(Exception):  # noqa: N818 - an outcome, not a failure
    """Why a mixer runs whole on every rank."""


def ranges(*parts: tuple[int, int]) -> torch.Tensor:
    """The indices of the [start, start + length) ``parts``, in order."""
    return torch.cat([torch.arange(start, start + length) for start, length in parts])


def share(count: int, group: RankGroup, what: str) -> tuple[int, int]:
    """(first, how many) of ``count`` items that this rank holds; RunWhole if they do not split."""
    if count % group.size:
        raise RunWhole(f"its {count} {what} do not split over {group.size} ranks")
    each = count // group.size
    return group.rank * each, each


# A mixer's new parts by their dotted path under it: modules, parameters, or buffers
# (plain tensors) replacing buffers of that name.
Parts = dict[str, nn.Module | torch.Tensor]


def depthwise_conv(conv: nn.Module, channels: torch.Tensor) -> nn.Conv1d:
    """A depthwise causal nn.Conv1d over ``channels`` of ``conv``'s."""
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels:
        raise RunWhole(f"its convolution {type(conv).__name__} is not a depthwise nn.Conv1d")
    weight = conv.weight.detach()[channels.to(conv.weight.device)].contiguous()
    count = weight.shape[0]
    new = nn.Conv1d(count, count, conv.kernel_size[0], groups=count, padding=cast(tuple[int], conv.padding),
                    bias=conv.bias is not None, device=weight.device, dtype=weight.dtype)
    new.weight = nn.Parameter(weight, requires_grad=False)
    if conv.bias is not None:
        new.bias = nn.Parameter(conv.bias.detach()[channels.to(weight.device)].contiguous(), requires_grad=False)
    return new


def int_of(module: object, attribute: str) -> int:
    """A mixer's size ``attribute``; RunWhole where it has none."""
    value = getattr(module, attribute, None)
    if not isinstance(value, int):
        raise RunWhole(f"it has no integer {attribute}")
    return value


def module_of(module: nn.Module, attribute: str) -> nn.Module:
    """A mixer's submodule ``attribute``; RunWhole where it has none."""
    value = getattr(module, attribute, None)
    if not isinstance(value, nn.Module):
        raise RunWhole(f"it has no module {attribute}")
    return value


def tensor_of(module: nn.Module, attribute: str) -> torch.Tensor:
    """A mixer's parameter ``attribute``; RunWhole where it has none."""
    value = getattr(module, attribute, None)
    if not isinstance(value, torch.Tensor):
        raise RunWhole(f"it has no tensor {attribute}")
    return value


def sliced(parameter: torch.Tensor, index: torch.Tensor) -> nn.Parameter:
    """``parameter``'s entries ``index`` (along its first dimension) as a new parameter."""
    return nn.Parameter(parameter.detach()[index.to(parameter.device)].contiguous(), requires_grad=False)
