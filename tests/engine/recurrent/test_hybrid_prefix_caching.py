"""Prefix caching for hybrid models: a prompt that hits a cached prefix continues from
the recurrent state saved at its last block, giving transformers' greedy tokens and
the tokens of the same engine with prefix caching off.

Tiny random models, rows of a few templates (shared instruction prefixes, short
row-specific tails, duplicate rows), a 16-token budget (prefill chunks) and, in one
case, a cache too small for every row at once (preemption).
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.core.scheduler import Scheduler
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.recurrent.state import RecurrentStateSpec, install_recurrent_layers

from ..hf_reference import hf_greedy
from .test_hybrid_parity import ARCHS, FLOAT32

MAX_NEW_TOKENS = 4
MAX_MODEL_LEN = 64
NUM_SLOTS = 4
NUM_SNAPSHOTS = 4  # at most max_num_seqs
BLOCK_SIZE = 16
FAST = {"qwen3_5_text"}
KINDS = ["qwen3_5_text", "qwen3_next", "nemotron_h", "jamba", "lfm2", "granitemoehybrid", "mamba2", "bamba"]


def template_rows(seed: int, vocab_size: int = 500) -> list[list[int]]:
    """Rows of three templates (prefixes of 37, 50 and 21 tokens) interleaved, with
    tails of 1-9 tokens, a third of them duplicates of an earlier row."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (37, 50, 21)]
    rows: list[list[int]] = []
    for _ in range(12):
        if rows and rng.random() < 0.3:
            rows.append(list(rng.choice(rows)))
            continue
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 9))]
        rows.append(rng.choice(prefixes) + tail)
    return rows


@pytest.fixture(scope="module", params=[kind if kind in FAST else pytest.param(kind, marks=pytest.mark.slow)
                                        for kind in KINDS])
def hybrid(request, tmp_path_factory):
    """(model dir, rows, transformers' greedy tokens, the per-slot and per-block bytes, dtype)."""
    arch = request.param
    dtype = "float32" if arch in FLOAT32 else "float64"
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch]))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    rows = template_rows(seed=5)
    expected = [hf_greedy(hf_model, row, MAX_NEW_TOKENS) for row in rows]
    assert len({tuple(tokens) for tokens in expected}) > 3, "the reference's tokens hardly depend on the row"
    per_slot = RecurrentStateSpec.from_layers(install_recurrent_layers(hf_model)).bytes_per_slot()
    per_block = KVCacheSpec.from_hf_config(hf_model.config, getattr(torch, dtype)).bytes_per_block(BLOCK_SIZE)
    return model_dir, rows, expected, per_slot, per_block, dtype


def _engine(hybrid, num_blocks: int, **options) -> LLM:
    """An engine whose budget holds ``num_blocks`` KV blocks, NUM_SLOTS request states and
    as many snapshots as fit in a quarter of the budget (at most NUM_SNAPSHOTS)."""
    model_dir, _, _, per_slot, per_block, dtype = hybrid
    base = num_blocks * per_block + NUM_SLOTS * per_slot
    num_snapshots = min(NUM_SNAPSHOTS, base // (3 * per_slot))
    llm = LLM(model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SLOTS,
              max_num_batched_tokens=16, block_size=BLOCK_SIZE,
              kv_cache_memory_bytes=base + num_snapshots * per_slot, **options)
    scheduler = _scheduler(llm)
    if scheduler.snapshots is not None:
        assert scheduler.snapshots.num_snapshots == num_snapshots > 0
        # A model without attention layers keeps no KV: its blocks cost nothing.
        assert scheduler.config.num_blocks == num_blocks or not per_block
    return llm


def _scheduler(llm: LLM) -> Scheduler:
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine.scheduler


def _generate(llm: LLM, rows: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize("num_blocks", [16, 5], ids=["roomy", "preempting"])
def test_template_rows_hit_saved_states_and_match_transformers(hybrid, num_blocks):
    _, rows, expected, *_ = hybrid
    # Arrival-order admission runs rows of different templates together: the small cache preempts.
    llm = _engine(hybrid, num_blocks, prefix_aware_admission=num_blocks > 5)
    scheduler = _scheduler(llm)
    assert scheduler.snapshots is not None and scheduler.config.enable_prefix_caching
    assert _generate(llm, rows) == expected
    assert scheduler.kv_cache.stats.num_hit_tokens > 0
    assert scheduler.state_slots is not None and scheduler.state_slots.num_free == NUM_SLOTS
    if num_blocks == 5 and hybrid[4]:
        assert scheduler.num_preemptions > 0


def test_prefix_caching_off_gives_the_same_tokens(hybrid):
    _, rows, expected, *_ = hybrid
    llm = _engine(hybrid, 16, enable_prefix_caching=False)
    assert _scheduler(llm).snapshots is None
    assert _generate(llm, rows) == expected
