"""A tensor-parallel rank reads only its slices of the weights the ranks split.

Why: a rank that loaded the whole model on the CPU before splitting it would hold the
whole model once per rank in host memory while the ranks load. Instead each rank:

1. builds the model skeleton on the meta device (``SliceReader``, the loader's
   ModelReader for ranks), reads every tensor the ranks keep whole (norms, routers,
   recurrent mixers, biases of row-split linears) and leaves on the meta device the
   parameters the sharding rules split (``split_parameters``);
2. runs the sharding step on that skeleton (shapes are all it reads of a split
   module), then reads each meta parameter of the sharded model as the part of its
   checkpoint tensor this rank keeps (``read_rank_slices``): rows of a column split,
   columns of a row split, vocabulary rows of the embedding and LM head (the head's
   padded with zeros), each expert's share of its intermediate size. Only those bytes
   are read (safetensors' ``get_slice``).

A quantized checkpoint's float parameters the rules split (its embedding, LM head and
unquantized linears) are left on the meta device by its loader (``quantized_splits``)
and read the same way.

A checkpoint this cannot read exactly (not safetensors, a parameter it stores under
another layout than fused experts of per-expert projections, modules kept in float32
under another dtype, a parameter the skeleton would leave neither read nor planned) is
read whole by the loader, which the log says.

Invariants:
- Every slice read has the shape of the sharded parameter it fills (else ShardingError,
  naming it), and no parameter is left on the meta device.
- The slices are those ``shard_model`` cuts from a whole model: the same rules
  (``column_rows``, ``vocab_share``, the experts' share) decide both.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import cast

import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..config import EngineConfig
from ..model.loader import experts_implementation
from ..quantization.checkpoint import CheckpointTensors, QuantizedCheckpointError
from ..quantization.load import checkpoint_directory, checkpoint_renaming
from ..recurrent.base import registered_module_classes
from .experts import float_expert_cuts, splits_unnamed
from .fused import FUSED, as_linear, fused_layout, fused_rows, sliced_as_linear
from .group import RankGroup, ShardingError
from .heads import model_heads
from .layers import ReducedOutput, RowParallelLinear, vocab_share
from .recurrent import GATED_DELTA_NET, MAMBA, MAMBA2
from .sharding import COLUMN, EXPERTS, PACKED, ROW, column_rows, plan_rules, split_of
from .vlm import encoder_prefixes

logger = logging.getLogger(__name__)

# (gate, up, down) names of per-expert projections a checkpoint may store in place of
# transformers' fused gate_up_proj [E, 2I, H] and down_proj [E, H, I].
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclasses.dataclass(frozen=True)
class Cut:
    """The part of a whole tensor one rank keeps: ``ranges`` ([start, end)) along
    ``dim``, joined; rows past the tensor padded with zeros up to ``rows``."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    rows: int | None = None
    transposed: bool = False  # a Conv1D's weight, stored [in, out], read as its linear's [out, in]


def slice_plan(model: nn.Module, group: RankGroup) -> dict[str, Cut]:
    """The cut of each parameter the sharding step splits, by its name in the whole
    ``model`` (shapes only: the model may be on the meta device). ShardingError where a
    split is not exact, as ``shard_model`` raises it."""
    config = getattr(model, "config", None)
    heads = model_heads(config) if isinstance(config, transformers.PretrainedConfig) else None
    mixers = _recurrent_mixers(model) + encoder_prefixes(model)  # read whole (a VLM's encoders: vlm.py)
    rules = plan_rules(model)
    plan: dict[str, Cut] = {}
    for name, module in model.named_modules():
        split = EXPERTS if splits_unnamed(module) else split_of(name, rules)
        if split is None or f"{name}.".startswith(mixers):
            continue
        # shapes only: a Conv1D's as its linear's
        linear = cast(nn.Linear, as_linear(module)) if sliced_as_linear(module) else None
        transposed = isinstance(module, Conv1D)  # stored [in, out]: the cut's dims swapped, the slice transposed
        if linear is not None and split in (COLUMN, *PACKED, FUSED):
            rows = fused_rows(fused_layout(model.get_submodule(name.rpartition(".")[0]), name, config), name,
                              group.rank, group.size) if split == FUSED else \
                column_rows(linear, name, group, heads, 2 if split in PACKED else 1)
            ranges = tuple(_ranges(rows, linear.out_features))
            cut = Cut(1 if transposed else 0, ranges, transposed=transposed)
            plan[f"{name}.weight"] = cut
            if linear.bias is not None:
                plan[f"{name}.bias"] = Cut(0, ranges)
        elif linear is not None and split == ROW and linear.in_features % group.size == 0:
            share = linear.in_features // group.size
            plan[f"{name}.weight"] = Cut(0 if transposed else 1, ((group.rank * share, (group.rank + 1) * share),),
                                         transposed=transposed)
        elif split == EXPERTS:
            plan.update(_expert_cuts(module, name, group))
    plan.update(_vocabulary_cuts(model, group))
    return plan


def _ranges(rows: slice | torch.Tensor, total: int) -> list[tuple[int, int]]:
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(total)
        return [(start, stop)]
    values = rows.tolist()
    breaks = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1] + 1] + [len(values)]
    return [(values[first], values[last - 1] + 1) for first, last in zip(breaks, breaks[1:])]


def _expert_cuts(module: nn.Module, name: str, group: RankGroup) -> dict[str, Cut]:
    """A float experts module's weights as ``split_float_experts`` cuts them: this
    rank's gate_up outputs (and bias entries) of its intermediate share, down's inputs."""
    return {f"{name}.{parameter}": Cut(dim, ranges)
            for parameter, (dim, ranges) in float_expert_cuts(module, name, group).items()}


def _vocabulary_cuts(model: nn.Module, group: RankGroup) -> dict[str, Cut]:
    """The input embedding's and the LM head's rows of this rank's vocabulary share
    (``split_vocabulary``'s: a plain nn.Embedding and an nn.Linear)."""
    names = {id(module): name for name, module in model.named_modules()}
    cuts: dict[str, Cut] = {}
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    if type(embedding) is nn.Embedding and id(embedding) in names and not encoder_prefixes(model):
        share = vocab_share(embedding.num_embeddings, group.size)
        start = min(group.rank * share, embedding.num_embeddings)
        cuts[f"{names[id(embedding)]}.weight"] = Cut(0, ((start, min(start + share, embedding.num_embeddings)),))
    head = get_output() if callable(get_output) else None
    if type(head) is nn.Linear and id(head) in names:
        share = vocab_share(head.out_features, group.size)
        start = min(group.rank * share, head.out_features)
        cut = Cut(0, ((start, min(start + share, head.out_features)),), rows=share)
        cuts[f"{names[id(head)]}.weight"] = cut
        if head.bias is not None:
            cuts[f"{names[id(head)]}.bias"] = cut
    return cuts


def _recurrent_mixers(model: nn.Module) -> tuple[str, ...]:
    """The recurrent mixers' names (each with a trailing dot): read whole, split by their
    own rules (engine/parallel/recurrent.py). The rest of their layers (MLPs, experts)
    splits as any layer's does."""
    classes = set(registered_module_classes()) | set(GATED_DELTA_NET + MAMBA + MAMBA2)
    return tuple(f"{name}." for name, module in model.named_modules() if type(module).__name__ in classes)


@dataclasses.dataclass
class RankCheckpoint:
    """What a rank's sharding step reads its slices from: the checkpoint's tensors by
    model name, and per parameter left on the meta device where it is stored (its own
    name, a tied parameter's, or per-expert projections: (prefix, naming, num_experts))."""

    tensors: CheckpointTensors
    sources: dict[str, str | tuple[str, tuple[str, str, str], int]]

    def read(self, name: str, cut: Cut | None) -> torch.Tensor:
        """The part ``cut`` (None: all) of the whole model's parameter ``name``."""
        source = self.sources[name]
        if isinstance(source, str):
            part = _read_cut(self.tensors, source, cut)
        else:
            part = _read_experts(self.tensors, name.rsplit(".", 1)[-1], source, cut)
        if cut is not None and cut.rows is not None and part.shape[0] < cut.rows:  # the LM head's padding rows
            part = torch.cat([part, part.new_zeros((cut.rows - part.shape[0], *part.shape[1:]))])
        return part.t().contiguous() if cut is not None and cut.transposed else part


def _read_cut(tensors: CheckpointTensors, name: str, cut: Cut | None, dim_offset: int = 0) -> torch.Tensor:
    """Tensor ``name``'s ranges along ``cut.dim - dim_offset``, joined."""
    if cut is None:
        return tensors.get(name)
    dim = cut.dim - dim_offset
    parts = [tensors.get_part(name, (slice(None),) * dim + (slice(start, end),)) for start, end in cut.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_experts(tensors: CheckpointTensors, kind: str, source: tuple[str, tuple[str, str, str], int],
                  cut: Cut | None) -> torch.Tensor:
    """A fused experts parameter (gate_up_proj [E, 2I, H] or down_proj [E, H, I]) from
    per-expert projections [I, H] / [H, I], each expert's cut read alone."""
    prefix, (gate, up, down), num_experts = source
    experts = []
    for expert in range(num_experts):
        if kind == "down_proj":
            experts.append(_read_cut(tensors, f"{prefix}.{expert}.{down}.weight", cut, dim_offset=1))
            continue
        gate_name, up_name = f"{prefix}.{expert}.{gate}.weight", f"{prefix}.{expert}.{up}.weight"
        intermediate = tensors.shape(gate_name)[0]
        ranges = cut.ranges if cut is not None else ((0, 2 * intermediate),)
        parts = []
        for start, end in ranges:  # rows of [gate; up]: a range lies in one half or spans both
            if start < intermediate:
                parts.append(tensors.get_part(gate_name, (slice(start, min(end, intermediate)),)))
            if end > intermediate:
                parts.append(tensors.get_part(up_name, (slice(max(start, intermediate) - intermediate,
                                                              end - intermediate),)))
        experts.append(torch.cat(parts))
    return torch.stack(experts)


class SliceReader:
    """The loader's ModelReader for a tensor-parallel rank (engine/model/loader.py): the
    model skeleton with every tensor but the split ones read; ``checkpoint`` then holds
    what the sharding step reads the rank's slices from. Returns None (the loader reads
    the checkpoint whole) where it cannot read the model exactly, saying why."""

    def __init__(self) -> None:
        self.checkpoint: RankCheckpoint | None = None

    def __call__(self, config: EngineConfig, auto_class: type, hf_config: transformers.PretrainedConfig,
                 dtype: torch.dtype, attn_implementation: str | dict[str, str]) -> nn.Module | None:
        from accelerate import init_empty_weights

        if config.use_safetensors is False:
            return self._whole(config, "use_safetensors=False")
        try:
            tensors = CheckpointTensors(checkpoint_directory(config.model, config.revision))
            with torch.device("cpu"), init_empty_weights(include_buffers=False):
                model = auto_class.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation,
                                               trust_remote_code=config.trust_remote_code,
                                               **experts_implementation(dtype))
            model.tie_weights()  # tied parameters are read through the one the checkpoint stores
            tensors.rename(checkpoint_renaming(model))
            split = set(slice_plan(model, RankGroup(0, config.tensor_parallel_size, lambda: "")))
        except (QuantizedCheckpointError, ShardingError, OSError) as error:
            return self._whole(config, str(error))
        except Exception as error:  # noqa: BLE001 - transformers' own refusals: its whole read says them
            return self._whole(config, f"{type(error).__name__}: {error}")
        if getattr(model, "_keep_in_fp32_modules", None) and dtype != torch.float32:
            return self._whole(config, f"{type(model).__name__} keeps modules in float32 under {dtype}")
        sources, problem = _sources(model, tensors, split)
        if problem is not None:
            return self._whole(config, problem)
        checkpoint = RankCheckpoint(tensors, sources)
        state = {name: _as_loaded(checkpoint.read(name, None), tensor.dtype)
                 for name, tensor in model.state_dict(keep_vars=True).items() if name not in split and name in sources}
        model.load_state_dict(state, strict=False, assign=True)
        unread = next((name for name, parameter in model.named_parameters() if parameter.is_meta and name not in split),
                      None)
        if unread is not None:
            return self._whole(config, f"{unread} is neither read whole nor split")
        self.checkpoint = RankCheckpoint(tensors, {name: sources[name] for name in split})
        logger.info("tensor-parallel rank reads %d split parameters of %s as slices", len(split), config.model)
        return model.eval()

    def quantized_splits(self, config: EngineConfig, model: nn.Module, tensors: CheckpointTensors,
                         read_elsewhere: set[str]) -> set[str]:
        """For a quantized checkpoint (engine/quantization/load.py's ``defer``): the float
        parameters the sharding step splits (the embedding, the LM head, any float linear
        a rule splits), but ``read_elsewhere``'s (quantized linears and experts) and those
        of modules kept in float32, left on the meta device; ``checkpoint`` then holds
        where this rank reads its slices of them. None of them where one is not stored as
        the model holds it (the loader reads them whole), saying why."""
        try:
            split = set(slice_plan(model, RankGroup(0, config.tensor_parallel_size, lambda: ""))) - read_elsewhere
        except ShardingError as error:  # the sharding step refuses it, naming it
            logger.info("tensor-parallel rank reads %s's float tensors whole: %s", config.model, error)
            return set()
        if isinstance(model, transformers.PreTrainedModel):
            model.tie_weights()  # tied parameters are read through the one the checkpoint stores
        kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        split = {name for name in split if not set(name.split(".")[:-1]) & set(kept)}
        sources, problem = _sources(model, tensors, split, only_split=True)
        if problem is not None:
            logger.info("tensor-parallel rank reads %s's float tensors whole: %s", config.model, problem)
            return set()
        self.checkpoint = RankCheckpoint(tensors, sources)
        logger.info("tensor-parallel rank reads %d float parameters of %s as slices", len(sources), config.model)
        return set(sources)

    @staticmethod
    def _whole(config: EngineConfig, why: str) -> None:
        logger.info("tensor-parallel rank reads %s whole before splitting it: %s", config.model, why)
        return None


def _as_loaded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _sources(model: nn.Module, tensors: CheckpointTensors, split: set[str], only_split: bool = False
             ) -> tuple[dict[str, str | tuple[str, tuple[str, str, str], int]], str | None]:
    """Where each parameter (and persistent buffer) of ``model`` is stored (``only_split``:
    each of ``split``), and the first problem: a parameter stored nowhere, or a tensor
    read whole in another shape."""
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    sources: dict[str, str | tuple[str, tuple[str, str, str], int]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if only_split and name not in split:
            continue
        tied = by_tensor.get(id(tensor), [name])
        stored = next((alias for alias in [name, *tied] if alias in tensors), None)
        if stored is not None:
            if name not in split and tuple(tensors.shape(stored)) != tuple(tensor.shape):
                return sources, (f"{stored} is stored as {tuple(tensors.shape(stored))}, "
                                 f"the model has {tuple(tensor.shape)}")
            sources[name] = stored
        elif (experts := _expert_source(name, tensor, tensors)) is not None:
            sources[name] = experts
        elif name in parameters:
            return sources, f"the checkpoint stores {name} under no name or layout read here"
    return sources, None


def _expert_source(name: str, tensor: torch.Tensor,
                   tensors: CheckpointTensors) -> tuple[str, tuple[str, str, str], int] | None:
    """A fused experts parameter stored as per-expert projections: (prefix, naming, E)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return None
    for naming in EXPERT_NAMES:
        if all(f"{prefix}.{expert}.{part}.weight" in tensors for expert in range(tensor.shape[0]) for part in naming):
            return prefix, naming, tensor.shape[0]
    return None


def read_rank_slices(model: nn.Module, checkpoint: RankCheckpoint, plan: dict[str, Cut]) -> int:
    """Fill each parameter the sharding step left on the meta device with this rank's
    slice of its checkpoint tensor (``plan``: the cuts by whole-model name, from
    ``slice_plan`` before the split); return how many were read. ShardingError, naming
    the parameter, where a slice's shape is not the shard's or one is left unread."""
    wrappers = {name for name, module in model.named_modules()
                if isinstance(module, (RowParallelLinear, ReducedOutput))}
    count = 0
    for name, parameter in list(model.named_parameters(remove_duplicate=False)):
        if not parameter.is_meta:
            continue
        whole = _whole_name(name, wrappers)
        if whole not in checkpoint.sources:
            raise ShardingError(f"{name}: left unread by the tensor-parallel loading "
                                f"(no checkpoint source for {whole})")
        part = _as_loaded(checkpoint.read(whole, plan.get(whole)), parameter.dtype)
        if tuple(part.shape) != tuple(parameter.shape):
            raise ShardingError(f"{name}: this rank's slice of {whole} is {tuple(part.shape)}, its shard "
                                f"{tuple(parameter.shape)}; the split and the slices disagree")
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(part, requires_grad=False))
        count += 1
    return count


def _whole_name(name: str, wrappers: Iterable[str]) -> str:
    """A sharded model's parameter name as the whole model's: the child a parallel
    wrapper put its module under (RowParallelLinear's ``linear``, ReducedOutput's
    ``inner``) dropped."""
    wrapper_paths = set(wrappers)
    parts, kept, index = name.split("."), [], 0
    while index < len(parts):
        kept.append(parts[index])
        skip = ".".join(parts[: index + 1]) in wrapper_paths and index + 2 < len(parts)
        index += 2 if skip else 1
    return ".".join(kept)
