"""A checkpoint's quantization as the engine reads it: one frozen ``QuantScheme``.

engine/quantization/methods.py makes one from config.json's ``quantization_config``
(or refuses the format); ``online_scheme("fp8" | "int8")`` is the scheme the engine
quantizes a 16/32-bit checkpoint's linears to at load.

Every accepted scheme converts to one of the in-memory layouts written down in
engine/kernels/quant_reference.py: ``weights`` "fp8" or "int8" (W8), "int4" (W4) or
"mxfp4" (experts, engine/quantization/mxfp4.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UnsupportedModelError
from .activations import InputQuantization

# Where a checkpoint's quantized linear keeps its tensors (engine/quantization/formats.py):
# "w8": weight (fp8/int8) + weight_scale or weight_scale_inv; "packed": compressed-tensors'
# weight_packed/weight_scale/weight_zero_point/weight_g_idx; "gptq" and "awq": qweight,
# qzeros, scales (g_idx); "float": unquantized weights (online quantization, mxfp4's
# dense linears).
Layout = Literal["w8", "packed", "gptq", "awq", "float"]
Weights = Literal["fp8", "int8", "int4", "mxfp4"]
Strategy = Literal["tensor", "channel", "block", "group"]
ONLINE_METHODS = ("fp8", "int8")


@dataclass(frozen=True)
class QuantScheme:
    """One checkpoint's quantization, as the engine reads it.

    ``strategy`` None: per tensor or per output channel, read from each scale's shape
    (quant_method fp8 without weight_block_size). ``block`` (rows, cols) with
    strategy "block"; ``group_size`` with "group" (input columns per scale).
    ``zero_offset``: added to stored zero points (1 for GPTQ's v1 checkpoint format).
    ``activations``: how a W8A8 kernel quantizes activations ("dynamic" per token,
    "static" from input_scale); "none" for weight-only schemes. Every kernel path
    without FP8 tensor cores multiplies by the dequantized weight.
    ``input_quantization``: how the checkpoint's own forward quantizes each linear's
    input per token before multiplying ("int8", "fp8"; engine/quantization/activations.py),
    which every path then does too; "none" where its reference multiplies x as it is.
    ``ignore``: module names or patterns the checkpoint left unquantized (``ignores``).
    ``online``: quantized by the engine at load from a 16/32-bit checkpoint."""

    method: str
    weights: Weights
    layout: Layout
    strategy: Strategy | None = None
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 0
    activations: Literal["none", "dynamic", "static"] = "none"
    input_quantization: InputQuantization = "none"
    scale_names: tuple[str, ...] = ("weight_scale",)
    ignore: tuple[str, ...] = ()
    online: bool = False

    @property
    def description(self) -> str:
        """A short name for messages: method and weight type."""
        return f"{self.method} ({self.weights}{', online' if self.online else ''})"

    def ignores(self, module_name: str) -> bool:
        """Whether ``module_name`` is one the checkpoint names as left unquantized, by
        the rule of the library that writes the format: compressed-tensors' own
        ``match_name`` (an exact name, or a "re:" pattern matching from the start), or
        transformers' ``should_convert_module`` for modules_to_not_convert (a name or
        regex such as ``model.layers.*.self_attn`` matching from the start up to a
        module boundary, or a suffix)."""
        if not self.ignore:
            return False
        if self.method == "compressed-tensors":
            from compressed_tensors.utils.match import match_name

            return any(match_name(module_name, entry) for entry in self.ignore)
        from transformers.quantizers.quantizers_utils import should_convert_module

        return not should_convert_module(module_name, list(self.ignore))


def online_scheme(quantization: str) -> QuantScheme:
    """The scheme ``LLM(model, quantization=...)`` quantizes a 16/32-bit checkpoint's
    linears to: per-output-channel symmetric fp8 (e4m3) or int8 weights."""
    if quantization not in ONLINE_METHODS:
        raise UnsupportedModelError(
            f"quantization={quantization!r} cannot quantize an unquantized checkpoint at load; "
            f"accepted: {', '.join(ONLINE_METHODS)}")
    return QuantScheme(method=quantization, weights="fp8" if quantization == "fp8" else "int8", layout="float",
                       strategy="channel", online=True)
