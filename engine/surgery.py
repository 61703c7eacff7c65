"""Module surgery: the one way the engine replaces a loaded model's modules, and the one
written order in which its replacements are made.

Every replacement (attention adapters, recurrent layers, LoRA wrappers, the CPU
paths' packed linears, fused norms, MLPs and decoder layers) goes through ``replace``,
over ``nn.Module.set_submodule``, by the dotted name ``named_modules`` gives. The
decoder's stack of layers is found in one place, ``decoder_layers``. A replacement
that computes its module's output by other means is put in place only where it
reproduces the module's own output on a probe input (``replace_if_reproduces``).

Invariants:
- ``replace`` puts a module only where a registered submodule of that name is: a
  name that resolves through an attribute a module answers for without registering
  it (a LayerReplacement answering for its wrapped layer's attributes) is refused, so
  a replacement never shadows the module it was meant to replace.
- ``prepare_model`` runs its steps in PREPARATION_ORDER whatever order they are given
  in; each step sees the model as the steps before it left it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .cpu.paths import CpuRewrites
    from .lora.manager import LoRAManager
    from .recurrent.state import RecurrentStateSpec

logger = logging.getLogger(__name__)


class SubmoduleNotFoundError(LookupError):
    """A replacement names a submodule the model does not have."""


def submodule(model: nn.Module, name: str) -> nn.Module:
    """``model``'s registered submodule ``name`` (dotted, as ``named_modules`` gives it);
    SubmoduleNotFoundError naming the path and the first missing part otherwise."""
    module = model
    for depth, part in enumerate(name.split(".")):
        child = module._modules.get(part)
        if child is None:
            reached = ".".join(name.split(".")[:depth]) or "the model root"
            raise SubmoduleNotFoundError(
                f"{type(model).__name__} has no submodule {name!r}: {reached} "
                f"({type(module).__name__}) has no registered child {part!r}")
        module = child
    return module


def replace(model: nn.Module, name: str, new_module: nn.Module) -> nn.Module:
    """Put ``new_module`` where ``model``'s submodule ``name`` is; return the module it
    replaced. SubmoduleNotFoundError (naming the path) where there is none."""
    old_module = submodule(model, name)
    model.set_submodule(name, new_module, strict=True)
    return old_module


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's stack of layers and its name: the longest ModuleList (the first of
    them where several are as long) of the text decoder, whose positions are the decoder
    layers' indices. The text decoder is what the model's ``get_decoder`` names (the
    language model of a vision-language model, whose vision tower may hold more layers),
    else the whole model. ("", an empty ModuleList attached to nothing) for a model
    without one."""
    decoder = _text_decoder(model)
    prefix = next((name for name, module in model.named_modules() if module is decoder), None)
    if prefix is None:  # a decoder the model does not register: search the whole model
        decoder, prefix = model, ""
    found = ("", nn.ModuleList())
    for name, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(found[1]):
            found = (f"{prefix}.{name}" if prefix else name, module)
    return found


def _text_decoder(model: nn.Module) -> nn.Module:
    """The module transformers' ``get_decoder`` names (the model itself for one without
    it, or where the lookup fails)."""
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder):
        return model
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # models whose lookup needs a bespoke rule
        return model
    return decoder if isinstance(decoder, nn.Module) else model


def reproduces(actual: object, expected: object, bfloat16_tolerance: float = 1e-2) -> bool:
    """Whether a replacement's output on a probe is the module's own: both tensors of one
    shape, close to 1e-4 (``bfloat16_tolerance`` in bfloat16), relative to the
    output's largest value."""
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return False
    tolerance = bfloat16_tolerance if expected.dtype == torch.bfloat16 else 1e-4
    return actual.shape == expected.shape and torch.allclose(
        actual.float(), expected.float(), rtol=tolerance, atol=tolerance * float(expected.abs().max()))


Probe = Callable[[nn.Module], object]  # a module's output on a fixed probe input
Comparison = Callable[[object, object], bool]  # (replacement's output, module's) -> the same?


def called_on(*args: object, **kwargs: object) -> Probe:
    """The probe that calls a module on these inputs."""
    return lambda module: module(*args, **kwargs)


def probe_matches(original: nn.Module, candidate: nn.Module, probe: Probe, same: Comparison = reproduces) -> bool:
    """Whether ``candidate`` gives ``original``'s output on ``probe`` (run without
    gradients). A probe either module raises on is no match: the candidate does not
    fit that module."""
    try:
        with torch.no_grad():
            expected = probe(original)
            actual = probe(candidate)
    except Exception as error:  # a module the candidate's pattern does not fit
        logger.debug("probing %s against %s raised %r", type(candidate).__name__, type(original).__name__, error)
        return False
    return same(actual, expected)


def replace_if_reproduces(model: nn.Module, name: str, candidate: nn.Module, probe: Probe,
                          same: Comparison = reproduces) -> bool:
    """Put ``candidate`` where submodule ``name`` is if it reproduces that module's output
    on ``probe`` (``probe_matches``); return whether it was put in place. A refusal is
    logged with the module's class."""
    original = submodule(model, name)
    if not probe_matches(original, candidate, probe, same):
        logger.info("%s at %s does not match %s on its probe; it keeps its own forward",
                    type(original).__name__, name, type(candidate).__name__)
        return False
    replace(model, name, candidate)
    return True


# The order in which a loaded model's modules are replaced, each step on the model as
# the ones before it left it:
# 1. attention_adapters: attention modules transformers never routed through its
#    AttentionInterface become adapters calling the paged attention. First: every later
#    step sees the model's final attention modules, and adapters take over the original
#    projections under their names, so LoRA target names are unchanged.
# 2. quantized_linears: the linears a quantized checkpoint stores quantized (or that
#    online quantization quantizes), left on the meta device by the loader, become
#    QuantizedLinears (engine/quantization/). After the adapters, which keep the
#    projections under their names; before LoRA, which wraps the linear it finds, and the
#    CPU step, which packs nn.Linears only and so leaves QuantizedLinears alone.
# 3. tensor_parallel: with several ranks, the linears, embeddings and experts that the
#    model's tensor-parallel plan (or engine/parallel/sharding.py's shape rules) splits
#    become this rank's share of them. After the adapters, whose projections keep their
#    names; before LoRA, the recurrent layers and the CPU step, which wrap or pack the
#    linears they find.
# 4. lora: adaptable linears are wrapped (BatchedLoRALinear). Before the recurrent and
#    CPU replacements, which keep the linears they find inside their new modules and so
#    keep the wrappers; before the KV cache is sized, as the adapter slots take memory.
# 5. recurrent_layers: recurrent modules become RecurrentLayers with per-request state.
#    Before the CPU step, whose hybrid layers and native recurrent core replace those
#    wrappers' parts.
# 6. cpu_layers: packed linears, then fused MLPs, norms and decoder layers (the order
#    within written in engine/cpu/paths.py's optimize_for_cpu). Last: it packs the
#    weights of whatever linears the steps before left (inside LoRA wrappers too), and
#    its fused layers call the modules the earlier steps installed.
PREPARATION_ORDER = ("attention_adapters", "quantized_linears", "tensor_parallel", "lora", "recurrent_layers",
                     "cpu_layers")


@dataclass(frozen=True)
class Preparation:
    """The steps one engine takes to prepare its model, each a function of the model
    (None: not taken); ``prepare_model`` runs them in PREPARATION_ORDER."""

    attention_adapters: Callable[[nn.Module], int] | None = None
    quantized_linears: Callable[[nn.Module], int] | None = None
    tensor_parallel: Callable[[nn.Module], int] | None = None
    lora: Callable[[nn.Module], LoRAManager] | None = None
    recurrent_layers: Callable[[nn.Module], RecurrentStateSpec | None] | None = None
    cpu_layers: Callable[[nn.Module], CpuRewrites] | None = None


@dataclass(frozen=True)
class PreparedModel:
    """What each step of a Preparation returned (None for a step not taken): how many
    attention modules were adapted, how many linears became quantized ones, how many
    modules became a tensor-parallel rank's share, the LoRA
    manager, the recurrent layers' state spec (None without recurrent layers) and the
    CPU replacements by kind."""

    attention_adapters: int | None = None
    quantized_linears: int | None = None
    tensor_parallel: int | None = None
    lora: LoRAManager | None = None
    recurrent_layers: RecurrentStateSpec | None = None
    cpu_layers: CpuRewrites | None = None


assert tuple(field.name for field in fields(Preparation)) == PREPARATION_ORDER


def prepare_model(model: nn.Module, preparation: Preparation) -> PreparedModel:
    """Run ``preparation``'s steps on ``model`` in PREPARATION_ORDER; return their results."""
    results = {}
    for name in PREPARATION_ORDER:
        step = getattr(preparation, name)
        if step is not None:
            results[name] = step(model)
            logger.debug("model preparation %s: %s", name, results[name])
    return PreparedModel(**results)
