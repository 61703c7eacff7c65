"""Quantized MoE experts: a model's fused experts module replaced by one whose weights
stay in the checkpoint's quantized layout, computing only the experts a token routes to.

``replace_quantized_experts`` is the loader's one call for a model's experts (after the
dense linears are read, engine/quantization/load.py); it returns how many experts
modules it replaced, and refuses a checkpoint whose quantized expert tensors it cannot
hold with one line naming the model type, the format and a tensor.

transformers holds a MoE layer's experts as one module with 3D weights (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) and calls it as ``experts(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. ``QuantizedExperts`` keeps that
call and holds each projection of every expert quantized: MXFP4 as gpt-oss ships it
(engine/quantization/mxfp4.py), or W8/W4 (engine/kernels/quant_reference.py's layouts)
from a checkpoint that stores each expert's linears apart (``{experts}.{e}.gate_proj.weight``
and its scales, as transformers' weight conversion reads Qwen3-MoE, DeepSeek-V3 and
Mixtral checkpoints before fusing them), one QuantizedLinear per expert, W8 ones views
into weights stacked over the experts. On CUDA the MXFP4 and stacked W8 experts run
as one grouped Triton kernel (engine/kernels/quant_moe.py, quant_moe_w8.py); elsewhere
each routed expert is two products through its projection's CPU kernel or torch path.

Invariants:
- No float copy of an expert's weight is kept: a projection dequantizes inside its
  kernel, or a tile of rows at a time on the torch path.
- The forward follows the replaced module's own: per routed expert, gate_up (+ bias),
  the module's activation, down (+ bias), weighted by the route's weight and summed
  into the token's row; each projection's product is float32, rounded to the
  activations' dtype once. Routes to ids outside [0, E) are skipped, as transformers
  skips them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.quant_moe import SILU_GATED_HALVES, GatedActivation, mxfp4_moe
from ..kernels.quant_moe_w8 import w8_moe
from ..surgery import replace
from .checkpoint import CheckpointTensors
from .formats import read_quantized_linear, stored_quantized
from .linear import QuantizedLinear
from .mxfp4 import Mxfp4ExpertWeights, read_float_bias, read_mxfp4_projection
from .scheme import QuantScheme


class LinearsPerExpert(nn.Module):
    """One projection of every expert from a checkpoint that stores each expert's
    linears apart: a QuantizedLinear (W8 or W4) per expert and part, the parts side by
    side in the output (gate then up for gate_up). Each multiplies through
    engine/quantization/linear.py's one dispatch, so its kernels serve experts too.
    Registered by name (``parts[part][expert]``), not in ModuleLists: the decoder's
    layers are the model's longest ModuleList (engine/surgery.py's decoder_layers)."""

    # W8 experts stacked for the grouped Triton kernel (``stack_w8``); None otherwise.
    stacked_weight: torch.Tensor | None
    stacked_scale: torch.Tensor | None

    def __init__(self, parts: dict[str, list[QuantizedLinear]]) -> None:
        super().__init__()
        self.register_buffer("stacked_weight", None)
        self.register_buffer("stacked_scale", None)
        self.stacked_block: tuple[int, int] | None = None
        linears = list(parts.values())
        assert linears and all(len(part) == len(linears[0]) for part in linears), {k: len(v) for k, v in parts.items()}
        self.parts = nn.ModuleDict({name: nn.ModuleDict({str(expert): linear for expert, linear in enumerate(part)})
                                    for name, part in parts.items()})
        self._linears = linears  # the same modules, typed, for the hot path
        self.num_experts = len(linears[0])
        self.in_features = linears[0][0].in_features
        self.out_features = sum(part[0].out_features for part in linears)

    def parts_quantize_inputs(self) -> bool:
        """Whether the checkpoint's forward quantizes these linears' inputs (activations.py)."""
        return self._linears[0][0].input_quantization != "none"

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] times expert ``expert``'s weight transposed: float32 [T, N]. Parts that
        quantize their input take x in its own dtype, in which the checkpoint's forward
        computes each token's scale and codes (activations.py); the others take x in
        float32, so the product is not rounded to a 16-bit x's dtype."""
        if not self.parts_quantize_inputs():
            x = x.float()
        return torch.cat([part[expert](x) for part in self._linears], dim=-1).float()


def stack_w8(parts: dict[str, list[QuantizedLinear]]) -> LinearsPerExpert:
    """The projection of ``parts`` with W8 weights stacked over the experts and the
    parts side by side (weight [E, N, K], float32 scale [E, N, 1] per channel (a
    per-tensor scale repeated over its rows) or [E, N / bn, K / bk] per block), as
    engine/kernels/quant_moe_w8.py's grouped kernel reads them, each expert's
    QuantizedLinear a view into them; ``parts`` kept apart where that cannot be (W4,
    biases, act-order column permutations, blocks that differ or do not divide a part's
    rows, asymmetric int8 zero points, which the grouped kernel does not read)."""
    linears = [linear for part in parts.values() for linear in part]
    block = linears[0].block
    if any(linear.layout != "w8" or linear.bias is not None or linear.input_perm is not None or linear.block != block
           or linear.zero is not None for linear in linears) or (
            block is not None and any(part[0].out_features % block[0] for part in parts.values())):
        return LinearsPerExpert(parts)
    weight = torch.cat([torch.stack([_buffer(linear.weight) for linear in part]) for part in parts.values()], dim=1)
    scale = torch.cat([torch.stack([_channel_scale(linear, block) for linear in part]) for part in parts.values()],
                      dim=1)
    views = []
    for expert in range(weight.shape[0]):
        view = QuantizedLinear.w8(weight[expert], scale[expert], block)
        view.activations, view.input_quantization = linears[0].activations, linears[0].input_quantization
        views.append(view)
    stacked = LinearsPerExpert({"stacked": views})
    # Buffers of the projection too; the views share their storage.
    stacked.stacked_weight, stacked.stacked_scale, stacked.stacked_block = weight, scale, block
    return stacked


def _buffer(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor


def _channel_scale(linear: QuantizedLinear, block: tuple[int, int] | None) -> torch.Tensor:
    """A W8 linear's scale as stacked: per block as it is, else one row per output channel."""
    scale = _buffer(linear.scale)
    return scale if block is not None else scale.reshape(-1, 1).expand(linear.out_features, 1).contiguous()


# What holds one projection of every expert: ``matmul(expert, x [T, K])`` gives the
# float32 [T, N] product with that expert's weight.
ExpertWeights = Mxfp4ExpertWeights | LinearsPerExpert


class SiluGatedHalves(nn.Module):
    """``act_fn(gate) * up`` with gate the first half of the gate_up rows and up the
    second (transformers' default expert gate: Qwen-MoE, DeepSeek-V3, Mixtral)."""

    def __init__(self, act_fn: nn.Module) -> None:
        super().__init__()
        self.act_fn = act_fn

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


# How gate_up's output becomes down's input: the replaced module's own activation over
# halves, or gpt-oss's clamped SwiGLU over interleaved rows (the Triton kernel's
# GatedActivation, whose plain-torch call computes it as transformers' GptOssExperts does).
ExpertActivation = SiluGatedHalves | GatedActivation


class QuantizedExperts(nn.Module):
    """A MoE layer's experts with quantized weights, called as transformers' experts
    modules are: ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    gate_up: ExpertWeights
    down: ExpertWeights
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def __init__(self, gate_up: ExpertWeights, down: ExpertWeights, activation: ExpertActivation,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.register_buffer("gate_up_bias", gate_up_bias)
        self.register_buffer("down_bias", down_bias)
        # Set by the load check's dequantized_reference: no grouped kernel, each expert's
        # projections through their own references.
        self.use_reference = False

    @property
    def num_experts(self) -> int:
        return self.down.num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, H], top_k_index / top_k_weights: [T, k]
        if not self.use_reference and self.runs_kernel(hidden_states):
            return self.kernel_forward(hidden_states, top_k_index, top_k_weights)
        output = torch.zeros_like(hidden_states)
        num_experts = self.num_experts
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < num_experts:
                continue
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            routed = self.expert_forward(expert, hidden_states[token_idx])
            weighted = routed * top_k_weights[token_idx, top_k_pos, None]
            output.index_add_(0, token_idx, weighted.to(output.dtype))
        return output

    def kernel_activation(self) -> GatedActivation | None:
        """The activation as the Triton kernels take it (None: one they do not fuse)."""
        if isinstance(self.activation, GatedActivation):
            return self.activation
        return SILU_GATED_HALVES if type(self.activation.act_fn).__name__ in ("SiLU", "SiLUActivation") else None

    def runs_kernel(self, hidden_states: torch.Tensor) -> bool:
        """Whether this call goes to a grouped Triton kernel: on CUDA, in a dtype the
        kernels take, MXFP4 experts or W8 experts stacked (``stack_w8``), an activation
        they fuse."""
        gate_up, down = self.gate_up, self.down
        grouped = (isinstance(gate_up, Mxfp4ExpertWeights) and isinstance(down, Mxfp4ExpertWeights)) or (
            isinstance(gate_up, LinearsPerExpert) and isinstance(down, LinearsPerExpert)
            and gate_up.stacked_weight is not None and down.stacked_weight is not None
            and gate_up.stacked_block == down.stacked_block
            # the grouped kernel multiplies x as it is: not for inputs the checkpoint quantizes
            and gate_up.parts_quantize_inputs() is False)
        return (hidden_states.is_cuda and triton_available() and hidden_states.dtype in KERNEL_DTYPES and grouped
                and self.kernel_activation() is not None)

    def kernel_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward through the grouped Triton kernel of the experts' format:
        engine/kernels/quant_moe.py's (MXFP4) or quant_moe_w8.py's (stacked W8)."""
        gate_up, down, activation = self.gate_up, self.down, self.kernel_activation()
        assert activation is not None
        hidden = hidden_states.contiguous()
        if isinstance(gate_up, Mxfp4ExpertWeights):
            assert isinstance(down, Mxfp4ExpertWeights)
            return mxfp4_moe(hidden, gate_up.blocks, gate_up.scales, self.gate_up_bias, down.blocks, down.scales,
                             self.down_bias, top_k_index, top_k_weights, activation)
        assert isinstance(down, LinearsPerExpert)
        gate_up_weight, gate_up_scale = _buffer(gate_up.stacked_weight), _buffer(gate_up.stacked_scale)
        down_weight, down_scale = _buffer(down.stacked_weight), _buffer(down.stacked_scale)
        return w8_moe(hidden, gate_up_weight, gate_up_scale, self.gate_up_bias, down_weight, down_scale,
                      self.down_bias, gate_up.stacked_block, top_k_index, top_k_weights, activation)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` on its tokens x [t, H]: [t, H] in x's dtype."""
        gate_up = self.gate_up.matmul(expert, x)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[expert]
        gated = self.activation(gate_up.to(x.dtype))
        out = self.down.matmul(expert, gated)
        if self.down_bias is not None:
            out = out + self.down_bias[expert]
        return out.to(x.dtype)



# Experts classes whose forward is the one QuantizedExperts follows (transformers'
# per-expert loop over gate_up, the gate, down, weighted and summed): checked by
# reading each, and only these are replaced.
GATED_HALVES_EXPERTS = ("Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts", "MixtralExperts",
                        "DeepseekV3Experts")
GATED_HALVES_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v3")
MXFP4_EXPERTS = ("GptOssExperts",)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every fused experts module of ``model`` (a module with 3D ``gate_up_proj`` and
    ``down_proj`` weights), by name."""
    found = []
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            found.append((name, module))
    return found


# Name endings of the tensors a quantized expert is stored as (MXFP4's _blocks/_scales,
# FP8's scales, GPTQ/AWQ's and compressed-tensors' packed weights).
QUANTIZED_SUFFIXES = ("_blocks", "_scales", ".weight_scale", ".weight_scale_inv", ".qweight", ".qzeros",
                      ".weight_packed", ".scales")


def quantized_expert_tensors(tensors: CheckpointTensors, prefix: str = "") -> list[str]:
    """The checkpoint's tensors (under ``prefix``) that belong to quantized MoE experts, sorted."""
    return sorted(name for name in tensors.names()
                  if name.startswith(prefix) and ".experts." in f"{name}." and name.endswith(QUANTIZED_SUFFIXES))


def replace_quantized_experts(model: nn.Module, tensors: CheckpointTensors, scheme: QuantScheme) -> int:
    """Put a QuantizedExperts in place of each of ``model``'s experts modules whose
    weights the checkpoint stores quantized (those ``scheme``'s ignore list names stay
    as they are); return how many. UnsupportedModelError naming the model type, the
    format and a tensor for quantized expert tensors this cannot hold;
    QuantizedCheckpointError naming a tensor that is missing or of the wrong dtype or shape."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))
    read_prefixes: list[str] = []
    for name, module in experts_modules(model):
        if scheme.online or scheme.ignores(name) or scheme.ignores(tensors.stored_module(name)):
            continue
        if scheme.weights == "mxfp4":
            read = _mxfp4_experts(tensors, name, module, model_type)
        else:
            read = _per_expert_experts(tensors, name, module, scheme, model_type)
        if read is None:
            continue
        prefix, quantized = read
        replace(model, name, quantized)
        read_prefixes.append(prefix + ".")
    unread = [tensor for tensor in quantized_expert_tensors(tensors) if not tensor.startswith(tuple(read_prefixes))]
    if unread:
        raise UnsupportedModelError(
            f"MoE experts of model type {model_type!r} quantized as {scheme.description} ({unread[0]} and "
            f"{len(unread) - 1} more tensors) are not run by shardline: it holds mxfp4 experts of gpt_oss and "
            f"fp8/int8/int4 experts of {', '.join(GATED_HALVES_MODEL_TYPES)}")
    return len(read_prefixes)


def _mxfp4_experts(tensors: CheckpointTensors, name: str, module: nn.Module,
                   model_type: str) -> tuple[str, QuantizedExperts] | None:
    """gpt-oss's experts from their MXFP4 blocks and scales and float biases, with the
    checkpoint prefix they were read under (None: the checkpoint stores them unquantized)."""
    if not quantized_expert_tensors(tensors, name + "."):
        return None
    if type(module).__name__ not in MXFP4_EXPERTS:
        raise UnsupportedModelError(
            f"MoE experts of model type {model_type!r} ({type(module).__name__} at {name}) quantized as mxfp4 "
            f"are not supported: shardline runs mxfp4 experts of gpt_oss only")
    num_experts, hidden, intermediate = (int(_number(module, "num_experts")), int(_number(module, "hidden_size")),
                                         int(_number(module, "intermediate_size")))
    gate_up = read_mxfp4_projection(tensors, f"{name}.gate_up_proj", 2 * intermediate, hidden, num_experts)
    down = read_mxfp4_projection(tensors, f"{name}.down_proj", hidden, intermediate, num_experts)
    gate_up_bias = read_float_bias(tensors, f"{name}.gate_up_proj_bias", (num_experts, 2 * intermediate))
    down_bias = read_float_bias(tensors, f"{name}.down_proj_bias", (num_experts, hidden))
    activation = GatedActivation.clamped_swiglu(_number(module, "alpha"), _number(module, "limit"))
    return name, QuantizedExperts(gate_up, down, activation, gate_up_bias, down_bias)


def _per_expert_experts(tensors: CheckpointTensors, name: str, module: nn.Module, scheme: QuantScheme,
                        model_type: str) -> tuple[str, QuantizedExperts] | None:
    """The experts of a checkpoint that stores each expert's linears apart, in W8/W4,
    with the checkpoint prefix they were read under (None: stored unquantized)."""
    gate_up_names, down_names, renamings = per_expert_names(model_type)
    prefix = next((candidate for candidate in checkpoint_prefixes(name, renamings)
                   if stored_quantized(tensors, f"{candidate}.0.{(gate_up_names or down_names or ('',))[0]}", scheme)),
                  None)
    if prefix is None:
        return None
    if type(module).__name__ not in GATED_HALVES_EXPERTS or not gate_up_names or not down_names:
        raise UnsupportedModelError(
            f"MoE experts of model type {model_type!r} ({type(module).__name__} at {name}) quantized as "
            f"{scheme.description} are not supported: shardline runs per-expert fp8/int8/int4 experts of "
            f"{', '.join(GATED_HALVES_MODEL_TYPES)}")
    gate_up_weight, down_weight = _tensor(module, "gate_up_proj"), _tensor(module, "down_proj")
    num_experts, gate_up_rows, hidden = gate_up_weight.shape
    intermediate = gate_up_rows // len(gate_up_names)

    def projection(names: tuple[str, ...], shape: tuple[int, int]) -> LinearsPerExpert:
        return stack_w8({
            part: [read_quantized_linear(tensors, f"{prefix}.{expert}.{part}", scheme, shape, down_weight.dtype)
                   for expert in range(num_experts)] for part in names})

    gate_up = projection(gate_up_names, (intermediate, hidden))
    down = projection(down_names, (hidden, intermediate))
    act_fn = module.act_fn
    assert isinstance(act_fn, nn.Module), type(act_fn)
    return prefix, QuantizedExperts(gate_up, down, SiluGatedHalves(act_fn))


def per_expert_names(model_type: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """How transformers' weight conversion fuses ``model_type``'s per-expert checkpoint
    linears: the checkpoint's linear names whose outputs make gate_up (in order), those
    making down, and the (checkpoint, model) renamings of module paths it applies first."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    gate_up: tuple[str, ...] = ()
    down: tuple[str, ...] = ()
    renamings: list[tuple[str, str]] = []
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        if isinstance(conversion, WeightRenaming) and not isinstance(conversion, WeightConverter):
            renamings += [(source, target) for source, target in zip(sources, targets, strict=False)
                          if re.fullmatch(r"[\w.]+", source) and re.fullmatch(r"[\w.]+", target)]
            continue
        linears = tuple(source.split(".*.", 1)[-1].removesuffix(".weight") for source in sources if ".*." in source)
        if targets and targets[0].endswith("experts.gate_up_proj"):
            gate_up = linears
        elif targets and targets[0].endswith("experts.down_proj"):
            down = linears
    return gate_up, down, tuple(renamings)


def checkpoint_prefixes(name: str, renamings: tuple[tuple[str, str], ...]) -> list[str]:
    """Where a checkpoint may store the experts module ``name``'s tensors: under its own
    name, or under the name transformers' renamings map to it."""
    candidates = [name]
    for source, target in renamings:
        if target in f".{name}.":
            candidates.append(f".{name}.".replace(target, source, 1).strip("."))
    return candidates


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    tensor = getattr(module, name)
    assert isinstance(tensor, torch.Tensor), (type(module).__name__, name)
    return tensor


def _number(module: nn.Module, name: str) -> float:
    """A plain number the experts module keeps from its config (its sizes, gpt-oss's alpha)."""
    value = module.__dict__.get(name)
    assert isinstance(value, (int, float)), (type(module).__name__, name, value)
    return value
