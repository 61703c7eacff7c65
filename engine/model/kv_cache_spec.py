"""What each decoder layer keeps in the paged KV cache, read from the model's config,
and the cache planned and allocated from that list.

Every layer declares its own spec, so layers may differ in kind, heads and head sizes;
the planner sizes a block as the sum over layers. Kinds today: "full" attention and
"sliding_window" attention (which keeps its whole context in the cache like a full
layer; the window is applied when attending). A "recurrent" layer (gated delta-net,
short convolution...: a kind registered in engine/recurrent/) holds no KV: it takes
no room in a block, and its per-request state lives in state slots planned beside
the blocks (engine/recurrent/state.py). Any other layer whose state is not keys and
values is refused at load, naming the layer, rather than run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import transformers

from .loader import RECURRENT, layer_kind, layer_types


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's slice of each cache block: keys [block_size, num_kv_heads, head_dim],
    values [block_size, num_kv_heads, value_head_dim]."""

    kind: str
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    sliding_window: int | None = None

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
    def from_hf_config(cls, hf_config: transformers.PretrainedConfig, dtype: torch.dtype) -> "KVCacheSpec":
        """Each layer's spec from the config: its own sub-config where the config has
        per-layer attributes (``per_layer_config``), else the config's common ones."""
        text_config = hf_config.get_text_config()
        per_layer = getattr(text_config, "per_layer_config", None)
        layers = []
        for index, layer_type in enumerate(layer_types(hf_config)):
            kind = layer_kind(hf_config, layer_type)
            if kind == RECURRENT:  # per-request state slots instead (engine/recurrent/state.py)
                layers.append(LayerCacheSpec(kind, 0, 0, 0))
                continue
            layer_config = per_layer[index] if per_layer is not None else text_config
            num_heads = layer_config.num_attention_heads
            num_kv_heads = getattr(layer_config, "num_key_value_heads", None) or num_heads
            head_dim = getattr(layer_config, "head_dim", None) or text_config.hidden_size // num_heads
            window = getattr(text_config, "sliding_window", None) if kind == "sliding_window" else None
            layers.append(LayerCacheSpec(kind, num_kv_heads, head_dim, head_dim, window))
        return cls(tuple(layers), dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return element_size * sum(layer.elements_per_block(block_size) for layer in self.layers)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (key cache, value cache), zeroed."""
        caches = []
        for layer in self.layers:
            key_shape, value_shape = layer.block_shapes(num_blocks, block_size)
            caches.append((torch.zeros(key_shape, dtype=self.dtype, device=device),
                           torch.zeros(value_shape, dtype=self.dtype, device=device)))
        return caches


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
