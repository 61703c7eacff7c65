"""Tiny random-weight models and a byte-level tokenizer, built offline.

The demo, the tests and the benchmarks need Hugging Face models without a hub
download: these builders write a real transformers checkpoint (config, safetensors
weights, generation_config, tokenizer with a chat template) into a local directory,
which then loads through the same code path as any hub model.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

_CORPUS = """
The quick brown fox jumps over the lazy dog. Batch inference runs a language model
over a whole dataset: prompts are read from shards, generated in large batches and
written back in order. A paged key value cache stores attention state in fixed size
blocks so that many sequences share memory without fragmentation. Continuous batching
adds new requests as soon as old ones finish. Résumé, naïve, café, straße, 東京, 北京,
こんにちは, 안녕하세요, Привет мир, مرحبا, emoji 🙂🚀✨ and numbers 0123456789.
def main(): return {"id": 1, "prompt": "hello", "max_tokens": 16}
Question: what is two plus two? Answer: four. Summarize the following text.
Translate to French: good morning -> bonjour. Write a short poem about the sea.
"""

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(path: str | Path, vocab_size: int = 512,
                    extra_special_tokens: Sequence[str] = ()) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a small built-in corpus and save it to
    ``path``; ``extra_special_tokens`` are appended after the trained vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:] + list(extra_special_tokens),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> transformers.PretrainedConfig:
    """The config ``build_tiny_model`` gives ``arch`` (small sizes, then ``overrides``)."""
    # Typed as a plain mapping: each config class below takes these as keyword fields.
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
    elif arch == "mistral":
        config = transformers.MistralConfig(sliding_window=48, **common)
    elif arch == "gemma2":
        config = transformers.Gemma2Config(
            head_dim=16, sliding_window=48, query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common,
        )
    elif arch == "phi3":
        config = transformers.Phi3Config(sliding_window=64, **common)
    elif arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
            bos_token_id=0, eos_token_id=1, pad_token_id=2,
        )
    else:
        # Any other transformers model type, from the same small sizes its config has
        # (a config without key-value heads keeps one per query head); ``overrides``
        # supply what its config needs beyond them.
        try:
            defaults = _default_config(arch, overrides)
            sizes = {name: value for name, value in common.items()
                     if name != "num_key_value_heads" or _declares(defaults, name)}
            return transformers.AutoConfig.for_model(arch, **{**sizes, **overrides})
        except ValueError as error:
            raise ValueError(f"unknown tiny architecture {arch!r}: {error}") from None
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _default_config(arch: str, overrides: dict[str, Any]) -> transformers.PretrainedConfig:
    """``arch``'s default config, to read its fields; with ``overrides`` where the
    defaults alone fail transformers' validation (gemma4_assistant)."""
    try:
        return transformers.AutoConfig.for_model(arch)
    except Exception:  # noqa: BLE001 - transformers' validation errors are not all ValueErrors
        return transformers.AutoConfig.for_model(arch, **overrides)


def _declares(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether ``config``'s class takes ``name`` as a field (not one it derives itself,
    as gpt_bigcode derives its key-value heads from multi_query)."""
    config_class = type(config)
    if dataclasses.is_dataclass(config_class):
        return name in {field.name for field in dataclasses.fields(config_class)}
    return name in inspect.signature(config_class.__init__).parameters


TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2")


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    extra_special_tokens: Sequence[str] = (),
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` causal LM plus tokenizer into ``path``; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=vocab_size, extra_special_tokens=extra_special_tokens)
    config = tiny_config(arch, len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Larger-than-default weights make the random model's next-token choices
        # clear-cut and varied, so greedy comparisons test something.
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2
    )
    model.save_pretrained(str(path), safe_serialization=True)
    if type(model.config) is not type(config):
        # A causal LM over the text part of a composite config (mllama, emu3) saves that
        # part, which the auto classes do not map back; the checkpoint keeps the whole.
        config.save_pretrained(str(path))
    return path
