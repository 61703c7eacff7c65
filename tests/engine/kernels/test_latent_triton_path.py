"""Latent (MLA) caching on the Triton backend (engine/model/adapters/latent.py): prompt
chunks up-project from the latent cache, decode steps attend it absorbed through the
Triton kernel (kernels/mla_decode.py), also over the static buffers CUDA graphs replay
(padding rows included); greedy tokens equal transformers'. Without CUDA the kernels
run through Triton's interpreter (this folder's conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.kernels import mla_decode
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.cuda_graphs import DecodeGraphs
from shardline.engine.model.tiny import build_tiny_model

from ..coverage import tiny_overrides
from ..hf_reference import hf_greedy

PREFIX = list(range(3, 30))
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [43, 44, 45, 46, 47], [90, 17, 88, 12, 60, 3, 30, 31],
           [5, 17, 88, 12, 60, 3, 30, 31], [7, 8, 9]]
# deepseek_v3 with a query LoRA and 20 heads (two runs of the kernel's 16), deepseek_v2
# without one (DeepSeek-V2-Lite's shape), its rotation by complex frequencies.
CASES = {"deepseek_v3": dict(num_attention_heads=20, num_key_value_heads=20),
         "deepseek_v2": dict(q_lora_rank=None)}


def _count_kernel_calls(monkeypatch) -> list[int]:
    """Each Triton MLA decode launch appends its number of requests."""
    calls: list[int] = []
    original = mla_decode.mla_decode_triton
    monkeypatch.setattr(mla_decode, "mla_decode_triton",
                        lambda q_abs, *args: calls.append(q_abs.shape[0]) or original(q_abs, *args))
    return calls


@pytest.mark.parametrize("model_type", list(CASES))
def test_triton_backend_caches_latents_and_equals_transformers(model_type, tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path, model_type, **{**tiny_overrides(model_type), **CASES[model_type]})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 6) for prompt in PROMPTS]
    assert expected[2] != expected[3]  # the tokens depend on the prompt
    calls = _count_kernel_calls(monkeypatch)
    # Chunks of 8 tokens: later chunks up-project earlier chunks' latents; the last
    # prompt's decode steps share steps with the others' chunks.
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", max_num_batched_tokens=8,
              max_num_seqs=3)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    rank, rope = reference.config.kv_lora_rank, reference.config.qk_rope_head_dim
    assert {(tuple(key.shape[2:]), tuple(value.shape[2:])) for key, value in engine.runner.kv_caches
            if key.numel()} == {((1, rank + rope), (1, 0))}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    assert calls  # decode steps went through the Triton kernel
    calls.clear()
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)  # a prefix-cache hit
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert again[0].num_cached_tokens >= 16 and list(again[0].outputs[0].token_ids) == expected[1]
    assert calls


def test_static_decode_buffers_with_padding_rows_equal_transformers(tmp_path, monkeypatch):
    """The decode path CUDA graphs record (engine/model/cuda_graphs.py), run eagerly
    here: five requests padded to a batch of 8 rows (slot -1, context 0), decoding
    through latent_decode_triton."""
    runs: list[int] = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, out, *args: runs.append(len(out.scheduled))
                        or run(self, out, *args))
    model_dir = build_tiny_model(tmp_path, "deepseek_v3", **tiny_overrides("deepseek_v3"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    lengths = [6, 4, 7, 5, 3]  # requests finish at different steps: later steps pad more rows
    expected = [hf_greedy(reference, prompt, n) for prompt, n in zip(PROMPTS, lengths)]
    calls = _count_kernel_calls(monkeypatch)
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", max_num_seqs=8)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    if engine.runner.decode_graphs is None:  # no CUDA: the same static buffers, run eagerly
        engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                           [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths],
                           use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert runs and max(runs) == 5 and min(runs) < 5  # the static path ran, with padding rows
    assert 8 in calls  # the kernel read the padded batch of 8 rows
