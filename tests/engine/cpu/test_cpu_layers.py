"""Fused CPU forwards of norms and decoder layers: the same outputs as transformers'
modules, applied only where they reproduce them."""

import shutil

import pytest
import torch

from shardline.engine.cpu import layers as cpu_layers
from shardline.engine.cpu.fused_decoder import FusedDecoder
from shardline.engine.cpu.layers import FusedDecoderLayer, fuse_decoder_layers
from shardline.engine.cpu.linear import FusedGatedMLP, PackedLinear, onednn_linear_available
from shardline.engine.cpu.norms import FusedRMSNorm, fuse_rms_norms
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.surgery import replace

from .fused_models import IDS, llama_with_fused_layers
from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps its torch ops")

FUSED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module", params=FUSED_ARCHS + ("gemma2", "phi3"))
def arch_dir(request, tmp_path_factory):
    return request.param, str(build_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def fused_layers(llm) -> int:
    return sum(isinstance(layer, FusedDecoderLayer) for layer in llm.llm_engine.model.model.layers)


def unfuse(model: torch.nn.Module) -> None:
    """Back to the original norms and layers, and SiLU by ``act_fn`` (the packed
    linears stay)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedDecoder):
            replace(model, name, module.original)
    for kind, original in ((FusedDecoderLayer, "layer"), (FusedRMSNorm, "norm")):
        for name, module in list(model.named_modules()):
            if isinstance(module, kind):
                replace(model, name, getattr(module, original))
    for module in model.modules():
        if isinstance(module, FusedGatedMLP):
            module.silu_kernel = False


def generate(llm, prompts):
    from shardline import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@taken_unless_forced_off("packed_linears", "fused_kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_give_the_modules_greedy_tokens(arch_dir, dtype):
    """Prompts past Mistral's 48-token window and across prefill chunks and decode."""
    from shardline import LLM

    arch, model_dir = arch_dir
    prompts = [[5, 6, 7], list(range(3, 70)), [(7 * i) % 400 + 3 for i in range(200)]]
    llm = LLM(model_dir, dtype=dtype, max_num_batched_tokens=128)
    assert fused_layers(llm) == (2 if arch in FUSED_ARCHS else 0)
    assert isinstance(llm.llm_engine.model.model, FusedDecoder) == (arch in FUSED_ARCHS)
    first_layer, last_layer = llm.llm_engine.model.model.layers
    first, last = first_layer.self_attn, last_layer.self_attn
    # Where oneDNN packs this dtype, fused layers project q, k and v in one matmul; the
    # first no longer holds their packed copies, the last still projects k and v alone
    # for its sampled rows.
    # bfloat16 packs where oneDNN runs it, else as float32 copies.
    packed = llm.llm_engine.cpu_paths.packed_linears
    assert packed == onednn_linear_available(torch.float32)
    assert (getattr(first_layer, "packed_qkv", None) is not None) == (arch in FUSED_ARCHS and packed)
    if arch in FUSED_ARCHS and packed:
        assert not isinstance(first.q_proj, PackedLinear)
        assert isinstance(last.k_proj, PackedLinear)
    fused = generate(llm, prompts)
    unfuse(llm.llm_engine.model)
    assert fused_layers(llm) == 0 and not isinstance(llm.llm_engine.model.model, FusedDecoder)
    reference = generate(llm, prompts)
    llm.close()
    assert [o.token_ids for o in fused] == [o.token_ids for o in reference]
    # bfloat16: logits of about 10 are a step of 0.06 apart, and the last layer's
    # sampled rows are attended by the decode kernel (float32 accumulation) where the
    # modules' path runs SDPA.
    tolerance = 0.15 if dtype == "bfloat16" else 1e-4
    for ours, theirs in zip(fused, reference):
        for step_ours, step_theirs, token in zip(ours.logprobs, theirs.logprobs, ours.token_ids):
            assert step_ours[token].logprob == pytest.approx(step_theirs[token].logprob, abs=tolerance)


@taken_unless_forced_off("fused_kernels", "decode_kernel")
def test_steps_of_partial_chunks_and_of_sampled_rows_only(tmp_path):
    """One prompt far past the token budget: steps that sample nothing (partial
    chunks), then a step whose last layer attends one sampled row, then decoding."""
    from shardline import LLM

    calls = []
    real = cpu_layers._sampled_rows_forward

    def spy(layer, x, position_embeddings, ctx):
        calls.append((x.shape[0], ctx.sampled_rows.numel()))
        return real(layer, x, position_embeddings, ctx)

    llm = LLM(str(build_tiny_model(tmp_path, "qwen3")), dtype="float32", max_num_batched_tokens=64)
    prompts = [list(range(3, 200)), [5, 6]]
    try:
        cpu_layers._sampled_rows_forward = spy
        fused = generate(llm, prompts)
    finally:
        cpu_layers._sampled_rows_forward = real
    unfuse(llm.llm_engine.model)
    reference = generate(llm, prompts)
    llm.close()
    assert any(0 < sampled < tokens for tokens, sampled in calls), calls
    assert any(sampled == 0 for _, sampled in calls), calls
    assert [o.token_ids for o in fused] == [o.token_ids for o in reference]
    for ours, theirs in zip(fused, reference):
        for step_ours, step_theirs, token in zip(ours.logprobs, theirs.logprobs, ours.token_ids):
            assert step_ours[token].logprob == pytest.approx(step_theirs[token].logprob, abs=1e-4)


def test_float64_keeps_the_modules_forwards(tmp_path):
    from shardline import LLM

    llm = LLM(str(build_tiny_model(tmp_path, "llama")), dtype="float64")
    assert fused_layers(llm) == 0
    assert not any(isinstance(m, (FusedRMSNorm, FusedGatedMLP, PackedLinear)) for m in llm.llm_engine.model.modules())
    llm.close()


def test_a_norm_of_another_formula_stays_unfused():
    """Gemma's norm scales by (1 + weight): the probe tells it apart."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = torch.nn.ModuleDict({"llama": LlamaRMSNorm(32, eps=1e-5), "gemma": Gemma2RMSNorm(32, eps=1e-5)})
    with torch.no_grad():
        for norm in model.values():
            norm.weight.normal_()
    x = torch.randn(4, 7, 32)
    expected = {name: norm(x) for name, norm in model.items()}
    assert fuse_rms_norms(model) == 1
    assert isinstance(model["llama"], FusedRMSNorm) and not isinstance(model["gemma"], FusedRMSNorm)
    with torch.no_grad():
        torch.testing.assert_close(model["llama"](x), expected["llama"], atol=1e-5, rtol=1e-5)
    # With gradients on, the module's own forward runs (autograd does not see the kernel).
    w = torch.randn(4, 7, 32, requires_grad=True)
    model["llama"](w).sum().backward()
    assert w.grad is not None


def test_a_layer_of_another_formula_stays_unfused(monkeypatch, tmp_path):
    """Gemma2's layer has the attributes the fused forward reads but adds norms of its
    own: if it were taken for a Llama-family layer, the probe would still refuse it."""
    from shardline import LLM

    llm = LLM(str(build_tiny_model(tmp_path, "gemma2")), dtype="float32")
    model = llm.llm_engine.model
    monkeypatch.setitem(cpu_layers.LAYER_WINDOWS, "Gemma2DecoderLayer", lambda attention: attention.sliding_window)
    assert fuse_decoder_layers(model, rows_hint=256) == 0
    assert fused_layers(llm) == 0
    llm.close()


def test_layers_without_the_engine_context_run_their_own_forward(tmp_path):
    """The fused forward serves engine steps only; a plain transformers call (no paged
    cache context) goes to the layer's own forward."""
    model, expected = llama_with_fused_layers(tmp_path)
    with torch.no_grad():
        out = model(IDS).logits
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@taken_unless_forced_off("packed_linears", "fused_kernels")
def test_lora_adapters_and_prompt_logprobs_through_fused_layers(tiny_llama_dir, tmp_path):
    """float32 (the fused path): LoRA wrappers inside fused layers, prompt logprobs
    (every row read, so no sampled-rows shortcut), seeded n=2 sampling and penalties
    give what the modules' own forwards give."""
    from shardline import LLM, SamplingParams
    from shardline.engine.lora.request import LoRARequest

    from ..lora.test_lora import make_adapter

    adapter = make_adapter(tiny_llama_dir, tmp_path / "adapter", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    llm = LLM(tiny_llama_dir, dtype="float32", enable_lora=True, max_num_batched_tokens=64)
    assert fused_layers(llm) == 2
    prompts = [{"prompt_token_ids": list(range(3, 90))}, {"prompt_token_ids": [5, 6, 7, 8]}]
    lora = [LoRARequest("a", 1, adapter), None]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    sampled = SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, repetition_penalty=1.3)

    def run():
        return (llm.generate(prompts, greedy, use_tqdm=False, lora_request=lora),
                llm.generate(prompts, sampled, use_tqdm=False, lora_request=lora))

    fused = run()
    unfuse(llm.llm_engine.model)
    reference = run()
    llm.close()
    for ours, theirs in zip(fused, reference):
        assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in theirs]
    for ours, theirs in zip(fused[0], reference[0]):
        for step_ours, step_theirs in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            for token, logprob in step_theirs.items():
                assert step_ours[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


@pytest.mark.parametrize("native_decode", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_the_backend_attends_the_sampled_rows_as_the_whole_step_attends_them(native_decode, sliding_window):
    """attend_sampled_rows (the fused last layer's attention) writes every new token's
    keys and values and gives, at the sampled rows, what attending the whole step gives."""
    from shardline.engine.attention.backends import TorchBackend
    from shardline.engine.attention.context import AttentionOptions, StepBatch
    from shardline.engine.kernels.cpu_attention import decode_kernel_available

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16
    query_lens, seq_lens = [5, 1, 4], [9, 7, 4]  # a chunk after a cached prefix, a decode, a fresh prompt
    tokens = sum(query_lens)
    starts = torch.tensor([0, 5, 6, 10])
    slots = torch.cat([torch.arange(b * block_size + s - q, b * block_size + s)
                       for b, (q, s) in enumerate(zip(query_lens, seq_lens))])
    query, key, value = (torch.randn(tokens, count, head_dim, generator=generator)
                         for count in (heads, kv_heads, kv_heads))
    # The requests' blocks 0-2 (the torch path reads their unused slots, masked: zeros);
    # block 3, which no request owns, is NaN so a stray read shows.
    cache = torch.zeros(4, block_size, kv_heads, head_dim)
    cache[3] = float("nan")
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        cache[b, : s - q] = torch.randn(s - q, kv_heads, head_dim, generator=generator)
    sampled_rows = starts[1:] - 1
    step = dict(slot_mapping=slots, query_start_loc=starts, seq_lens=torch.tensor(seq_lens),
                block_tables=torch.arange(3, dtype=torch.int32)[:, None], max_query_len=5, max_seq_len=9)
    options = AttentionOptions(head_dim ** -0.5, sliding_window=sliding_window)
    whole_caches = [(cache.clone(), cache.clone())]
    whole = TorchBackend(heads).build_context(StepBatch(kv_caches=whole_caches, **step))
    expected = whole.backend.attend(whole, 0, query, key, value, options).index_select(0, sampled_rows)
    if native_decode and not decode_kernel_available(cache, heads, head_dim):
        pytest.skip("the native decode kernel is not built here")
    backend = TorchBackend(heads, native_decode=native_decode)
    caches = [(cache.clone(), cache.clone())]
    ctx = backend.build_context(StepBatch(kv_caches=caches, sampled_rows=sampled_rows,
                                          sampled_requests=torch.arange(3), sampled_query_rows=torch.arange(3), **step))
    attended = backend.attend_sampled_rows(ctx, 0, query.index_select(0, sampled_rows), key, value, options)
    torch.testing.assert_close(attended, expected)
    for written, wanted in zip(caches[0], whole_caches[0]):  # every new token's keys and values
        torch.testing.assert_close(written, wanted, equal_nan=True)
