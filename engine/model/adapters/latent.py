"""Multi-head latent attention (deepseek_v2/v3 and the types built on it) on a paged
cache of latents.

The layer's cache holds, per token, its normalized kv_lora_rank-wide latent and its
rotated rotary key (engine/model/kv_cache_spec.py: one "head" of kv_lora_rank +
qk_rope_head_dim keys, no values), and attends it through engine/attention/mla.py:
a decode step's query absorbed into the latent (on the CPU, the C kernel
kernels/cpu_mla.py where it builds; on the Triton backend, the Triton kernel
kernels/mla_decode.py, which CUDA decode graphs record), a prompt's queries over keys
and values up-projected from it. Queries, latents and the rotation are the original module's
own computations, in its order.

The types differ only where LATENT_LAYOUTS says: how the rotary part is rotated
(deepseek_v2 multiplies complex numbers; kimi_linear's latent layers use no
rotation), longcat_flash's LoRA scales on the query and the latent and
bailing_hybrid's per-head output gate, axk2's gated query projection, and a sparse
attention's indexer (deepseek_v32, glm_moe_dsa, axk2: adapters/indexer.py), whose
selection the attention then reads. The query comes from q_proj, or from q_a_proj,
q_a_layernorm and q_b_proj where the layer has a query LoRA.

Latent caching needs kv_b_proj's weight as a float matrix (the absorbed projections):
an FP8 checkpoint's quantized kv_b_proj (engine/quantization/) is dequantized once, on
the first step, and kept in the model's dtype beside it; ``latent_cache_refusal`` says
why a latent type keeps full keys and values instead (another quantization); a
kv_b_proj that is neither an nn.Linear nor a QuantizedLinear without bias by the time
a step runs (a LoRA wrapper) is refused, naming the layer, rather than
attended without its wrapper.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import transformers
from torch import nn

from ...attention.backends import TritonIndices
from ...attention.context import AttentionContext, AttentionOptions
from ...attention.mla import latent_decode_triton, latent_paged_attention, split_up_projection, write_latent
from ...quantization.linear import QuantizedLinear
from .base import StepScope, UnsupportedAttentionError, _Replacement, layer_attribute, layer_scale
from .indexer import IndexerLayout, LayerIndexer, layer_selects, shared_selections

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatentLayout:
    """Where one model type's latent attention departs from deepseek_v3's.

    rotation: "config" (the config's rope_interleave picks apply_rotary_pos_emb_interleave
    or apply_rotary_pos_emb), "interleave", "half" (apply_rotary_pos_emb), "own" (the
    one of the two its modeling file defines), "complex"
    (deepseek_v2's apply_rotary_emb on complex frequencies) or "none".
    lora_scales: the query scaled by the layer's mla_scale_q_lora and the latent by its
    mla_scale_kv_lora before the rotation (the latent is cached scaled).
    lora_input_scales: the query LoRA's normed output scaled by the layer's q_lora_scale
    before q_b_proj (the indexer reads it scaled) and the normed latent by its
    kv_lora_scale (cached scaled) (dots3_note).
    rope_key_norm: the rotary key RMS-normed by k_rope_only_layernorm before the
    rotation (dots3_note).
    output_gate: each head's output scaled by sigmoid(g_proj(x)), the sigmoid taken in
    float32 ("float", bailing_hybrid) or the model's dtype ("model", dots3_note).
    modeling: the model type whose modeling file holds the attention class, where it is
    another type's (sarvam_mla runs deepseek_v3's).
    indexer: a sparse attention's indexer (adapters/indexer.py; None: no indexer); its
    layers return their key selection as a third output where ``returns_selection``.
    query_gate: each head's query and an output gate from q_gate_proj over the query
    LoRA's normed and raw outputs side by side, the output scaled by sigmoid(gate) (axk2).
    head_gate: each head's output scaled by sigmoid(gate_proj(x)) in the model's dtype,
    and ``sinks``: a learned logit per head joining each softmax (hy_v4)."""

    attention_class: str
    rotation: str = "config"
    lora_scales: bool = False
    lora_input_scales: bool = False
    rope_key_norm: bool = False
    output_gate: str | None = None
    modeling: str | None = None
    indexer: IndexerLayout | None = None
    returns_selection: bool = False
    query_gate: bool = False
    head_gate: bool = False
    sinks: bool = False


LATENT_LAYOUTS: dict[str, LatentLayout] = {
    "deepseek_v2": LatentLayout("DeepseekV2Attention", rotation="complex"),
    "deepseek_v3": LatentLayout("DeepseekV3Attention"),  # Kimi-K2 too
    "minicpm3": LatentLayout("MiniCPM3Attention", rotation="half"),
    "glm4_moe_lite": LatentLayout("Glm4MoeLiteAttention"),
    "youtu": LatentLayout("YoutuAttention"),
    "axk1": LatentLayout("AXK1Attention"),
    "bailing_hybrid": LatentLayout("BailingHybridAttention", rotation="interleave", output_gate="float"),
    "longcat_flash": LatentLayout("LongcatFlashMLA", rotation="interleave", lora_scales=True),
    "kimi_linear": LatentLayout("KimiLinearAttention", rotation="none"),
    "sarvam_mla": LatentLayout("DeepseekV3Attention", modeling="deepseek_v3"),
    "deepseek_v32": LatentLayout("DeepseekV32Attention", rotation="interleave", indexer=IndexerLayout("half")),
    "glm_moe_dsa": LatentLayout("GlmMoeDsaAttention", rotation="interleave", indexer=IndexerLayout("interleave"),
                                returns_selection=True),
    "axk2": LatentLayout("AXK2Attention", rotation="interleave", indexer=IndexerLayout("half"), query_gate=True),
    "hy_v4": LatentLayout("HYV4Attention", rotation="own", returns_selection=True, head_gate=True, sinks=True,
                          indexer=IndexerLayout("own", rope_last=True, scale_on_weights=True)),
    # Indexed layers beside sliding-window layers of their own latent sizes (each layer's
    # sizes are its module's; a layer's window is its module's sliding_window).
    "dots3_note_text": LatentLayout("Dots3NoteTextAttention", modeling="dots3_note", rotation="interleave",
                                    lora_input_scales=True, rope_key_norm=True, output_gate="model",
                                    indexer=IndexerLayout("interleave")),
}


def latent_cache_refusal(text_config: transformers.PretrainedConfig) -> str | None:
    """Why this latent-attention config keeps every head's keys and values in the
    cache instead of its latents, or None when its layers cache latents (also None for
    a model without latent attention: see ``caches_latents``)."""
    if text_config.model_type not in LATENT_LAYOUTS:
        return None
    quantization = getattr(text_config, "quantization_config", None)
    if quantization is not None and not _dequantizable(quantization):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        return (f"its kv_b_proj is quantized ({method!r}) and the absorbed decode reads it as a float matrix; "
                "only an FP8 kv_b_proj is dequantized for it")
    return None


def _dequantizable(quantization: object) -> bool:
    """A quantization config whose kv_b_proj LatentAttention dequantizes (FP8: a W8
    QuantizedLinear, per tensor, channel or block)."""
    as_dict = quantization if isinstance(quantization, dict) else getattr(quantization, "to_dict", dict)()
    return as_dict.get("quant_method") == "fp8"


def selects_keys(text_config: transformers.PretrainedConfig) -> bool:
    """Whether this model's latent layers attend only the keys a sparse attention's
    indexer selects (LATENT_LAYOUTS' ``indexer``); such a model runs only caching latents."""
    layout = LATENT_LAYOUTS.get(text_config.model_type)
    return layout is not None and layout.indexer is not None


def caches_latents(text_config: transformers.PretrainedConfig) -> bool:
    """Whether this model's attention layers cache latents instead of keys and values."""
    return text_config.model_type in LATENT_LAYOUTS and latent_cache_refusal(text_config) is None


def latent_caching(text_config: transformers.PretrainedConfig) -> bool:
    """``caches_latents``, logging for a latent type that keeps full keys and values why,
    and for a sparse attention which paths take its selection."""
    reason = latent_cache_refusal(text_config)
    if reason is not None:
        logger.info("%s's attention layers cache full keys and values, not latents: %s", text_config.model_type, reason)
    elif selects_keys(text_config):
        logger.info("%s's sparse attention: index keys cached beside the latents; a request of more than "
                    "index_topk=%d keys attends its selected keys in torch, a shorter one every key through the "
                    "latent decode kernels where they run", text_config.model_type, text_config.index_topk)
    return caches_latents(text_config)


def latent_adapter_keys() -> dict[str, type[LatentAttention]]:
    """transformers' attention class key (module and name) -> the latent adapter, for
    every type in LATENT_LAYOUTS."""
    keys = {}
    for model_type, layout in LATENT_LAYOUTS.items():
        module = layout.modeling or model_type
        keys[f"transformers.models.{module}.modeling_{module}.{layout.attention_class}"] = LatentAttention
    return keys


class LatentAttention(_Replacement):
    """Replaces one latent attention module (see the module docstring)."""

    layer_idx: int
    # Decode steps through the C kernel (kernels/cpu_mla.py) where it takes the cache:
    # set by the CPU paths' choice (engine/cpu/paths.py, the decode kernel path).
    latent_decode_kernel: bool = False

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        own_index = getattr(original, "layer_idx", None)  # longcat_flash: two per decoder layer
        super().__init__(original, own_index if isinstance(own_index, int) else layer_idx, scope)
        self._signature = inspect.signature(original.forward)
        self.nope_dim = layer_attribute(original, "qk_nope_head_dim", int)
        self.rope_dim = layer_attribute(original, "qk_rope_head_dim", int)
        self.value_dim = layer_attribute(original, "v_head_dim", int)
        self.rank = layer_attribute(original, "kv_lora_rank", int)
        self.scale = layer_scale(original, "scaling")
        self.q_lora = getattr(original, "q_a_proj", None) is not None
        config = layer_attribute(original, "config", transformers.PretrainedConfig)
        layout = LATENT_LAYOUTS[config.model_type]
        self.lora_scales = ((layer_scale(original, "mla_scale_q_lora"), layer_scale(original, "mla_scale_kv_lora"))
                            if layout.lora_scales else None)
        self.lora_input_scales = ((layer_scale(original, "q_lora_scale"), layer_scale(original, "kv_lora_scale"))
                                  if layout.lora_input_scales else None)
        self.rope_key_norm = layout.rope_key_norm
        window = getattr(original, "sliding_window", None)
        self.sliding_window = None if window is None else int(layer_scale(original, "sliding_window"))
        self.output_gate = layout.output_gate
        self.query_gate = layout.query_gate
        self.head_gate = layout.head_gate
        self.has_sinks = layout.sinks
        self._dequantized: list[torch.Tensor] = []  # a quantized kv_b_proj's float weight, once read
        modeling = sys.modules[type(original).__module__]
        self._rotate = _rotation(modeling, layout.rotation, config)
        self._outputs = 3 if layout.returns_selection else 2
        self.indexed = layout.indexer is not None and layer_selects(config, self.layer_idx)
        self._indexer = (LayerIndexer(self, self.layer_idx, layout.indexer,
                                      _rotation(modeling, layout.indexer.rotation, config), scope)
                         if layout.indexer is not None and getattr(original, "indexer", None) is not None else None)

    def forward(self, *args, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(*args, **kwargs)
        ctx = ctx.for_layer(self.layer_idx, AttentionOptions(self.scale, self.sliding_window))  # a windowed group's
        call = self._signature.bind(*args, **kwargs).arguments
        hidden_states = call["hidden_states"]
        assert hidden_states.shape[0] == 1, "the engine runs one packed sequence"
        x = hidden_states[0]
        position_embeddings = call.get("position_embeddings")
        q_nope, q_rot, latent, k_rot, q_resid, gate = self._project(x, position_embeddings)
        w_uk, w_uv = split_up_projection(self._up_projection(x.dtype), q_nope.shape[1], self.nope_dim, self.value_dim)
        if isinstance(ctx.work, TritonIndices) and not self.indexed and self.sliding_window is None:
            out = self._attend_triton(ctx, ctx.work, q_nope, q_rot.contiguous(), latent, k_rot, w_uk, w_uv)
        else:
            # A sparse attention's layers read their selection on the host, on either backend, and
            # windowed layers attend there (the Triton decode kernel takes no window).
            cache = ctx.kv_caches[self.layer_idx][0]
            latent_cache = cache.view(*cache.shape[:2], cache.shape[2] * cache.shape[3])
            write_latent(latent_cache, latent, k_rot, ctx.slot_mapping)
            selections = None
            if self._indexer is not None:
                assert q_resid is not None, "an indexed layer has a query LoRA"
                selections = self._indexer.select(ctx, x, q_resid, position_embeddings)
            elif self.indexed:
                selections = shared_selections(self._scope, self.layer_idx)
            kernel = "triton" if isinstance(ctx.work, TritonIndices) else "c" if self.latent_decode_kernel else None
            sinks = self.get_parameter("sinks") if self.has_sinks else None
            out = latent_paged_attention(q_nope, q_rot.contiguous(), latent_cache, ctx.query_start_loc, ctx.seq_lens,
                                         ctx.block_tables, w_uk, w_uv, self.scale, decode_kernel=kernel,
                                         selections=selections, sinks=sinks, sliding_window=self.sliding_window)
        out = out.to(x.dtype)
        if self.head_gate:
            out = out * torch.sigmoid(self.get_submodule("gate_proj")(x).view(out.shape))
        if gate is not None:
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        if self.output_gate is not None:
            head_gate = self.get_submodule("g_proj")(x)
            out = out * (torch.sigmoid(head_gate.float()).to(x.dtype) if self.output_gate == "float"
                         else torch.sigmoid(head_gate))[..., None]
        return (self.get_submodule("o_proj")(out.flatten(1)[None]), None, None)[:self._outputs]

    def _attend_triton(self, ctx: AttentionContext, indices: TritonIndices, q_nope: torch.Tensor,
                       q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor) -> torch.Tensor:
        """The Triton backend's step: rows stored by the store kernel (slot -1 skipped: a
        CUDA graph's padding rows); a step of one query per request attends through
        ``latent_decode_triton`` (what decode graphs record), any other step through
        ``latent_paged_attention``, its one-query requests through the Triton kernel."""
        from ...kernels import store_kv_cache

        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        rows = torch.cat([latent, k_rot], dim=-1).to(k_cache.dtype)[:, None]  # [T, 1, r + dr]
        store_kv_cache(rows, rows[..., :0], k_cache, v_cache, ctx.slot_mapping)
        latent_cache = k_cache.view(*k_cache.shape[:2], k_cache.shape[2] * k_cache.shape[3])
        if ctx.max_query_len == 1 and q_nope.shape[0] == ctx.block_tables.shape[0]:
            return latent_decode_triton(q_nope, q_rot, latent_cache, indices.seq_lens, ctx.block_tables, w_uk, w_uv,
                                        self.scale)
        return latent_paged_attention(q_nope, q_rot, latent_cache, indices.query_start_loc, indices.seq_lens,
                                      ctx.block_tables, w_uk, w_uv, self.scale, decode_kernel="triton")

    def _up_projection(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight [H * (dn + dv), r] as a float matrix: an nn.Linear's own, or
        a QuantizedLinear's (an FP8 checkpoint's) dequantized once, in ``dtype``, on the
        first step (the load check's) and kept for every later one."""
        kv_b_proj = self.get_submodule("kv_b_proj")
        if isinstance(kv_b_proj, nn.Linear) and kv_b_proj.bias is None:
            return kv_b_proj.weight
        if isinstance(kv_b_proj, QuantizedLinear) and kv_b_proj.bias is None and kv_b_proj.input_perm is None:
            if not self._dequantized or self._dequantized[0].dtype != dtype:
                self._dequantized[:] = [kv_b_proj.dequantized_rows(0, kv_b_proj.out_features).to(dtype)]
            return self._dequantized[0]
        raise UnsupportedAttentionError(
            f"attention layer {self.layer_idx}: kv_b_proj is a {type(kv_b_proj).__name__}; a layer caching "
            "latents reads kv_b_proj's weight itself (an nn.Linear or a QuantizedLinear without bias, no wrapper)")

    def _project(self, x: torch.Tensor, position_embeddings: PositionEmbeddings) -> LatentProjection:
        """x [T, hidden] -> q_nope [T, H, dn], q_rot [T, H, dr] (rotated), latent [T, r],
        k_rot [T, dr] (rotated), as the original module computes them, the query
        LoRA's normed output [T, q_lora_rank] (None without one: the indexer's input) and
        the output gate [T, H, dv] (``query_gate``, else None)."""
        module = self.get_submodule
        q_resid = gate = None
        if self.query_gate:
            q_compressed = module("q_a_proj")(x)
            q_resid = module("q_a_layernorm")(q_compressed)
            query_gate = module("q_gate_proj")(torch.cat([q_resid, q_compressed], dim=-1))
            q_states, gate = query_gate.view(x.shape[0], -1, self.nope_dim + self.rope_dim + self.value_dim).split(
                [self.nope_dim + self.rope_dim, self.value_dim], dim=-1)
        elif self.q_lora:
            q_resid = module("q_a_layernorm")(module("q_a_proj")(x))
            if self.lora_input_scales is not None:
                q_resid = q_resid * self.lora_input_scales[0]
            q_states = module("q_b_proj")(q_resid)
        else:
            q_states = module("q_proj")(x)
        q_nope, q_rot = q_states.view(x.shape[0], -1, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = module("kv_a_proj_with_mqa")(x).split([self.rank, self.rope_dim], dim=-1)
        latent = module("kv_a_layernorm")(latent)
        if self.lora_input_scales is not None:
            latent = latent * self.lora_input_scales[1]
        if self.rope_key_norm:
            k_rot = module("k_rope_only_layernorm")(k_rot)
        if self.lora_scales is not None:
            q_scale, latent_scale = self.lora_scales
            q_nope, q_rot, latent = q_nope * q_scale, q_rot * q_scale, latent * latent_scale
        q_rot, k_rot = self._rotate(q_rot.transpose(0, 1)[None], k_rot[None, None], position_embeddings)
        # Back to the inputs' dtypes where the rotation's cos/sin were float32 (dots3_note's indexed layers).
        q_rot, k_rot = q_rot.to(q_nope.dtype), k_rot.to(latent.dtype)
        return q_nope, q_rot[0].transpose(0, 1), latent, k_rot[0, 0], q_resid, gate


# (q_nope, q_rot, latent, k_rot, the query LoRA's normed output or None, the output gate or None)
LatentProjection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor | None]
# complex frequencies (deepseek_v2), (cos, sin), or None (kimi_linear: no rotation)
PositionEmbeddings = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
Rotation = Callable[[torch.Tensor, torch.Tensor, PositionEmbeddings], tuple[torch.Tensor, torch.Tensor]]


ROTATIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")


def _own_rotation(modeling: ModuleType) -> Callable:
    """The one rotation function of ``ROTATIONS`` the modeling file defines (hy_v4's is
    the half rotation in some transformers releases, the interleaved one in others)."""
    defined = [name for name in ROTATIONS if callable(getattr(modeling, name, None))]
    if len(defined) != 1:
        raise UnsupportedAttentionError(f"{modeling.__name__} defines {defined or 'none'} of {list(ROTATIONS)}; "
                                        "its latent attention's rotation is not known")
    return getattr(modeling, defined[0])


def _rotation(modeling: ModuleType, kind: str, config: transformers.PretrainedConfig) -> Rotation:
    """The layer's rotation of (q [1, H, T, dr], k [1, 1, T, dr]) by the call's
    position_embeddings, as its modeling file's own function."""
    if kind == "none":
        return lambda q, k, _: (q, k)
    if kind == "complex":
        rotate_complex = modeling.apply_rotary_emb

        def rotate_by_frequencies(q: torch.Tensor, k: torch.Tensor, freqs: PositionEmbeddings):
            assert isinstance(freqs, torch.Tensor), "deepseek_v2's position embeddings are complex frequencies"
            return rotate_complex(q, k, freqs.to(q.device))
        return rotate_by_frequencies
    if kind == "own":
        rotate = _own_rotation(modeling)
    else:
        interleave = kind == "interleave" or (kind == "config" and bool(getattr(config, "rope_interleave", False)))
        rotate = getattr(modeling, "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb")

    def rotate_by_cos_sin(q: torch.Tensor, k: torch.Tensor, cos_sin: PositionEmbeddings):
        assert isinstance(cos_sin, tuple), "the position embeddings are (cos, sin)"
        return rotate(q, k, *cos_sin)
    return rotate_by_cos_sin
