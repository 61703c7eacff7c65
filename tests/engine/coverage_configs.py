"""The model-coverage sweep's tiny configs (tests/engine/coverage.py): which types it
skips and why, the sizes it shrinks, each type's overrides, and its second config per
type (other head counts, layer count, KV sharing, nested fields as real checkpoints
set them), so a cache plan that reads the wrong field shows in one of the two."""

from __future__ import annotations

import transformers

from shardline.engine.model.tiny import tiny_config

VOCAB_SIZE = 512

_ENCODER = "an encoder (bidirectional) model; its causal-LM head is for fine-tuning, not decoding"
_SEQ2SEQ = "the decoder half of an encoder-decoder model; it attends an encoder's output"
_AUDIO = "an audio model generating several codebooks per step"

# Model types that are not decoder-only text LMs, with the reason.
SKIPPED = {
    **{name: _ENCODER for name in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
        "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
        "xlm-roberta", "xlm-roberta-xl", "xmod", "xlm")},
    **{name: _SEQ2SEQ for name in (
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
        "plbart", "prophetnet", "trocr", "whisper")},
    **{name: _AUDIO for name in ("musicgen", "musicgen_melody", "moshi")},
    **{name: f"an image-text model whose vision tower the sweep does not shrink; its text decoder is swept as {text}"
       for name, text in (("gemma3", "gemma3_text"), ("gemma3n", "gemma3n_text"), ("qwen3_5", "qwen3_5_text"),
                          ("qwen3_5_moe", "qwen3_5_moe_text"))},
    **{name: "an image-text model whose vision tower the sweep does not shrink (no text-only type)"
       for name in ("got_ocr2", "phi4_multimodal")},
    **{name: "a speculative-decoding assistant that attends its target model's KV cache, not a standalone LM"
       for name in ("gemma4_assistant", "gemma4_unified_assistant")},
    "xlnet": "a permutation language model with two attention streams, not a causal decoder",
    "reformer": "LSH and local chunked attention over axial positions; not a causal decoder of fixed shape",
    "moss_transcribe_diarize": "a speech transcription model (audio input)",
}

# Shrunk sizes, applied where the type's default config has the attribute: small
# experts, small head sizes, small windows and chunks so short prompts cross them.
SHRINK = {
    "head_dim": 16, "global_head_dim": 32, "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "top_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "sliding_window": 8, "attention_chunk_size": 8, "window_size": 8,
    "n_group": 1, "topk_group": 1, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
}

_BLT_PART = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                 intermediate_size=128, vocab_size=VOCAB_SIZE)

# What a type needs beyond SHRINK and engine/model/tiny.py's common sizes.
OVERRIDES: dict[str, dict] = {
    "gpt_oss": dict(head_dim=16, sliding_window=8),
    "hunyuan_v1_moe": dict(head_dim=16),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Its query-sparse attention's indexer (QSA) and its gated delta-net layers, small.
    "qwen4_exp_text": dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, hc_lowrank=16, indexer_n_heads=8, indexer_kv_heads=1,
                           indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    # Its sliding layers' own attention sizes (the per-layer config it derives from swa_* fields),
    # each unlike the indexed layers' (heads, latent and rotary widths), and 8 indexer heads.
    "dots3_note_text": dict(swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16,
                            swa_kv_lora_rank=24, swa_head_dim=16, swa_qk_nope_head_dim=12, swa_v_head_dim=8,
                            index_n_heads=8),
    # transformers checks that the (unbuilt) vision and audio adapters output the text width.
    "dots3_note": dict(vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64)),
    # Its byte patcher, local encoder and decoder, global transformer and hash embeddings, small.
    "blt": dict(encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3, 4], local_attention_window_len=8,
                patcher_config=dict(_BLT_PART, max_position_embeddings=1024),
                encoder_config=dict(_BLT_PART, hidden_size_global=128, num_hidden_layers=1),
                decoder_config=dict(_BLT_PART, hidden_size_global=128),
                global_config=dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                   intermediate_size=256)),
    # An input layer, two recurrent layers looped twice (each loop with its own cache) and an output layer.
    "dory": dict(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "hrm_text": dict(H_cycles=2, L_cycles=2),
    "git": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=32, patch_size=16)),
    # Every block rescaled (its output weights halved per rescale_every blocks, as checkpoints set it).
    "rwkv": dict(rescale_every=1),
    # transformers rounds the mLSTM's key width up to a multiple of 64 for its state but not its layers.
    "xlstm": dict(num_heads=4, hidden_size=128, embedding_dim=128),
    # Two hybrid layers calling the shared attention block, each with its own cache.
    "zamba": dict(mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, num_hidden_layers=4,
                  layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "zamba2": dict(n_mamba_heads=8, mamba_headdim=16, mamba_expand=2, mamba_d_state=8, mamba_ngroups=2, chunk_size=4,
                   mamba_d_conv=4, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "hunyuan_v1_dense": dict(head_dim=16),
    # As inkling_text's, attention over depth in blocks of 2 layers; the loop model loops its layer 1 twice.
    "inkling2_text": dict(unpadded_vocab_size=VOCAB_SIZE, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                          swa_head_dim=8, d_rel=4, rel_extent=12, log_scaling_n_floor=4,
                          n_layers_per_attn_res_block=2),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB_SIZE, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                               swa_head_dim=8, d_rel=4, rel_extent=12, log_scaling_n_floor=4,
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2, loop_gate_rank=8),
    # Sliding layers of their own (small) sizes, a position bias reaching past their window,
    # and the full layers' logarithmic query scaling from position 4 on.
    "inkling_text": dict(swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8, d_rel=4,
                         rel_extent=12, log_scaling_n_floor=4),
    "ministral": dict(head_dim=16),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "zaya": dict(num_experts_per_tok=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    **{name: dict(global_head_dim=32, vocab_size_per_layer_input=VOCAB_SIZE) for name in (
        "gemma4", "gemma4_text", "gemma4_assistant", "gemma4_unified", "gemma4_unified_text",
        "gemma4_unified_assistant")},
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=1024,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "llama4_text": dict(intermediate_size_mlp=128, no_rope_layers=[1, 0]),
    "llama4": dict(intermediate_size_mlp=128, no_rope_layers=[1, 0]),
    # Sparse attention's indexer with 8 heads: a key's score sums several positive parts, so two
    # keys tie at the top-k boundary only by accident; glm_moe_dsa's layers alternate running the
    # indexer and reusing its selection (full, shared, full, ...).
    **{name: dict(index_n_heads=8) for name in ("deepseek_v32", "axk2", "hy_v4")},
    # Two indexed layers, the second reading the first's keys and values, beside sliding
    # ones; index heads within key head 0's query heads, pools of 4 compressed blocks.
    "kolibri1_1": dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention"] * 2,
                       index_num_heads=2, index_pool_size=16, index_compression=4, index_num_local_tokens=4,
                       index_num_sink_tokens=2, mlp_only_layers=[0], mlp_only_intermediate_size=64),
    "glm_moe_dsa": dict(index_n_heads=8, index_topk_freq=2, index_skip_topk_offset=1),
    # Its three attention layer types, with blocks of 4 (CSA) and 8 (HCA) tokens so that short prompts
    # pool several, and 8 indexer heads (no ties at the top-k boundary, as above).
    "deepseek_v4": dict(index_n_heads=8, num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"],
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
}

# What a composite type's text part needs beyond its text type's tiny config.
TEXT_OVERRIDES: dict[str, dict] = {
    # transformers' own defaults fail its validation: the assistant has no per-layer inputs.
    "gemma4_assistant": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
}

# Types whose config derives its layer_types from fields of its own (set in OVERRIDES).
DERIVED_LAYER_TYPES = {"recurrent_gemma", "jamba", "zamba", "zamba2"}


def tiny_overrides(model_type: str, config: int = 1) -> dict:
    """Config overrides for a tiny ``model_type``: SHRINK where its default config has
    the attribute, one layer of each distinct kind in its ``layer_types``, then
    OVERRIDES; for ``config`` 2, ``second_config``'s changes on top."""
    if config == 2:
        return second_config(model_type)
    text_extra = TEXT_OVERRIDES.get(model_type, {})
    defaults = transformers.AutoConfig.for_model(model_type, **({"text_config": text_extra} if text_extra else {}))
    text_defaults = defaults.get_text_config()
    if text_defaults is not defaults and text_defaults.model_type != model_type:
        # A composite config (image-text, or a model over a text config): the tiny sizes
        # go to its text part, as that text type's own tiny config.
        text_overrides = {**tiny_overrides(text_defaults.model_type), **text_extra}
        text_config = tiny_config(text_defaults.model_type, VOCAB_SIZE, **text_overrides)
        return {"text_config": text_config.to_dict(), **OVERRIDES.get(model_type, {})}
    overrides: dict = {name: value for name, value in SHRINK.items()
                 if _has_value(text_defaults, name) and not _is_property(type(text_defaults), name)}
    if "qk_rope_head_dim" in overrides and "head_dim" in overrides:  # latent attention: head_dim is the rotary part
        overrides["head_dim"] = overrides["qk_rope_head_dim"]
    if "kv_lora_rank" in overrides:  # latent attention: one key-value head per query head
        overrides["num_key_value_heads"] = 4
    if _has_value(text_defaults, "rotary_dim"):  # a rotary part no wider than the shrunk heads
        overrides["rotary_dim"] = 8
    layer_kinds = list(dict.fromkeys(getattr(text_defaults, "layer_types", None) or []))
    if len(layer_kinds) > 1 and model_type not in DERIVED_LAYER_TYPES:
        overrides["layer_types"] = layer_kinds
        overrides["num_hidden_layers"] = len(layer_kinds)
    overrides.update(OVERRIDES.get(model_type, {}))
    if {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"} & overrides.keys():
        overrides.setdefault("num_experts_per_tok", 2)  # some configs leave the router's top-k unset
    return overrides


# The second config's sizes: more query heads over key-value heads that are neither one
# nor one per query head, and another layer count.
SECOND_HEADS, SECOND_KV_HEADS, SECOND_LAYERS = 8, 2, 3
# What a type's second config sets beyond those, the way its real checkpoints set it.
SECOND_OVERRIDES: dict[str, dict] = {
    # Its attention reads the nested attn_config.kv_n_heads; the top-level mirror is stale.
    "dbrx": dict(n_heads=8, n_layers=3, num_key_value_heads=1,
                 attn_config=dict(kv_n_heads=4, rope_theta=10000.0, clip_qkv=8.0)),
    # Its attention reads multi_query (one key-value head); num_key_value_heads is a stale mirror.
    "gpt_bigcode": dict(multi_query=True, num_key_value_heads=2),
    # Another feed-forward width, a rescale every two blocks (transformers' generate keeps
    # the WKV state hidden_size wide, so the WKV width stays the hidden size).
    "rwkv": dict(intermediate_size=96, rescale_every=2),
    # Its output projection takes hidden_size inputs: heads times head_dim must match it.
    "helium": dict(head_dim=8),
    # Another mLSTM head count, biases, and chunks of 4 so prompts run chunkwise too (fused
    # projections are tested on the layer: transformers' weight init fails on them).
    "xlstm": dict(num_heads=2, use_bias=True, chunk_size=4),
}
# Types whose layer layout the first config fixes (OVERRIDES): the second keeps it.
_FIXED_LAYOUT_KEYS = {"num_hidden_layers", "layer_types", "layers_block_type", "block_types", "attn_layer_indices",
                      "attn_layer_period", "no_rope_layers", "attention_types", "n_layers"}


def second_config(model_type: str) -> dict:
    """A type's second tiny config: the first's, with SECOND_HEADS query heads over
    SECOND_KV_HEADS key-value heads where the type has the field (one per query head
    under latent attention), three
    layers (the first's layer kinds cycled), KV sharing of the last two of four layers
    where the type has it, then SECOND_OVERRIDES. A composite type takes its text
    type's second config for its text part."""
    base = tiny_overrides(model_type)
    defaults = transformers.AutoConfig.for_model(model_type)
    text_defaults = defaults.get_text_config()
    if "text_config" in base and text_defaults is not defaults and text_defaults.model_type != model_type:
        text_type = text_defaults.model_type
        text_overrides = {**second_config(text_type), **TEXT_OVERRIDES.get(model_type, {})}
        return {**base, "text_config": tiny_config(text_type, VOCAB_SIZE, **text_overrides).to_dict(),
                **SECOND_OVERRIDES.get(model_type, {})}
    changes: dict = {}
    if _has_value(text_defaults, "num_attention_heads"):
        changes["num_attention_heads"] = SECOND_HEADS
    if _has_value(text_defaults, "num_key_value_heads"):  # only where the type has the field
        changes["num_key_value_heads"] = SECOND_HEADS if "kv_lora_rank" in base else SECOND_KV_HEADS
    if not (_FIXED_LAYOUT_KEYS & OVERRIDES.get(model_type, {}).keys()) and model_type not in DERIVED_LAYER_TYPES:
        layers = 4 if _has_value(text_defaults, "num_kv_shared_layers") else SECOND_LAYERS
        changes["num_hidden_layers"] = layers
        kinds = base.get("layer_types") or list(dict.fromkeys(getattr(text_defaults, "layer_types", None) or []))
        # Given whole: some tiny configs take the layer count after their layer_types are
        # derived; a config that computes its layer_types (Mamba's; Falcon-H1's, under
        # another name) takes the count alone.
        config_class = type(text_defaults)
        if kinds and not _is_property(config_class, config_class.attribute_map.get("layer_types", "layer_types")):
            changes["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
        if layers == 4:
            changes["num_kv_shared_layers"] = 2
    return {**base, **changes, **SECOND_OVERRIDES.get(model_type, {})}


def _has_value(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether the config sets ``name`` (per-layer attributes refuse a global read: they are set)."""
    try:
        return getattr(config, name, None) is not None
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return True


def _is_property(config_class: type, name: str) -> bool:
    """Whether ``name`` is computed from other fields (and so cannot be set)."""
    return isinstance(getattr(config_class, name, None), property)
