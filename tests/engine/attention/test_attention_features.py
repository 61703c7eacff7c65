"""Models whose attention has a feature beyond causal softmax run token-exact against
transformers: attention sinks (gpt_oss, granite_swa, granitemoe_swa, flint), chunked
local attention (llama4_text), keys and values of different head sizes (multi-head
latent attention: minicpm3, deepseek_v3) and all of these with per-layer head counts
(mimo_v2_flash). Each model passes the load check and its
greedy tokens equal transformers' own generate, in float64 where transformers runs
the model in float64 and in float32 where its MoE code refuses float64. The
kernel-level tests of each feature are in tests/engine/kernels/ and
test_torch_attention.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import hf_greedy

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=32,
           q_lora_rank=32)
LLAMA4_TEXT = dict(attention_chunk_size=4, head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
                   no_rope_layers=[1, 0])
# case -> (model type, dtype, attention backend (None: the engine's choice), config overrides).
# float32 cases on the "cpu" backend attend through the C kernels; "torch" through SDPA
# and the explicit softmax.
MODELS = {
    "gpt_oss": ("gpt_oss", "float32", None, dict(MOE, head_dim=16, sliding_window=8)),
    "gpt_oss-torch": ("gpt_oss", "float32", "torch", dict(MOE, head_dim=16, sliding_window=8)),
    "granite_swa": ("granite_swa", "float64", None, dict(head_dim=16, sliding_window=8)),
    "granitemoe_swa": ("granitemoe_swa", "float32", None, dict(head_dim=16, sliding_window=8)),
    "flint": ("flint", "float64", None, dict(head_dim=16)),
    "llama4_text": ("llama4_text", "float64", None, LLAMA4_TEXT),
    "llama4_text-float32": ("llama4_text", "float32", None, LLAMA4_TEXT),
    "minicpm3": ("minicpm3", "float64", None, dict(MLA, qk_rope_head_dim=8)),  # keys of 40, values of 32
    "minicpm3-float32": ("minicpm3", "float32", None, MLA),  # keys of 48, values of 32
    "deepseek_v3": ("deepseek_v3", "float32", None, dict(MLA, n_routed_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, first_k_dense_replace=1,
                                                         n_group=1, topk_group=1)),
    # Sinks and twice the key-value heads on its sliding layers; keys of 32, values of 16.
    "mimo_v2_flash": ("mimo_v2_flash", "float32", None, dict(
        head_dim=32, v_head_dim=16, sliding_window=8, layer_types=["full_attention", "sliding_attention"],
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)),
    # Full layers' heads of 512, past the C kernels' 256, sliding ones of 16: the kernels
    # are taken for no layer (a step's plan serves all of them), SDPA attends every one.
    "gemma4_text-head-sizes-past-the-kernels": ("gemma4_text", "float32", "cpu", dict(
        head_dim=16, global_head_dim=512, sliding_window=8)),
}
SLOW = {"gpt_oss-torch", "granitemoe_swa", "flint", "llama4_text-float32", "deepseek_v3", "mimo_v2_flash"}
# The last two end in the same tokens after different contexts.
PROMPTS = [[5, 6, 7], list(range(3, 40)), [40, 41, 42, 43, 44, 45, 30, 31], [90, 17, 88, 12, 60, 3, 30, 31]]


def build_model(tmp_path, model_type: str, overrides: dict) -> str:
    """A tiny random model of ``model_type`` whose sink logits (one per head; zero or
    near zero at transformers' initialisation) are drawn with std 1, so that
    ignoring them changes the output."""
    model_dir = build_tiny_model(tmp_path, model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sinks = [param for name, param in model.named_parameters() if name.endswith("sinks")]
    if sinks:
        with torch.no_grad():
            for param in sinks:
                param.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        model.save_pretrained(model_dir)
    return str(model_dir)


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                  for name in MODELS])
def test_greedy_tokens_equal_transformers(tmp_path, case):
    model_type, dtype, backend, overrides = MODELS[case]
    model_dir = build_model(tmp_path, model_type, overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 8) for prompt in PROMPTS]
    # The context decides the tokens: the last two prompts end alike and continue differently.
    assert expected[2] != expected[3]
    llm = LLM(model_dir, dtype=dtype, attention_backend=backend)  # the load check runs, and passes
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected


def test_a_native_kernel_is_taken_only_where_it_takes_every_attention_layer():
    """The torch backend's per-step plan serves every layer, so the C kernels are taken
    only where each attention layer's cache fits them; a recurrent layer's empty cache
    does not count."""
    from shardline.engine.attention.backends import TorchBackend
    from shardline.engine.attention.context import StepBatch
    from shardline.engine.kernels.cpu_attention import decode_kernel_available
    from shardline.engine.kernels.cpu_prefill_attention import prefill_kernel_available

    def caches(*head_dims: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(4, 16, 2 if size else 0, size), torch.zeros(4, 16, 2 if size else 0, size))
                for size in head_dims]

    def plans(kv_caches, query_lens: tuple[int, int]):
        seq_lens = torch.tensor([6, 6])
        step = StepBatch(slot_mapping=torch.arange(sum(query_lens)),
                         query_start_loc=torch.tensor([0, query_lens[0], sum(query_lens)]), seq_lens=seq_lens,
                         block_tables=torch.tensor([[0], [1]], dtype=torch.int32), kv_caches=kv_caches,
                         max_query_len=max(query_lens), max_seq_len=6)
        return TorchBackend(4, native_decode=True, native_prefill=True).build_context(step).work

    fitting = caches(0, 16, 32)
    if not (decode_kernel_available(fitting[1][0], 4) and prefill_kernel_available(fitting[1][0], 4)):
        pytest.skip("the C attention kernels are not built on this host")
    assert plans(fitting, (1, 1)).decode is not None and plans(fitting, (3, 3)).prefill is not None
    too_wide = caches(0, 16, 512)
    assert plans(too_wide, (1, 1)).decode is None and plans(too_wide, (3, 3)).prefill is None


def _new_slots(ctx) -> torch.Tensor:
    """The cache slot of each of the step's new tokens, packed as its queries."""
    block_size = ctx.kv_caches[0][0].shape[1]
    starts, slots = ctx.query_start_loc.tolist(), []
    for b, seq_len in enumerate(ctx.seq_lens.tolist()):
        table = ctx.block_tables[b].tolist()
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - (starts[b + 1] - starts[b]), seq_len)]
    return torch.tensor(slots)


def _biased_reference(q: torch.Tensor, ctx, table: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each request's queries over its paged context with
    table[h, key position] added to each scaled score, in float64; [T, H, D]."""
    k_cache, v_cache = ctx.kv_caches[0]
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    flat_k, flat_v = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    starts, out = ctx.query_start_loc.tolist(), torch.zeros(q.shape, dtype=torch.float64)
    for b, seq_len in enumerate(ctx.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = ctx.block_tables[b, positions // block_size].long() * block_size + positions % block_size
        k = flat_k[slots].repeat_interleave(group, dim=1)  # [S, H, D]
        v = flat_v[slots].repeat_interleave(group, dim=1)
        query_pos = positions[seq_len - (starts[b + 1] - starts[b]):]
        scores = torch.einsum("qhd,khd->hqk", q[starts[b]:starts[b + 1]].double(), k) * scale
        scores = scores + table[:, None, :seq_len].double()
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[starts[b]:starts[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_bias_table_by_key_position_leaves_the_native_kernels_for_the_torch_path(dtype):
    """A layer with a bias table (AttentionOptions.position_bias: falcon's bfloat16-rounded
    ALiBi) is attended by the torch path on plans made without the native kernels, even
    where the step's plan gives decoding requests and prefill chunks to them; a table
    not linear in the position, so slope * distance could not stand for it."""
    from shardline.engine.attention.backends import TorchBackend, TritonBackend
    from shardline.engine.attention.context import AttentionOptions, StepBatch

    from .test_torch_attention import MIXED, make_step, new_keys_and_values

    q, ctx = make_step(*MIXED, dtype=dtype)
    key, value = new_keys_and_values(ctx)
    fields = {name: getattr(ctx, name) for name in StepBatch.__dataclass_fields__}
    step = StepBatch(**{**fields, "slot_mapping": _new_slots(ctx)})  # attend rewrites the same keys
    ctx = TorchBackend(q.shape[1], native_decode=True, native_prefill=True).build_context(step)
    table = torch.randn(q.shape[1], ctx.max_seq_len, generator=torch.Generator().manual_seed(5), dtype=dtype) * 2
    options = AttentionOptions(q.shape[-1] ** -0.5, position_bias=table)
    if ctx.work.decode is None:
        pytest.skip("the C decode kernel is not built on this host")
    out = ctx.backend.attend(ctx, 0, q, key, value, options)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    expected = _biased_reference(q, ctx, table, options.scale)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    without = ctx.work.without_kernels(lambda: None)  # made by the attend above, once per step
    assert without is not ctx.work and without.decode is None and without.prefill is None
    with pytest.raises(ValueError, match="Triton kernels do not take; run it with attention_backend='torch'"):
        TritonBackend().attend(ctx, 0, q, key, value, options)
