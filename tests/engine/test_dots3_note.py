"""dots3_note: indexed latent layers (a sparse attention's top-k selection) beside
sliding-window latent layers of their own sizes, each layer's latents cached at its own
width, the windowed layers in a block group of their own that frees the blocks no later
query reads (engine/attention/latent_window.py, engine/model/adapters/latent.py).

The tiny model's sliding layer differs from its indexed layers in every latent size
(heads, query LoRA, latent and rotary widths, value width) and attends a window of 8
keys; prompts run past the window and past index_topk. Ties in the indexer's scores
are ruled out as in tests/engine/test_sparse_indexer.py (8 indexer heads, the gap at
the top-k boundary asserted on transformers' own rows).
"""

from __future__ import annotations

import torch
import transformers

from shardline import LLM
from shardline.engine.attention.latent_window import visible_keys, window_start
from shardline.engine.attention.mla import latent_paged_attention
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model

from .coverage import tiny_overrides
from .hf_reference import assert_exact_through_preemption_and_hits, random_prompts
from .test_sparse_indexer import _untied_greedy

WINDOW, INDEX_TOPK = 8, 6
LAYERS = ["indexed_attention", "sliding_attention", "indexed_attention"]
SIZES = dict(num_hidden_layers=3, layer_types=LAYERS, sliding_window=WINDOW, index_n_heads=8, index_head_dim=16,
             index_topk=INDEX_TOPK, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16,
             swa_kv_lora_rank=24, swa_head_dim=16, swa_qk_nope_head_dim=12, swa_v_head_dim=8)


def _windowed_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Multi-head attention of the last n queries over one request's whole context in
    float64, keys and values up-projected, each query seeing the ``window`` keys up to its own."""
    num_queries, seq_len = q_nope.shape[0], latent.shape[0]
    key = torch.einsum("sr,hdr->shd", latent, w_uk)
    value = torch.einsum("sr,hvr->shv", latent, w_uv)
    scores = (torch.einsum("nhd,shd->hns", q_nope, key) + torch.einsum("nhd,sd->hns", q_rope, rope_key)) * scale
    query_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    visible = (key_pos <= query_pos) & (query_pos - key_pos < window)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hns,shv->nhv", weights, value)


def test_windowed_latent_attention_reads_only_the_window():
    """A prompt chunk and a decode step past the window, a short request within it; the
    blocks below each request's window point at a block of NaN (a windowed group's null
    block), which a stray read would spread."""
    torch.manual_seed(0)
    heads, nope, rope, value_dim, rank, block_size, window = 3, 4, 2, 5, 6, 4, 5
    seq_lens, query_lens = [14, 3, 11], [4, 3, 1]
    latent_cache = torch.full((12, block_size, rank + rope), float("nan"), dtype=torch.float64)
    block_tables = torch.tensor([[0, 5, 9, 4], [7, 0, 0, 0], [0, 11, 3, 0]], dtype=torch.int32)  # block 0: null
    contexts = [torch.randn(length, rank + rope, dtype=torch.float64) for length in seq_lens]
    for request, (length, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(window_start(length, query_len, window), length):
            block = int(block_tables[request, pos // block_size])
            assert block != 0, "the test's tables drop only blocks below the window"
            latent_cache[block, pos % block_size] = contexts[request][pos]
    w_uk, w_uv = torch.randn(heads, nope, rank, dtype=torch.float64), torch.randn(heads, value_dim, rank,
                                                                                   dtype=torch.float64)
    total = sum(query_lens)
    q_nope, q_rope = torch.randn(total, heads, nope, dtype=torch.float64), torch.randn(total, heads, rope,
                                                                                       dtype=torch.float64)
    starts = torch.tensor([0, 4, 7, 8])
    out = latent_paged_attention(q_nope, q_rope, latent_cache, starts, torch.tensor(seq_lens), block_tables, w_uk,
                                 w_uv, 0.7, sliding_window=window)
    for request, context in enumerate(contexts):
        rows = slice(int(starts[request]), int(starts[request + 1]))
        expected = _windowed_reference(q_nope[rows], q_rope[rows], context[:, :rank], context[:, rank:], w_uk, w_uv,
                                       0.7, window)
        torch.testing.assert_close(out[rows], expected)
        if seq_lens[request] > window:  # the window changes the result: it is applied, not just allowed
            unwindowed = _windowed_reference(q_nope[rows], q_rope[rows], context[:, :rank], context[:, rank:], w_uk,
                                             w_uv, 0.7, seq_lens[request])
            assert not torch.allclose(out[rows], unwindowed)


def test_visible_keys_combine_the_window_and_a_selection():
    selected = torch.tensor([[True, False, True, True, False, False], [False, True, False, True, True, True]])
    first = window_start(6, 2, 3)
    assert first == 2
    visible = visible_keys(2, 6, first, 3, selected, torch.device("cpu"))
    assert visible is not None
    assert visible.tolist() == [[True, True, False, False], [False, True, True, True]]
    assert visible_keys(2, 3, 0, 3, None, torch.device("cpu")) is None  # within the window: causal


def _tiny_dots3(tmp_path) -> tuple[str, transformers.PreTrainedModel]:
    model_dir = build_tiny_model(tmp_path, "dots3_note_text", **{**tiny_overrides("dots3_note_text"), **SIZES})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return str(model_dir), reference


def test_dots3_note_equals_transformers_through_windows_chunks_preemption_and_prefix_hits(tmp_path, monkeypatch):
    model_dir, reference = _tiny_dots3(tmp_path)
    prompts = random_prompts(6, (2, 30), 512, seed=37, shared_prefix=21)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, INDEX_TOPK)
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    # Each layer caches its own latent and rotary widths; the indexed ones their index keys too.
    assert [(layer.head_dim, layer.value_head_dim, layer.sliding_window) for layer in spec.layers] == [
        (16 + 8, 16, None), (24 + 4, 0, WINDOW), (16 + 8, 16, None)]
    # 6 blocks' bytes for prompts of up to 51 tokens growing by 8, in chunks of 16: the sliding
    # layer's group holds blocks of its own, and requests are preempted.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64,
              kv_cache_memory_bytes=6 * spec.bytes_per_block(16))
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    windowed = engine.runner.windowed
    assert windowed is not None and windowed.layer_groups == (0, 1, 0)  # the sliding layer frees its blocks
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=2)
    llm.close()

