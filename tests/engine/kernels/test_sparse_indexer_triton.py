"""Sparse attention (deepseek_v32's indexer, engine/model/adapters/indexer.py) on the
Triton backend: index keys and latents written to the paged cache, selections made in
torch, the requests whose context is within index_topk decoding through the Triton latent
kernel (kernels/mla_decode.py), the others attending their selected keys in torch; greedy
tokens equal transformers' through chunked prompts and a prefix-cache hit. Without CUDA
the kernels run through Triton's interpreter (this folder's conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.kernels import mla_decode
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model

from ..coverage import tiny_overrides
from ..hf_reference import hf_greedy

INDEX_TOPK = 8
# Two prompts past the top-k (selected keys, in torch), two within it for their first
# decode steps (every key: the Triton kernel).
PROMPTS = [list(range(3, 30)) + [40, 41, 42], [90, 17, 88, 12, 60, 3, 30, 31, 77, 5, 61], [7, 8, 9], [11, 12, 13, 14]]


@pytest.mark.slow
def test_triton_backend_selects_keys_and_equals_transformers(tmp_path, monkeypatch):
    overrides = {**tiny_overrides("deepseek_v32"), "index_n_heads": 8, "index_topk": INDEX_TOPK}
    model_dir = build_tiny_model(tmp_path, "deepseek_v32", **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 6) for prompt in PROMPTS]
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # the tokens depend on the prompt
    calls: list[int] = []
    original = mla_decode.mla_decode_triton
    monkeypatch.setattr(mla_decode, "mla_decode_triton",
                        lambda q_abs, *args: calls.append(q_abs.shape[0]) or original(q_abs, *args))
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", max_num_batched_tokens=8,
              max_num_seqs=4)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine) and engine.runner.decode_graphs is None  # selections read on the host
    assert {tuple(value.shape[2:]) for _, value in engine.runner.kv_caches} == {(1, overrides["index_head_dim"])}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    assert calls  # the short requests' decode steps went through the Triton kernel
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)  # a prefix-cache hit
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert again[0].num_cached_tokens >= 16 and list(again[0].outputs[0].token_ids) == expected[0]
