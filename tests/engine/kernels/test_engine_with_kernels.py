"""The engine running its Triton kernels (through the interpreter on CPU) gives the
same tokens as its torch path: checks the glue between the model runner, the
attention entry point and the kernels (index dtypes, layouts, window, softcap)."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import random_prompts


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_triton_backend_matches_torch_backend(tmp_path, arch, monkeypatch):
    import shardline.engine.kernels as kernels

    launches = []
    launcher = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: launches.append(1) or launcher(*a, **k))
    model_dir = str(build_tiny_model(tmp_path / arch, arch))
    # Long enough for the sliding windows (48) to cut in; a small budget forces chunks.
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, (20, 70), 512, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=64, attention_backend=backend)
        assert llm.llm_engine.runner.attention.name == backend
        results[backend] = llm.generate(prompts, params, use_tqdm=False)
    assert launches  # the Triton path really ran
    for torch_out, triton_out in zip(results["torch"], results["triton"]):
        assert triton_out.outputs[0].token_ids == torch_out.outputs[0].token_ids
        assert abs(triton_out.outputs[0].cumulative_logprob - torch_out.outputs[0].cumulative_logprob) < 1e-3
