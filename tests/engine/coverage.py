"""The model-coverage sweep: every decoder-only model type in the installed
transformers' causal-LM mapping, built tiny and random, run through shardline's
``LLM`` and compared token for token with transformers' own greedy generate.

Each type ends in one class:
- ``parity``: shardline's greedy tokens equal transformers' on every prompt;
- ``refused``: shardline refused the model at load with one of its own errors (the
  reason is the error's message);
- ``failure``: wrong tokens, a crash, or a tiny model the sweep could not build or
  whose reference does not depend on the context (the detail names the stage);
- ``skipped``: not a decoder-only text LM (an encoder, the decoder half of an
  encoder-decoder, an audio model), with the reason.

The reference runs in float64 where the model's code takes it, else in float32 (some
MoE code refuses float64), and shardline in the same dtype. Weights are drawn with
std 0.2 (engine/model/tiny.py) and the sweep checks that replacing a prompt's context
changes the reference's tokens, so a dropped state or an ignored mask cannot pass.

Run it directly for a report: ``python -m tests.engine.coverage [TYPE ...]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardline import LLM, SamplingParams
from shardline.engine.errors import ModelLoadError
from shardline.engine.model.tiny import build_tiny_model, build_tokenizer, tiny_config

MAX_NEW_TOKENS = 6
PROMPT_LENGTHS = (3, 13, 30)
VOCAB_SIZE = 512
MAX_PARAMETERS = 20_000_000  # a tiny model is under a million or so; more means a size the overrides missed
OUTCOMES = ("parity", "refused", "failure", "skipped")

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
       for name, text in (("gemma3", "gemma3_text"), ("gemma3n", "gemma3n_text"))},
    **{name: "an image-text model whose vision tower the sweep does not shrink (no text-only type)"
       for name in ("got_ocr2", "git", "phi4_multimodal")},
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
                           linear_num_value_heads=4, hc_lowrank=16, indexer_n_heads=2, indexer_kv_heads=1,
                           indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    # Its sliding layers' own attention sizes (the per-layer config it derives from swa_* fields).
    "dots3_note_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=24,
                            swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
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
    **{name: dict(unpadded_vocab_size=VOCAB_SIZE) for name in ("inkling2_text", "inkling2_loop_text")},
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
}

# What a composite type's text part needs beyond its text type's tiny config.
TEXT_OVERRIDES: dict[str, dict] = {
    # transformers' own defaults fail its validation: the assistant has no per-layer inputs.
    "gemma4_assistant": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
}

# Types whose config derives its layer_types from fields of its own (set in OVERRIDES).
DERIVED_LAYER_TYPES = {"recurrent_gemma", "jamba", "zamba", "zamba2"}

# Types run by default in the test suite: one per attention shape the sweep meets.
REPRESENTATIVE = ("llama", "gpt2", "gemma3_text", "qwen3_moe", "gpt_oss", "qwen3_next", "falcon", "bloom", "gpt_neo",
                  "gpt_bigcode", "jetmoe", "deepseek_v2", "diffllama")


@dataclass(frozen=True)
class CoverageResult:
    """One model type's outcome; ``detail`` is the reason or the first difference."""

    model_type: str
    outcome: str
    detail: str = ""
    dtype: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        dtype = f" [{self.dtype}]" if self.dtype else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.model_type:<28} {self.outcome:<8}{dtype}{detail}"


def decoder_model_types() -> list[str]:
    """Every model type in the installed transformers' causal-LM mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_overrides(model_type: str) -> dict:
    """Config overrides for a tiny ``model_type``: SHRINK where its default config has
    the attribute, two layers of each distinct kind in its ``layer_types``, then OVERRIDES."""
    text_extra = TEXT_OVERRIDES.get(model_type, {})
    defaults = transformers.AutoConfig.for_model(model_type, **({"text_config": text_extra} if text_extra else {}))
    text_defaults = defaults.get_text_config()
    if text_defaults is not defaults and text_defaults.model_type != model_type:
        # A composite config (image-text, or a model over a text config): the tiny sizes
        # go to its text part, as that text type's own tiny config.
        text_overrides = {**tiny_overrides(text_defaults.model_type), **text_extra}
        text_config = tiny_config(text_defaults.model_type, VOCAB_SIZE, **text_overrides)
        return {"text_config": text_config.to_dict(), **OVERRIDES.get(model_type, {})}
    overrides = {name: value for name, value in SHRINK.items()
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


def write_tiny_config(model_type: str, model_dir: Path) -> Path:
    """The tiny ``model_type`` the sweep builds, its config and tokenizer only (no
    weights): what the engine's verdict (engine/model/support.py) and pre-flight read."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_dir, vocab_size=VOCAB_SIZE)
    tiny_config(model_type, len(tokenizer), **tiny_overrides(model_type)).save_pretrained(str(model_dir))
    return model_dir


def _parameter_count(model_type: str, overrides: dict) -> int:
    """Parameters of the tiny model, counted without allocating them."""
    config = tiny_config(model_type, VOCAB_SIZE, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def _has_value(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether the config sets ``name`` (per-layer attributes refuse a global read: they are set)."""
    try:
        return getattr(config, name, None) is not None
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return True


def _is_property(config_class: type, name: str) -> bool:
    """Whether ``name`` is computed from other fields (and so cannot be set)."""
    return isinstance(getattr(config_class, name, None), property)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS]


@torch.inference_mode()
def _reference(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time, EOS included when hit."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                   do_sample=False, pad_token_id=2)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _load_reference(model_dir: str) -> tuple[transformers.PreTrainedModel, list[list[int]], str]:
    """The reference model and its tokens, in float64 where its code runs it."""
    error: Exception | None = None
    for dtype in (torch.float64, torch.float32):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation="eager").eval()
            return model, _reference(model, _prompts()), str(dtype).removeprefix("torch.")
        except Exception as exc:  # noqa: BLE001 - some MoE code refuses float64
            error = exc
    raise error


def _context_matters(model: transformers.PreTrainedModel, expected: list[list[int]]) -> bool:
    """Whether replacing a prompt's context (all but its last token) changes the
    reference's tokens, for at least one of the longer prompts."""
    others = _prompts(seed=1)
    for prompt, other, want in list(zip(_prompts(), others, expected))[1:]:
        if _reference(model, [other[:-1] + prompt[-1:]])[0] != want:
            return True
    return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check_type(model_type: str, workdir: Path) -> CoverageResult:
    """Build ``model_type`` tiny, run it both ways and classify the outcome."""
    if model_type in SKIPPED:
        return CoverageResult(model_type, "skipped", SKIPPED[model_type])
    model_dir = workdir / model_type
    try:
        overrides = tiny_overrides(model_type)
        num_parameters = _parameter_count(model_type, overrides)
        if num_parameters > MAX_PARAMETERS:
            return CoverageResult(model_type, "failure", f"tiny build: {num_parameters} parameters with the sweep's "
                                  f"overrides, over {MAX_PARAMETERS}; it needs its own in OVERRIDES")
        build_tiny_model(model_dir, model_type, vocab_size=VOCAB_SIZE, **overrides)
    except Exception as exc:  # noqa: BLE001 - the sweep reports every way a type fails
        return CoverageResult(model_type, "failure", f"tiny build: {_one_line(exc)}")
    try:
        reference_model, expected, dtype = _load_reference(str(model_dir))
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"transformers reference: {_one_line(exc)}")
    # A refusal stands whatever the weights; parity means something only where the
    # reference's tokens depend on the context.
    try:
        llm = LLM(str(model_dir), dtype=dtype, max_num_batched_tokens=16, max_num_seqs=4)
    except ModelLoadError as exc:
        return CoverageResult(model_type, "refused", " ".join(str(exc).split()), dtype)
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"load crashed: {_one_line(exc)}", dtype)
    if not _context_matters(reference_model, expected):
        llm.close()
        return CoverageResult(model_type, "failure", "reference tokens do not depend on the context", dtype)
    del reference_model
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        ours = [list(output.outputs[0].token_ids) for output in outputs]
    except Exception as exc:  # noqa: BLE001
        return CoverageResult(model_type, "failure", f"generate crashed: {_one_line(exc)}", dtype)
    finally:
        llm.close()
    for index, (got, want) in enumerate(zip(ours, expected)):
        if got != want:
            return CoverageResult(model_type, "failure",
                                  f"wrong tokens on prompt {index}: {got} vs transformers' {want}", dtype)
    return CoverageResult(model_type, "parity", "", dtype)


def _check_type_alone(model_type: str) -> CoverageResult:
    """``check_type`` in a fresh process: what one type does is then free of what the
    types before it left in this one (kernels a model's code picked, loaded modules)."""
    completed = subprocess.run([sys.executable, "-m", "tests.engine.coverage", "--json", model_type],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = " ".join(completed.stderr.split()[-40:])
        return CoverageResult(model_type, "failure", f"sweep process exited {completed.returncode}: {tail[:300]}")
    return CoverageResult(**json.loads(lines[-1]))


def sweep(model_types: list[str], workdir: Path, echo=print) -> list[CoverageResult]:
    """``check_type`` over ``model_types``, echoing one line per type and the counts. A
    failure is checked again in a fresh process, and that result is the type's."""
    results = []
    for model_type in model_types:
        start = time.perf_counter()
        try:
            result = check_type(model_type, workdir)
        except Exception as exc:  # noqa: BLE001
            result = CoverageResult(model_type, "failure", f"sweep crashed: {_one_line(exc)}")
        if result.outcome == "failure":
            result = _check_type_alone(model_type)
        result = CoverageResult(result.model_type, result.outcome, result.detail, result.dtype,
                                time.perf_counter() - start)
        results.append(result)
        echo(result.line())
    counts = Counter(result.outcome for result in results)
    echo("counts: " + ", ".join(f"{outcome} {counts[outcome]}" for outcome in OUTCOMES))
    return results


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers while sweeping."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("shardline").setLevel(logging.ERROR)


def main(argv: list[str]) -> int:
    """``[--part I/N] [TYPE ...]``: the given types (default all), or the I-th of N
    interleaved parts of them, so several processes can share a sweep."""
    if argv[:1] == ["--json"]:  # one type, its result as JSON (_check_type_alone)
        quiet_transformers()
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory(prefix="shardline-coverage-") as workdir:
            print(json.dumps(dataclasses.asdict(check_type(argv[1], Path(workdir)))), flush=True)
        return 0
    part = None
    if argv[:1] == ["--part"]:
        index, count = map(int, argv[1].split("/"))
        part, argv = (index, count), argv[2:]
    types = argv or decoder_model_types()
    if part is not None:
        types = types[part[0]::part[1]]
    quiet_transformers()
    torch.set_num_threads(1)  # tiny models: threads only contend
    with tempfile.TemporaryDirectory(prefix="shardline-coverage-") as workdir:
        results = sweep(types, Path(workdir), echo=lambda line: print(line, flush=True))
    return 1 if any(result.outcome == "failure" for result in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
