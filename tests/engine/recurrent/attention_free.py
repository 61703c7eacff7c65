"""Shared checks for attention-free models run as one recurrent kind per layer (RWKV,
xLSTM): the kind's native core against the transformers module under chunked and
decode schedules, and whole tiny models against transformers' greedy tokens through
chunked prefill, n > 1 forks and template rows with and without prefix caching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import hf_greedy, random_prompts
from .mixer_parity import chunked, prefill_then_decode, run_schedule
from .test_hybrid_prefix_caching import _scheduler, template_rows


def assert_native_core_matches(kind, module, config, sequences: list[torch.Tensor], references: list,
                               decode_after: int, tolerance: float = 1e-4) -> None:
    """``kind`` (its native core on) gives each sequence's output and final states of
    ``references`` ([(output, {state name: value})]) under a chunked and a decode schedule."""
    lengths = [len(sequence) for sequence in sequences]
    for schedule in (chunked(lengths, seed=6, max_chunk=7), prefill_then_decode(lengths, decode_after)):
        outputs, states = run_schedule(kind, module, config, sequences, schedule)
        for i, (expected, expected_states) in enumerate(references):
            torch.testing.assert_close(outputs[i], expected, rtol=tolerance, atol=tolerance, msg=f"sequence {i} output")
            for name, value in expected_states.items():
                torch.testing.assert_close(states[i][name], value, rtol=tolerance, atol=tolerance,
                                           msg=f"sequence {i} {name}")


@dataclass
class TinyModelCase:
    """A tiny model's dir and dtype, with transformers' greedy tokens for varied prompts
    (6 tokens each) and for template rows (4 tokens each)."""

    model_dir: str
    dtype: str
    prompts: list[list[int]]
    expected: list[list[int]]
    rows: list[list[int]]
    expected_rows: list[list[int]]


def tiny_model_case(tmp_path_factory, model_type: str, tiny: dict[str, Any], dtype: str) -> TinyModelCase:
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp(model_type), model_type, **tiny))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    prompts = random_prompts(4, (3, 40), 500, seed=3)
    rows = template_rows(seed=5)
    expected = [hf_greedy(hf_model, prompt, 6) for prompt in prompts]
    expected_rows = [hf_greedy(hf_model, row, 4) for row in rows]
    assert len({tuple(tokens) for tokens in expected_rows}) > 3, "the reference's tokens hardly depend on the row"
    return TinyModelCase(model_dir, dtype, prompts, expected, rows, expected_rows)


def assert_chunked_and_forked_requests_match(case: TinyModelCase) -> LLM:
    """Prompts in chunks of 16 tokens, two samples each, give the reference's tokens and
    every state slot back; returns the engine for the caller's own checks."""
    llm = LLM(case.model_dir, dtype=case.dtype, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in case.prompts], params, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outputs] == [[want, want] for want in case.expected]
    slots = _scheduler(llm).state_slots
    assert slots is not None and slots.num_free == slots.num_slots
    return llm


def assert_template_rows_match(case: TinyModelCase, prefix_caching: bool, max_num_batched_tokens: int) -> None:
    """Template rows give the reference's tokens; with prefix caching on, state snapshots
    are kept and prefixes hit."""
    llm = LLM(case.model_dir, dtype=case.dtype, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=max_num_batched_tokens, block_size=16, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate([{"prompt_token_ids": row} for row in case.rows], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == case.expected_rows
    scheduler = _scheduler(llm)
    assert (scheduler.snapshots is not None) == prefix_caching
    assert (scheduler.kv_cache.stats.num_hit_tokens > 0) == prefix_caching
