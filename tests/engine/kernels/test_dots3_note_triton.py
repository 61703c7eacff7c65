"""dots3_note on the Triton backend: its indexed layers select keys on the host, its
sliding-window latent layers attend their window through the host path (the Triton
latent decode kernel takes no window) from their own windowed block group, with the
Triton kernel taking the decode steps no window cuts; greedy tokens equal
transformers'. Without CUDA the kernels run through Triton's interpreter (this
folder's conftest sets TRITON_INTERPRET=1)."""

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
from ..test_dots3_note import SIZES

# Two prompts past the window and index_topk, two within both for their first decode steps.
PROMPTS = [list(range(3, 30)) + [40, 41, 42], [90, 17, 88, 12, 60, 3, 30, 31, 77, 5, 61], [7, 8, 9], [11, 12, 13, 14]]


@pytest.mark.slow
def test_triton_backend_runs_dots3_note_windows_and_selections(tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path, "dots3_note_text", **{**tiny_overrides("dots3_note_text"), **SIZES})
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
    assert isinstance(engine, LLMEngine) and engine.runner.windowed is not None
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                           SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    llm.close()
    assert calls  # the short requests' decode steps went through the Triton kernel
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
