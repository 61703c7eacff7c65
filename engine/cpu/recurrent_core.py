"""Recurrent layers whose kind runs its core through the CPU recurrent kernel.

A kind with a native core (``RecurrentKind.has_native_core``, engine/recurrent/base.py)
takes ``native_core`` at construction and, where it is True, runs through C
(engine/kernels/cpu_recurrent.py) whenever the step's tensors are ones the kernel
takes, its torch ops otherwise: gated delta-net and Kimi delta attention layers their
convolution, l2 norms and delta rule as one call; short-convolution, Mamba, Mamba-2
and RG-LRU layers their causal convolution, and float32 Mamba and Mamba-2 mixers their
decode tokens' state updates. The engine's CPU paths choose the kernel once at load
(paths.py's ``recurrent_kernel``); this replaces the model's layers of such kinds
accordingly, through engine/surgery.py's ``replace``.
"""

from __future__ import annotations

import torch

from ..recurrent.state import RecurrentLayer
from ..surgery import replace


def take_native_core(model: torch.nn.Module) -> int:
    """Replace each RecurrentLayer of ``model`` whose kind has a native core, off, by
    one whose kind has it on; returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, RecurrentLayer) and module.kind.has_native_core and not module.kind.native_core:
            replace(model, name, RecurrentLayer(module.layer, type(module.kind)(native_core=True), module.layer_idx,
                                                module.hf_config, module.holder))
            replaced += 1
    return replaced
