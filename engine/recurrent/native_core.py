"""Recurrent layers whose kind runs its core through the CPU recurrent kernel.

A kind that can (gated delta-net, Kimi delta attention) takes ``native_core`` at
construction and, where it is True, runs the convolution, the l2 norms and the delta
rule of a step as one C call (engine/kernels/cpu_recurrent.py) whenever the step's
tensors are ones the kernel takes, its torch ops otherwise. The engine's CPU paths
choose the kernel once at load (engine/cpu/paths.py's ``recurrent_kernel``); this
replaces the model's layers of such kinds accordingly.
"""

from __future__ import annotations

import torch

from ..cpu.linear import replace_module
from .state import RecurrentLayer


def take_native_core(model: torch.nn.Module) -> int:
    """Replace each RecurrentLayer of ``model`` whose kind has a ``native_core`` switch,
    off, by one whose kind has it on; returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, RecurrentLayer) and getattr(module.kind, "native_core", None) is False:
            replace_module(model, name, RecurrentLayer(module.layer, type(module.kind)(native_core=True),
                                                       module.layer_idx, module.hf_config, module.holder))
            replaced += 1
    return replaced
