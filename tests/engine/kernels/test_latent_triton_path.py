"""Latent (MLA) caching on the Triton backend (engine/model/adapters/latent.py): prompt
chunks up-project from the latent cache, decode steps attend it absorbed through the
Triton kernel (kernels/mla_decode.py), also over the static buffers CUDA graphs replay
(padding rows included); greedy tokens equal transformers'. Without CUDA the kernels
run through Triton's interpreter (this folder's conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.kernels import mla_decode
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.adapters.latent import LATENT_LAYOUTS
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
# The other latent types at the coverage sweep's tiny sizes (slow under the interpreter);
# the sparse-attention ones in test_sparse_indexer_triton.py.
SLOW_TYPES = [model_type for model_type, layout in LATENT_LAYOUTS.items()
              if model_type not in CASES and layout.indexer is None]


def _count_kernel_calls(monkeypatch) -> list[int]:
    """Each Triton MLA decode launch appends its number of requests."""
    calls: list[int] = []
    original = mla_decode.mla_decode_triton
    monkeypatch.setattr(mla_decode, "mla_decode_triton",
                        lambda q_abs, *args: calls.append(q_abs.shape[0]) or original(q_abs, *args))
    return calls


@pytest.mark.parametrize("model_type", [*CASES, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_TYPES)])
def test_triton_backend_caches_latents_and_equals_transformers(model_type, tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path, model_type, **{**tiny_overrides(model_type), **CASES.get(model_type, {})})
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
    """The decode path CUDA graphs record (engine/model/cuda_graphs.py; without CUDA run
    eagerly over the same buffers, on CUDA recorded and replayed): five requests padded
    to a batch of 8 rows (slot -1, context 0), decoding through latent_decode_triton."""
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
    graphs = engine.runner.decode_graphs
    assert graphs is not None and bool(graphs.graphs) == torch.cuda.is_available()  # on CUDA: recorded, replayed
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                           [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths],
                           use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert runs and max(runs) == 5 and min(runs) < 5  # the static path ran, with padding rows
    assert 8 in calls  # the kernel read the padded batch of 8 rows


# Records the two launches of a latent layer's Triton decode step (the row store and the
# MLA decode, a padding row of context 0 among the requests) and compiles them for sm_90.
COMPILE_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from cuda_compile import compile_launches, record_launches
from shardline.engine.kernels import mla_decode, reshape_and_cache
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(3, 20, 40).to(dtype)
    cache = torch.randn(10, 16, 40).to(dtype)
    tables, lens = torch.zeros(3, 4, dtype=torch.int32), torch.tensor([5, 0, 17], dtype=torch.int32)
    rows, k_cache, v_cache = torch.randn(3, 1, 40).to(dtype), cache[:, :, None], cache[:, :, None, :0]
    launches = record_launches(lambda: mla_decode.mla_decode_triton(q, cache, tables, lens, 24, 0.1), [mla_decode])
    launches += record_launches(lambda: reshape_and_cache.store_kv_cache(
        rows, rows[..., :0], k_cache, v_cache, torch.tensor([1, -1, 5])), [reshape_and_cache])
    print(chr(10).join(compile_launches(str(dtype), launches, 90)), flush=True)
"""


def test_the_decode_step_kernels_compile_for_hopper():
    """Triton's real compiler (through ptxas), which the interpreter never runs, takes
    the latent decode step's kernels for sm_90 in float32 and bfloat16."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(Path(__file__).parent)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.endswith(" ok") for line in lines), lines
