"""Turning a user prompt into token ids, shared by the generation and pooling engines."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

PromptType = str | dict[str, Any]


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                    prompt: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a str, {"prompt": str} or
    {"prompt_token_ids": [...]}; raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
    else:
        raise TypeError(
            f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {prompt!r:.200}"
        )
    if not text:
        raise ValueError("the prompt is empty: an empty string has no tokens")
    return text, tokenizer(text).input_ids


def check_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {token_ids!r:.200}")
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is outside the model's vocabulary [0, {vocab_size})")
    return list(token_ids)
