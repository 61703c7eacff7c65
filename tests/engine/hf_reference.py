"""Hugging Face reference generations for equality tests (float64, greedy)."""

from __future__ import annotations

import random

import torch
import transformers

from shardline import LLM, SamplingParams


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


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for token-id prompts, in order."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def assert_exact_through_preemption_and_hits(llm: LLM, prompts: list[list[int]], expected: list[list[int]],
                                             rerun: int, max_tokens: int = 8) -> None:
    """``llm``'s greedy tokens equal ``expected`` in a run that preempts at least one
    request (the caller sizes the cache for it); then the first ``rerun`` prompts again
    give theirs with prefix-cache hits (what the layers cache comes back with the blocks)."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert sum(output.metrics.num_preemptions for output in outputs if output.metrics is not None) > 0
    stats = llm.llm_engine.scheduler.kv_cache.stats
    hits_before = stats.num_hit_tokens
    assert engine_greedy(llm, prompts[:rerun], max_tokens) == expected[:rerun]
    assert stats.num_hit_tokens > hits_before
