"""The recurrent kind contract (engine/recurrent/base.py): every registered kind is a
RecurrentKind, so the engine reads its optional members as plain attributes and
methods with the defaults the base class declares; the native-core switch is accepted
only by kinds that have one."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.recurrent import kinds  # noqa: F401  (registers the kinds)
from shardline.engine.recurrent.base import RecurrentKind, registered_kinds
from shardline.engine.recurrent.linear_attention import LightningAttentionKind
from shardline.engine.recurrent.mamba2 import Mamba2Kind
from shardline.engine.recurrent.short_conv import ShortConvKind
from shardline.engine.recurrent.zaya_cca import ZayaCCAKind


def test_every_registered_kind_is_a_recurrent_kind():
    registered = registered_kinds()
    assert {kind.name for kind in registered} >= {"gated_delta_net", "kimi_delta_attention", "lightning_attention",
                                                 "mamba", "mamba2", "rg_lru", "short_conv", "zaya_cca"}
    for kind in registered:
        assert isinstance(kind, RecurrentKind), type(kind).__name__
        assert kind.native_core is False  # registered kinds run torch ops until the CPU paths choose the kernel
        assert kind.reference_dtype in (None, torch.float32)
        assert isinstance(kind.returns_tuple, bool) and isinstance(kind.reads_prompt_tokens, bool)


def test_defaults_and_overrides():
    short_conv, lightning = ShortConvKind(), LightningAttentionKind()
    output = torch.zeros(1, 3, 4)
    assert short_conv.reference_dtype is None and not short_conv.reads_prompt_tokens
    assert not short_conv.decode_differs_from_scan(torch.nn.Identity())
    assert short_conv.module_output(torch.nn.Identity(), output) is output
    assert lightning.module_output(torch.nn.Identity(), output) == (output, None)  # its decoder layer unpacks a tuple
    assert Mamba2Kind.reads_prompt_tokens and Mamba2Kind.reference_dtype == torch.float32


def test_native_core_only_where_the_kind_has_one():
    assert ShortConvKind(native_core=True).native_core
    with pytest.raises(ValueError, match="'zaya_cca' has no native core"):
        ZayaCCAKind(native_core=True)
