"""What each decoder layer keeps in the paged KV cache, read from the model's config,
and the cache planned and allocated from that list.

Every layer declares its own spec, so layers may differ in kind, heads and head sizes;
the planner sizes a block as the sum over layers. Kinds today: "full" attention,
"sliding_window" attention and "chunked" local attention (llama4: a query sees its
own aligned chunk of ``attention_chunk_size`` tokens). Where windowed layers sit beside
full ones, ``plan_windowed_blocks`` gives each windowed group its own pool and block
tables (engine/core/window_blocks.py), which hold only the blocks some query still
reads; otherwise every layer keeps the whole context, the window or chunk applied when
attending. A model that runs some layers several times per token (hrm_text's
reasoning cycles, dory's loops) gets one cache layer per pass, each call of its
attention naming its own (engine/model/adapters/base.py, CallIndexedAttention); inkling
keeps its layers' convolution inputs in as many sliding-window layers after its own
(engine/model/adapters/inkling.py).
Keys and values each have their own head size: multi-head latent
attention (deepseek_v2, minicpm3, ...) attends keys of qk_nope + qk_rope and
values of v_head_dim per head, cached in full at those sizes, except where the layer
caches latents (engine/model/adapters/latent.py: its LATENT_LAYOUTS types, float or FP8): one
"head" of the layer's kv_lora_rank + qk_rope_head_dim numbers per token and no values (a
sliding-window latent layer, dots3_note's, in its windowed group); a sparse attention's
layer (deepseek_v32, glm_moe_dsa) keeps its indexer's keys in the value cache's place, one
"head" of index_head_dim numbers per token (none for a layer reusing another's selection),
so they share the latents' blocks, slots and prefix hits. A "recurrent" layer
(gated delta-net, short convolution...: a kind registered in engine/recurrent/) holds
no KV: it takes no room in a block, and its per-request state lives in state slots
planned beside the blocks (engine/recurrent/state.py). Any other layer whose state is not keys and
values is refused at load, naming the layer, rather than run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import transformers

from ..core.kv_cache import blocks_needed
from ..core.window_blocks import CHUNKED, FULL, SLIDING, LayerGroup, WindowedLayout, layer_groups, split_budget
from ..cpu.memory import huge_page_zeros
from .adapters.deepseek_v4 import COMPRESSED_MODEL_TYPES, COMPRESSED_TYPES, compressed_row_width
from .adapters.indexer import index_key_width
from .adapters.inkling import INKLING_TYPES, inkling_conv_widths, inkling_kv_width
from .adapters.inkling2 import repeated_loop_layers
from .adapters.latent import caches_latents, selects_keys
from .adapters.qwen4_exp import QSA_MODEL_TYPES, index_columns
from .layer_kinds import NO_STATE, RECURRENT, layer_kind, layer_types
from .loader import key_value_heads, value_cache_head_size

# Model types whose sliding-window layers have more key-value heads than the config's
# num_key_value_heads, by this factor (mimo_v2_flash's attention doubles them there).
SLIDING_KV_HEAD_FACTOR = {"mimo_v2_flash": 2}


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's slice of each cache block: keys [block_size, num_kv_heads, head_dim],
    values [block_size, num_kv_heads, value_head_dim]."""

    kind: str
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    sliding_window: int | None = None
    chunk_size: int | None = None  # kind "chunked": a query sees its own aligned chunk

    def block_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return ((num_blocks, block_size, self.num_kv_heads, self.head_dim),
                (num_blocks, block_size, self.num_kv_heads, self.value_head_dim))

    def elements_per_block(self, block_size: int) -> int:
        return block_size * self.num_kv_heads * (self.head_dim + self.value_head_dim)


@dataclass(frozen=True)
class KVCacheSpec:
    """The layers' specs, in layer order, and the cache's dtype."""

    layers: tuple[LayerCacheSpec, ...]
    dtype: torch.dtype

    @classmethod
    def from_hf_config(cls, hf_config: transformers.PretrainedConfig, dtype: torch.dtype) -> KVCacheSpec:
        """Each layer's spec from the config: its own sub-config where the config has
        per-layer attributes (``per_layer_config``), else the config's common ones."""
        text_config = hf_config.get_text_config()
        per_layer = getattr(text_config, "per_layer_config", None)
        layers = []
        for index, layer_type in enumerate(layer_types(hf_config)):
            kind = layer_kind(hf_config, layer_type)
            assert kind is not None, f"layer {index}: layer_types refuses a {layer_type!r} layer, which has no kind"
            if kind in (RECURRENT, NO_STATE):  # state slots instead (engine/recurrent/state.py), or nothing
                layers.append(LayerCacheSpec(kind, 0, 0, 0))
                continue
            layer_config = per_layer[index] if per_layer is not None else text_config
            num_heads = layer_config.num_attention_heads
            num_kv_heads = key_value_heads(layer_config, num_heads)
            if kind == "sliding_window":
                num_kv_heads *= SLIDING_KV_HEAD_FACTOR.get(text_config.model_type, 1)
            if text_config.model_type in COMPRESSED_MODEL_TYPES:  # one shared key-value head, whatever the config says
                num_kv_heads = 1
            if caches_latents(text_config):  # a sparse attention's index keys where values would be
                index_width = index_key_width(text_config, index) if selects_keys(text_config) else 0
                window = getattr(text_config, "sliding_window", None) if kind == "sliding_window" else None
                layers.append(LayerCacheSpec(kind, 1, layer_config.kv_lora_rank + layer_config.qk_rope_head_dim,
                                             index_width, window))
                continue
            if text_config.model_type in INKLING_TYPES:  # all heads' keys and values in one row each
                width = inkling_kv_width(text_config, layer_type)
                window = text_config.sliding_window if kind == "sliding_window" else None
                layers.append(LayerCacheSpec(kind, 1, width, width, window))
                continue
            head_dim, value_head_dim = _head_sizes(layer_config, text_config.hidden_size // num_heads)
            value_head_dim = value_cache_head_size(layer_config, value_head_dim)
            if layer_type in COMPRESSED_TYPES:  # the compressors' rows where values would be (K = V)
                value_head_dim = compressed_row_width(text_config, layer_type)
            if layer_type == "indexed_attention" and text_config.model_type in QSA_MODEL_TYPES:  # then its index key
                value_head_dim += index_columns(text_config, num_kv_heads)
            window = getattr(text_config, "sliding_window", None) if kind == "sliding_window" else None
            chunk = getattr(text_config, "attention_chunk_size", None) if kind == "chunked" else None
            layers.append(LayerCacheSpec(kind, num_kv_heads, head_dim, value_head_dim, window, chunk))
        repeated = repeated_pass_layers(text_config)
        layers += [layers[index] for index in repeated]
        if text_config.model_type in INKLING_TYPES:  # then each attention layer's convolution inputs, for a few tokens
            types = layer_types(hf_config)
            layers += [LayerCacheSpec(SLIDING, 1, *inkling_conv_widths(text_config, layer_type),
                                      sliding_window=text_config.conv_kernel_size)
                       for layer_type in types + [types[index] for index in repeated]]
        return cls(tuple(layers), dtype)

    @property
    def chunk_sizes(self) -> tuple[int | None, ...]:
        """Each layer's chunked-attention chunk size (None: not chunked); empty when no
        layer is chunked, so the attention backends do nothing per layer then."""
        sizes = tuple(layer.chunk_size for layer in self.layers)
        return sizes if any(size is not None for size in sizes) else ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return element_size * sum(layer.elements_per_block(block_size) for layer in self.layers)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device,
                 layer_num_blocks: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (key cache, value cache), zeroed; ``layer_num_blocks``: each
        layer's own number of blocks (windowed groups), else ``num_blocks`` for all."""
        caches = []
        for index, layer in enumerate(self.layers):
            count = layer_num_blocks[index] if layer_num_blocks is not None else num_blocks
            key_shape, value_shape = layer.block_shapes(count, block_size)
            if torch.device(device).type == "cpu":  # scattered block reads: huge pages spare the TLB
                caches.append((huge_page_zeros(key_shape, self.dtype), huge_page_zeros(value_shape, self.dtype)))
            else:
                caches.append((torch.zeros(key_shape, dtype=self.dtype, device=device),
                               torch.zeros(value_shape, dtype=self.dtype, device=device)))
        return caches


def first_attention_heads(hf_config: transformers.PretrainedConfig) -> int:
    """The query heads of the model's first layer, read from its own per-layer config where
    the config has one (dots3_note's layers differ, and transformers refuses the global
    read then); 1 for a model that names none (a pure state-space model)."""
    text_config = hf_config.get_text_config()
    per_layer = getattr(text_config, "per_layer_config", None)
    layer_config = per_layer[0] if per_layer is not None else text_config
    return getattr(layer_config, "num_attention_heads", None) or 1


def repeated_pass_layers(text_config: transformers.PretrainedConfig) -> list[int]:
    """Decoder layers a model runs again in later passes over the same token, each pass
    attending cache layers of its own that follow the model's (dory's recurrent section,
    inkling2_loop's looped layers, once per loop after the first; their attention names
    them by ``cache_offset``): their indices, in the order of those extra cache layers.
    hrm_text needs none: its config's num_hidden_layers already counts one layer per pass."""
    if text_config.model_type == "inkling2_loop_text":
        return repeated_loop_layers(text_config)
    if text_config.model_type != "dory":
        return []
    section = list(range(text_config.n_input_layers, text_config.n_input_layers + text_config.n_recurrent_layers))
    return section * (text_config.n_recurrent_loops - 1)


def _head_sizes(layer_config: transformers.PretrainedConfig, default: int) -> tuple[int, int]:
    """(key head size, value head size) of a layer: multi-head latent attention's
    qk_head_dim (or qk_nope_head_dim + qk_rope_head_dim) and v_head_dim where the
    config has them (its ``head_dim`` is then the rotary part alone), else head_dim,
    else hidden_size / heads (``default``) for both."""
    head_dim = getattr(layer_config, "qk_head_dim", None)
    nope, rope = getattr(layer_config, "qk_nope_head_dim", None), getattr(layer_config, "qk_rope_head_dim", None)
    if head_dim is None and nope is not None and rope is not None:
        head_dim = nope + rope
    head_dim = head_dim or getattr(layer_config, "head_dim", None) or default
    return head_dim, getattr(layer_config, "v_head_dim", None) or head_dim


def plan_num_blocks(spec: KVCacheSpec, block_size: int, max_num_seqs: int, model_len: int, free_bytes: int) -> int:
    """Number of KV blocks: the memory budget, but no more than every running
    request at full length could use."""
    per_block = spec.bytes_per_block(block_size)
    max_useful = max_num_seqs * math.ceil(model_len / block_size) + 1
    budget_blocks = free_bytes // per_block if per_block else max_useful  # no KV layer: blocks cost nothing
    num_blocks = int(min(budget_blocks, max_useful))
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget of {free_bytes} bytes holds no block of {per_block} bytes; "
            "raise kv_cache_memory_bytes or gpu_memory_utilization"
        )
    return num_blocks


def plan_windowed_blocks(spec: KVCacheSpec, block_size: int, max_num_seqs: int, model_len: int,
                         max_step_tokens: int, free_bytes: int) -> tuple[int, WindowedLayout] | None:
    """(the primary group's blocks, the windowed groups' layout) for a model with
    sliding-window or chunked layers: one byte budget split between the groups by what a
    request holds in each (window_blocks.split_budget). Where every layer is windowed, the
    primary group holds no layer: its table only counts each request's context. None
    where no layer is windowed or the budget does not hold one request in every group:
    one table for all layers then."""
    kinds: list[tuple[str, int | None]] = []
    for layer in spec.layers:
        span = layer.sliding_window if layer.kind == SLIDING else layer.chunk_size if layer.kind == CHUNKED else None
        kinds.append((layer.kind, span) if layer.num_kv_heads and span else (FULL, None))
    groups = layer_groups(kinds)
    windowed = tuple(group for group in groups if group.kind != FULL)
    if not windowed:
        return None
    primary = next((group for group in groups if group.kind == FULL), LayerGroup(FULL, None, ()))
    ordered = (primary, *windowed)
    element = torch.empty((), dtype=spec.dtype).element_size()
    group_bytes = [element * sum(spec.layers[index].elements_per_block(block_size) for index in group.layers)
                   for group in ordered]
    counts = split_budget(ordered, group_bytes, free_bytes, block_size, model_len, max_step_tokens, max_num_seqs)
    if counts[0] < blocks_needed(model_len, block_size) + 1 or any(
            count < group.blocks_held(model_len, max_step_tokens, block_size) + 1
            for group, count in zip(windowed, counts[1:], strict=True)):
        return None
    group_of_layer = {index: number for number, group in enumerate(windowed, 1) for index in group.layers}
    layer_group = tuple(group_of_layer.get(index, 0) for index in range(spec.num_layers))
    return counts[0], WindowedLayout(windowed, tuple(counts[1:]), layer_group)
