"""Sparse attention's indexer (engine/attention/sparse_index.py, adapters/indexer.py):
index keys cached per layer beside the latents, each query's top-k keys selected over
the keys it may see, the latent attention over those alone; greedy tokens equal
transformers' through chunked prefill, preemption, prefix-cache hits and decode.

Ties: the tiny models here have 8 indexer heads, so a key's score is a sum of several
positive parts and two keys tie at the top-k boundary only by accident; every test
records the reference's indexer rows and asserts that the top-k-th and next score
differ there (``IndexerTies``), so a selection never depends on topk's order among
equal scores.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM
from shardline.engine.attention.sparse_index import select_keys, write_index_keys
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import build_tiny_model

from .coverage import tiny_overrides
from .hf_reference import assert_exact_through_preemption_and_hits, engine_greedy, hf_greedy, random_prompts

INDEX_TOPK = 6
INDEXER = dict(index_n_heads=8, index_head_dim=16, index_topk=INDEX_TOPK)


class IndexerTies:
    """Records, while active, the gap between the top-k-th and the next score of every
    indexer row transformers ranks (``Tensor.topk`` with k = the index top-k over rows
    with more visible keys than k; the model's routers call ``torch.topk``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, topk: int) -> None:
        self.gaps: list[float] = []
        original = torch.Tensor.topk

        def recording(tensor: torch.Tensor, k: int, *args, **kwargs):
            if k == topk and tensor.dim() == 3:
                for row in tensor.reshape(-1, tensor.shape[-1]):
                    visible = row[torch.isfinite(row) & (row > torch.finfo(row.dtype).min)]
                    if visible.numel() > k:
                        best = visible.topk(k + 1).values
                        self.gaps.append(float(best[k - 1] - best[k]))
            return original(tensor, k, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "topk", recording)

    def assert_untied(self) -> None:
        assert self.gaps, "no indexer row ranked more keys than it keeps: the selection was never tested"
        assert min(self.gaps) > 1e-4, f"indexer scores tie at the top-k boundary (gap {min(self.gaps)})"


def _reference_selection(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, topk: int,
                         scale: float) -> torch.Tensor:
    """transformers' indexer over one request: scores [n, S] of its n last positions,
    the future masked additively with the float32 minimum, top-k scattered into a mask."""
    num_queries, seq_len = q.shape[0], keys.shape[0]
    scores = torch.relu(torch.matmul(q.float()[None], keys.float().T[None, None]) * scale)  # [1, n, H, S]
    index_scores = torch.matmul(weights.float()[None, :, None, :], scores)[:, :, 0]  # [1, n, S]
    future = torch.arange(seq_len)[None, :] > torch.arange(seq_len - num_queries, seq_len)[:, None]
    index_scores = index_scores + torch.zeros(future.shape).masked_fill(future, torch.finfo(torch.float32).min)
    chosen = index_scores.topk(min(topk, seq_len), dim=-1).indices[0]
    return torch.zeros(num_queries, seq_len, dtype=torch.bool).scatter(-1, chosen, True) & ~future


def test_selection_over_paged_index_keys_equals_transformers_topk():
    torch.manual_seed(0)
    heads, width, block_size, topk, scale = 4, 8, 4, 5, 8 ** -0.5
    seq_lens, query_lens = [11, 3, 9], [4, 3, 1]  # a prompt chunk, a short prompt, a decode step
    index_cache = torch.full((12, block_size, 1, width), float("nan"))  # slots no request owns stay NaN
    block_tables = torch.tensor([[5, 2, 9], [7, 0, 0], [1, 11, 3]], dtype=torch.int32)
    keys = [torch.randn(length, width) for length in seq_lens]
    for request, length in enumerate(seq_lens):
        slots = torch.tensor([int(block_tables[request, pos // block_size]) * block_size + pos % block_size
                              for pos in range(length)])
        write_index_keys(index_cache, keys[request], slots)
    total = sum(query_lens)
    q, weights = torch.randn(total, heads, width), torch.randn(total, heads)
    starts = torch.tensor([0, 4, 7, 8])
    selections = select_keys(q, weights, index_cache, starts, torch.tensor(seq_lens), block_tables, topk, scale)
    assert selections[1] is None  # 3 keys <= top-k: every query attends causally
    for request in (0, 2):
        rows = slice(int(starts[request]), int(starts[request + 1]))
        expected = _reference_selection(q[rows], weights[rows], keys[request], topk, scale)
        selection = selections[request]
        assert selection is not None and torch.equal(selection, expected)
        assert (selection.sum(-1) <= topk).all()


def test_index_keys_take_their_own_slice_of_each_block():
    config = transformers.AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=3, kv_lora_rank=16,
                                               qk_rope_head_dim=8, index_head_dim=32,
                                               indexer_types=["full", "shared", "full"])
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert [(layer.num_kv_heads, layer.head_dim, layer.value_head_dim) for layer in spec.layers] == [
        (1, 24, 32), (1, 24, 0), (1, 24, 32)]
    assert spec.bytes_per_block(16) == 4 * 16 * (3 * 24 + 2 * 32)


def _tiny_indexed(tmp_path, model_type: str, **overrides) -> tuple[str, transformers.PreTrainedModel]:
    model_dir = build_tiny_model(tmp_path, model_type, **{**tiny_overrides(model_type), **INDEXER, **overrides})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return str(model_dir), reference


def _untied_greedy(monkeypatch, reference: transformers.PreTrainedModel, prompts: list[list[int]],
                   max_tokens: int, topk: int) -> list[list[int]]:
    """transformers' greedy tokens for ``prompts``, checking that no indexer score ties at
    the top-k boundary on the way (the recording is undone before the engine runs)."""
    ties = IndexerTies(monkeypatch, topk)
    expected = [hf_greedy(reference, prompt, max_tokens) for prompt in prompts]
    ties.assert_untied()
    monkeypatch.undo()
    return expected


def test_deepseek_v32_equals_transformers_through_chunks_preemption_and_prefix_hits(tmp_path, monkeypatch):
    model_dir, reference = _tiny_indexed(tmp_path, "deepseek_v32")
    prompts = random_prompts(6, (2, 30), 512, seed=33, shared_prefix=21)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, INDEX_TOPK)
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    per_block = KVCacheSpec.from_hf_config(reference.config, torch.float32).bytes_per_block(16)
    # 5 blocks of 16 for prompts of up to 51 tokens growing by 8, with 16-token chunks: preemptions happen.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3,
              kv_cache_memory_bytes=5 * per_block)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    assert {tuple(value.shape[2:]) for _, value in engine.runner.kv_caches} == {(1, INDEXER["index_head_dim"])}
    # The rerun: index keys come back with the cached blocks.
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=2)
    llm.close()


# glm_moe_dsa with a layer reusing the previous one's selection (no index keys of its
# own), axk2 with its gated query projection, hy_v4 with attention sinks, head gates,
# hyper-connections and a shared third layer; each type's index-key widths per layer.
TYPE_CASES = {"glm_moe_dsa": (dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"]), [16, 0, 16]),
              "axk2": ({}, [16, 16]), "hy_v4": (dict(num_hidden_layers=3), [16, 16, 0])}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(TYPE_CASES))
def test_other_indexed_types_equal_transformers(model_type, tmp_path, monkeypatch):
    overrides, widths = TYPE_CASES[model_type]
    model_dir, reference = _tiny_indexed(tmp_path, model_type, **overrides)
    prompts = random_prompts(4, (8, 30), 512, seed=34)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, INDEX_TOPK)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    assert [tuple(value.shape[2:]) for _, value in engine.runner.kv_caches] == [(1, width) for width in widths]
    assert engine_greedy(llm, prompts, 8) == expected
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("decode_kernel", ["on", "off"])
def test_requests_within_the_top_k_take_the_decode_kernel(decode_kernel, tmp_path, monkeypatch):
    """A request whose context is no longer than index_topk attends every key, so its
    decode steps take the C latent kernel where it builds; longer ones select in torch."""
    from shardline.engine.kernels.cpu_mla import load_library

    if decode_kernel == "on" and load_library() is None:
        pytest.skip("no C compiler: the engine uses its torch path")
    topk = 16
    model_dir, reference = _tiny_indexed(tmp_path, "deepseek_v32", index_topk=topk)
    prompts = [prompt[:length] for prompt, length in zip(random_prompts(4, (30, 30), 512, seed=35), (4, 9, 14, 30))]
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, topk)
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"decode_kernel={decode_kernel}")
    llm = LLM(model_dir, dtype="float32", max_num_seqs=4)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    taken = {module.latent_decode_kernel for module in engine.runner.model.modules()
             if hasattr(module, "latent_decode_kernel")}
    assert taken == {decode_kernel == "on"}
    assert engine_greedy(llm, prompts, 8) == expected
    llm.close()


@pytest.mark.slow
def test_deepseek_v32_on_two_tensor_parallel_ranks_equals_transformers(tmp_path, monkeypatch):
    """Each rank attends its share of the heads over the same selection: the indexer's
    projections are kept whole on every rank (no plan or shape rule splits them)."""
    model_dir, reference = _tiny_indexed(tmp_path, "deepseek_v32")
    prompts = random_prompts(3, (8, 30), 512, seed=36)
    expected = _untied_greedy(monkeypatch, reference, prompts, 6, INDEX_TOPK)
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=8)
    try:
        assert engine_greedy(llm, prompts, 6) == expected
    finally:
        llm.close()


def test_an_indexed_type_whose_latents_cannot_be_cached_is_refused():
    config = transformers.AutoConfig.for_model("deepseek_v32", num_hidden_layers=2,
                                               quantization_config={"quant_method": "gptq", "bits": 4})
    support = model_support(config)
    assert not support.ok and support.reason is not None and "selects keys among cached latents" in support.reason
