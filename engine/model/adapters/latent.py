"""deepseek_v3's multi-head latent attention on a paged cache of latents.

The layer's cache holds, per token, its normalized kv_lora_rank-wide latent and its
rotated rotary key (engine/model/kv_cache_spec.py: one "head" of kv_lora_rank +
qk_rope_head_dim keys, no values), and attends it through engine/attention/mla.py:
a decode step's query absorbed into the latent, a prompt's queries over keys and
values up-projected from it. Queries, latents and the rotation are the original
module's own computations, in its order.

Latent caching needs kv_b_proj's weight as a plain matrix (the absorbed projections):
``caches_latents`` says which configs get it; a kv_b_proj that is not an nn.Linear
without bias by the time a step runs (a LoRA wrapper) is refused, naming the layer,
rather than attended without its wrapper.
"""

from __future__ import annotations

import inspect
import sys

import torch
import transformers
from torch import nn

from ...attention.mla import latent_paged_attention, split_up_projection, write_latent
from .base import StepScope, UnsupportedAttentionError, _Replacement, layer_attribute, layer_scale

LATENT_MODEL_TYPES = ("deepseek_v3",)


def caches_latents(text_config: transformers.PretrainedConfig) -> bool:
    """Whether this model's attention layers cache latents instead of keys and values:
    a latent model type whose kv_b_proj is a plain float matrix (no quantization), on a
    host without CUDA (the GPU's decode path, the Triton kernel replayed in CUDA
    graphs, reads full keys and values)."""
    return (text_config.model_type in LATENT_MODEL_TYPES
            and getattr(text_config, "quantization_config", None) is None
            and not torch.cuda.is_available())


class LatentAttention(_Replacement):
    """Replaces one DeepseekV3Attention (see the module docstring)."""

    layer_idx: int

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self._signature = inspect.signature(original.forward)
        self.nope_dim = layer_attribute(original, "qk_nope_head_dim", int)
        self.rope_dim = layer_attribute(original, "qk_rope_head_dim", int)
        self.value_dim = layer_attribute(original, "v_head_dim", int)
        self.rank = layer_attribute(original, "kv_lora_rank", int)
        self.scale = layer_scale(original, "scaling")
        self.q_lora = getattr(original, "q_lora_rank", None) is not None
        config = layer_attribute(original, "config", transformers.PretrainedConfig)
        modeling = sys.modules[type(original).__module__]
        interleave = getattr(config, "rope_interleave", False)
        self._rotate = getattr(modeling, "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb")

    def forward(self, *args, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(*args, **kwargs)
        call = self._signature.bind(*args, **kwargs).arguments
        hidden_states = call["hidden_states"]
        assert hidden_states.shape[0] == 1, "the engine runs one packed sequence"
        x = hidden_states[0]
        module = self.get_submodule
        kv_b_proj = module("kv_b_proj")
        if not isinstance(kv_b_proj, nn.Linear) or kv_b_proj.bias is not None:
            raise UnsupportedAttentionError(
                f"attention layer {self.layer_idx}: kv_b_proj is a {type(kv_b_proj).__name__}; a layer "
                "caching latents reads kv_b_proj's weight itself (an nn.Linear without bias, no wrapper)")
        if self.q_lora:
            q_states = module("q_b_proj")(module("q_a_layernorm")(module("q_a_proj")(x)))
        else:
            q_states = module("q_proj")(x)
        q_nope, q_rot = q_states.view(x.shape[0], -1, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = module("kv_a_proj_with_mqa")(x).split([self.rank, self.rope_dim], dim=-1)
        latent = module("kv_a_layernorm")(latent)
        cos, sin = call["position_embeddings"]
        q_rot, k_rot = self._rotate(q_rot.transpose(0, 1)[None], k_rot[None, None], cos, sin)
        q_rot, k_rot = q_rot[0].transpose(0, 1), k_rot[0, 0]

        cache = ctx.kv_caches[self.layer_idx][0]
        latent_cache = cache.view(*cache.shape[:2], cache.shape[2] * cache.shape[3])
        write_latent(latent_cache, latent, k_rot, ctx.slot_mapping)
        w_uk, w_uv = split_up_projection(kv_b_proj.weight, q_nope.shape[1], self.nope_dim, self.value_dim)
        out = latent_paged_attention(q_nope, q_rot.contiguous(), latent_cache, ctx.query_start_loc, ctx.seq_lens,
                                     ctx.block_tables, w_uk, w_uv, self.scale)
        return module("o_proj")(out.flatten(1)[None].to(x.dtype)), None
