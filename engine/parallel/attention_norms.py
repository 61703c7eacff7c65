"""Norms an attention module takes over all of its heads' channels, on a tensor-parallel
rank that holds some of the heads.

OLMo 2 and 3, OLMoE, FlexOlmo and OLMo hybrid normalise the query projection's output
over every query head (``q_norm``, width heads x head_dim) and the key projection's over
every key-value head (``k_norm``) before splitting it into heads. A rank holding its share
of the heads holds its share of those channels, so the norm becomes a SpanningRMSNorm:
its squares summed across ranks, the rank's share of the weight. A norm over one head's
channels (Qwen3's, width head_dim) needs nothing.

Invariant: a norm is replaced only where its weight spans exactly every head of its
projection (width heads x head_dim, more than one head), and only by the RMS form its own
forward computes (the weight applied in the input's dtype, or in float32 before the cast
back: probed in bfloat16 on the whole norm); another form is refused, naming the norm.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..surgery import replace
from .group import RankGroup, ShardingError
from .layers import SpanningRMSNorm


def span_head_norms(attention: nn.Module, name: str, shares: dict[str, tuple[int, int, int]],
                    group: RankGroup) -> int:
    """Replace ``attention``'s norms over all heads (``shares``: norm attribute -> (its
    projection's heads, this rank's first head, how many)) by SpanningRMSNorms over this
    rank's heads; return how many were replaced. An adapter's original module (the load
    check's reference) gets the same norm."""
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int):
        return 0
    original = getattr(attention, "original", None)
    owners = [attention, *([original] if isinstance(original, nn.Module) else [])]
    replaced = 0
    for attribute, (num_heads, first, count) in shares.items():
        norm = next((getattr(owner, attribute) for owner in owners if hasattr(owner, attribute)), None)
        weight = getattr(norm, "weight", None)
        if not (isinstance(norm, nn.Module) and isinstance(weight, torch.Tensor) and num_heads > 1
                and weight.dim() == 1 and weight.shape[0] == num_heads * head_dim):
            continue
        replicas = group.size // num_heads if num_heads < group.size else 1  # one key head on several ranks
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if not isinstance(eps, float):
            raise ShardingError(f"{name}.{attribute}: a {type(norm).__name__} over all heads has no float epsilon; "
                                "it is not split over ranks")
        spanning = SpanningRMSNorm(weight.detach()[first * head_dim: (first + count) * head_dim],
                                   num_heads * head_dim, eps, group, replicas=replicas,
                                   weight_in_float32=weight_in_float32(norm, f"{name}.{attribute}", eps))
        for owner in owners:
            if getattr(owner, attribute, None) is norm:
                replace(owner, attribute, spanning)
        replaced += 1
    return replaced


def weight_in_float32(norm: nn.Module, name: str, eps: float) -> bool:
    """Whether ``norm`` applies its weight in float32 before casting back (OLMo's
    ``(weight * x).to(dtype)``) rather than to the input cast back (Llama's), probed in
    bfloat16 on a copy; ShardingError, naming it, where neither RMS form is its output.
    On the meta device (the pre-flight verdict) there is nothing to probe: False."""
    weight = getattr(norm, "weight")  # noqa: B009 - checked to be a tensor by the caller
    if weight.is_meta:
        return False
    probe = copy.deepcopy(norm).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, weight.shape[0], generator=generator).to(weight.device, torch.bfloat16)
    with torch.no_grad():
        expected = probe(x).float()
        hidden = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        scale = getattr(probe, "weight")  # noqa: B009 - the copy's tensor, as the norm's
        assert isinstance(scale, torch.Tensor)
        forms = {False: (scale * hidden.to(torch.bfloat16)).float(), True: (scale * hidden).to(torch.bfloat16).float()}
    errors = {form: float((output - expected).abs().max()) for form, output in forms.items()}
    form = min(errors, key=lambda key: errors[key])
    if errors[form] > 1e-2 * max(float(expected.abs().max()), 1e-6):
        raise ShardingError(f"{name}: {type(norm).__name__} over all heads is not an RMS norm "
                            "(weight * x / rms(x)) the ranks can span; it is not split over ranks")
    return form
