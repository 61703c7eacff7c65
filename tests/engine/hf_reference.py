"""Hugging Face reference generations for equality tests (float64, greedy)."""

from __future__ import annotations

import random

import torch
import transformers


def load_hf_model(model_dir: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' own generate, EOS included when hit."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=2,
    )
    return out[0, len(prompt_ids):].tolist()


def random_prompts(num: int, lengths: tuple[int, int], vocab_size: int, seed: int,
                   shared_prefix: int = 0) -> list[list[int]]:
    """Random token-id prompts with lengths drawn in ``lengths``; optionally all
    starting with the same ``shared_prefix`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    prompts = []
    for _ in range(num):
        length = rng.randint(*lengths)
        prompts.append(prefix + [rng.randrange(3, vocab_size) for _ in range(length)])
    return prompts
