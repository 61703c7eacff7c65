"""Recurrent layers split over tensor-parallel ranks: gated delta-net and Mamba-2 mixers
on 2 gloo ranks give 1 rank's (and transformers') greedy tokens through chunked
prefill, preemption and prefix hits, each rank's state slots holding half the heads;
the shares of a mixer over the ranks are the whole mixer's parts; a mixer whose counts
do not split runs whole, which the load log says."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.layers import RowParallelLinear, SpanningGatedNorm
from shardline.engine.parallel.recurrent import shard_recurrent_mixers
from shardline.engine.parallel.sharding import shard_cache_spec, shard_model
from shardline.engine.recurrent.state import RecurrentStateSpec, install_recurrent_layers

from ..hf_reference import hf_greedy
from .test_tensor_parallel import GDN, MAX_TOKENS, MOE, OPTIONS, generate, prompts_for, rank_processes

MAMBA2: dict[str, Any] = dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_chunk_size=4,
                              mamba_d_conv=4)
KDA: dict[str, Any] = dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_key_value_heads=4,
                          layer_types=["linear_attention", "full_attention"])
CASES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {**GDN},
    # fused q|k|v|z and b|a projections; dense MLPs (its experts split as qwen2_moe's do)
    "qwen3_next": {**GDN, **MOE, "mlp_only_layers": [0, 1, 2]},
    "bamba": dict(MAMBA2, mamba_n_groups=1, attn_layer_indices=[1]),  # one group spanning both ranks
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=4,
                       conv_kernel=4, layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3,
                       head_dim=16),  # a group per rank
    "granitemoehybrid": dict(MAMBA2, mamba_n_groups=2, layer_types=["mamba", "attention"], num_local_experts=4,
                             num_experts_per_tok=2),
    "falcon_h1": dict(MAMBA2, mamba_n_groups=2, mamba_d_ssm=128, head_dim=16),  # its mup vector and group norm
    "jamba": dict(mamba_expand=2, mamba_d_state=8, mamba_dt_rank=4, mamba_d_conv=4, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2),  # Mamba-1 with its dt, B and C norms
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    "rwkv": dict(intermediate_size=96, rescale_every=2, num_hidden_layers=3),
    "kimi_linear": dict(KDA),
    "bailing_hybrid": dict(KDA),
    "minimax": dict(head_dim=16, block_size=4, layer_types=["linear_attention", "full_attention"],
                    num_local_experts=4, num_experts_per_tok=2),
    "zamba": dict(mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, num_hidden_layers=4,
                  layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),  # a head per rank, its own dt, B, C
    "xlstm": dict(hidden_size=128, embedding_dim=128, num_heads=4, num_hidden_layers=2, chunk_size=8),
    "recurrent_gemma": dict(lru_width=64, conv1d_width=4, num_hidden_layers=3, attention_window_size=8, head_dim=16),
}
NUM_SLOTS, NUM_BLOCKS, NUM_SNAPSHOTS, BLOCK_SIZE = 4, 6, 3, 16


def rank_zero_bytes(model_dir: str, dtype: torch.dtype) -> tuple[int, int]:
    """(state bytes per slot, KV bytes per block) on rank 0 of 2: the model's mixers split
    as a rank splits them (no collective runs while splitting)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    shard_recurrent_mixers(model, RankGroup(0, 2, lambda: "no collective runs here"))
    per_slot = RecurrentStateSpec.from_layers(install_recurrent_layers(model)).bytes_per_slot()
    spec = shard_cache_spec(KVCacheSpec.from_hf_config(model.config, dtype), model.config, 2)
    return per_slot, spec.bytes_per_block(BLOCK_SIZE)


def state_shapes(llm: LLM) -> dict[int, dict[str, tuple[int, ...]]]:
    """Each recurrent layer's state shapes per slot on this process's rank."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return {index: {name: tuple(tensor.shape[1:]) for name, tensor in states.items()}
            for index, states in engine.runner.recurrent_states.items()}


def check_two_ranks(model_dir: str, dtype: torch.dtype, preempt: bool) -> tuple[dict, dict]:
    """2 ranks = 1 rank = transformers (greedy, ``dtype``), with prefix hits (and, with
    ``preempt``, a cache too small for every request: preemption); return the 1-rank and
    the 2-rank engines' per-slot state shapes."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                                  attn_implementation="eager").eval()
    prompts = prompts_for(reference.config.get_text_config().vocab_size)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    options = dict(OPTIONS, dtype=str(dtype).removeprefix("torch."), max_num_seqs=NUM_SLOTS, block_size=BLOCK_SIZE,
                   max_model_len=64)
    one_rank = LLM(model_dir, **options)
    try:
        assert generate(one_rank, prompts) == expected
        whole = state_shapes(one_rank)
    finally:
        one_rank.close()
    if preempt:
        per_slot, per_block = rank_zero_bytes(model_dir, dtype)
        options["kv_cache_memory_bytes"] = NUM_BLOCKS * per_block + (NUM_SLOTS + NUM_SNAPSHOTS) * per_slot
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **options)
    processes = rank_processes(two_ranks)
    try:
        assert generate(two_ranks, prompts) == expected
        stats = two_ranks.llm_engine.stats()
        assert stats.prefix_cache_hit_rate
        assert stats.num_preemptions > 0 or not preempt
        split = state_shapes(two_ranks)
    finally:
        two_ranks.close()
    assert not any(process.is_alive() for process in processes)
    return whole, split


def test_gated_delta_net_split_on_two_ranks(tmp_path):
    """qwen3_5_text: each rank runs one of the 2 key heads and 2 of the 4 value heads; its
    state slots hold those heads' delta-rule matrices and convolution channels."""
    model_dir = str(build_tiny_model(tmp_path, "qwen3_5_text", **CASES["qwen3_5_text"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=True)
    assert set(split) == set(whole) == {0, 2}
    for index in whole:
        assert whole[index]["recurrent"] == (4, 16, 8) and split[index]["recurrent"] == (2, 16, 8)
        assert whole[index]["conv"] == (3, 96) and split[index]["conv"] == (3, 48)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "jamba",
                                  "zamba"])
def test_recurrent_mixers_split_on_two_ranks(tmp_path, arch):
    model_dir = str(build_tiny_model(tmp_path, arch, **CASES[arch]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=arch in ("bamba", "nemotron_h"))
    assert set(split) == set(whole)
    for index, shapes in whole.items():
        heads = shapes.get("recurrent", shapes.get("ssm"))
        assert heads is not None
        split_heads = split[index].get("recurrent", split[index].get("ssm"))
        assert split_heads == (heads[0] // 2, *heads[1:])  # half the heads per rank
        assert split[index]["conv"][1] < shapes["conv"][1]


def mixer_parts(arch: str, tmp_path, conv: str = "conv1d", **overrides) -> tuple[Any, list[Any]]:
    """A tiny ``arch`` model's first recurrent mixer, whole and as ranks 0 and 1 split it
    (transformers' module, the first whose ``conv`` is an nn.Conv1d: its attributes are
    read as the test needs them)."""
    model_dir = str(build_tiny_model(tmp_path, arch, **{**CASES[arch], **overrides}))
    models = [transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for _ in range(3)]
    for rank in (0, 1):
        shard_recurrent_mixers(models[rank + 1], RankGroup(rank, 2, lambda: "no collective runs here"))
    mixers = [next(module for module in model.modules() if isinstance(getattr(module, conv, None), nn.Conv1d))
              for model in models]
    return mixers[0], mixers[1:]


def test_shares_are_the_whole_mixer_parts(tmp_path):
    """Qwen3.5's gated delta-net and a Mamba-2 mixer with one group: the ranks' channels,
    heads and output columns joined give the whole mixer's; B and C are on both ranks."""
    whole, shares = mixer_parts("qwen3_5_text", tmp_path / "gdn")
    conv = torch.cat([share.conv1d.weight for share in shares])
    key_dim = whole.key_dim  # q | k | v channels: each rank's q, k and v in rank order
    order = torch.cat([torch.arange(0, key_dim // 2), torch.arange(key_dim, key_dim + key_dim // 2),
                       torch.arange(2 * key_dim, 2 * key_dim + whole.value_dim // 2)])
    assert torch.equal(conv[: conv.shape[0] // 2], whole.conv1d.weight[order])
    assert torch.equal(torch.cat([share.A_log for share in shares]), whole.A_log)
    assert torch.equal(torch.cat([share.in_proj_z.weight for share in shares]), whole.in_proj_z.weight)
    outs = [share.out_proj for share in shares]
    assert all(isinstance(out, RowParallelLinear) for out in outs)
    assert torch.equal(torch.cat([out.weight for out in outs], dim=1), whole.out_proj.weight)
    assert [share.num_v_heads for share in shares] == [2, 2] and shares[0].conv_dim == whole.conv_dim // 2

    whole, shares = mixer_parts("bamba", tmp_path / "bamba")
    inner, width = whole.intermediate_size, whole.n_groups * whole.ssm_state_size
    for rank, share in enumerate(shares):
        assert (share.num_heads, share.n_groups, share.intermediate_size) == (4, 1, inner // 2)
        b_and_c = share.conv1d.weight[inner // 2:]
        assert torch.equal(b_and_c, whole.conv1d.weight[inner:])  # the one group's B and C, on both ranks
        assert torch.equal(share.D, whole.D[rank * 4 : rank * 4 + 4])
        assert isinstance(share.norm, SpanningGatedNorm) and share.norm.group_size == inner
        gate_rows = share.in_proj.weight[: inner // 2]
        assert torch.equal(gate_rows, whole.in_proj.weight[rank * inner // 2 : (rank + 1) * inner // 2])
        assert share.in_proj.out_features == inner // 2 * 2 + 2 * width + 4


def test_channel_shares_keep_their_rows_in_each_part(tmp_path):
    """LFM2's in_proj (B | C | x) and Zamba's (x and gate interleaved per channel): each
    rank's rows are its channels' rows in every part, in the part's own order."""
    whole, shares = mixer_parts("lfm2", tmp_path / "lfm2", conv="conv")
    width = whole.conv.weight.shape[0]
    for rank, share in enumerate(shares):
        parts = whole.in_proj.weight.reshape(3, width, -1)[:, rank * width // 2 : (rank + 1) * width // 2]
        assert torch.equal(share.in_proj.weight, parts.reshape(-1, parts.shape[-1]))
        assert torch.equal(share.conv.weight, whole.conv.weight[rank * width // 2 : (rank + 1) * width // 2])
    whole, shares = mixer_parts("zamba", tmp_path / "zamba")
    width = whole.intermediate_size
    for rank, share in enumerate(shares):
        assert torch.equal(share.in_proj.weight, whole.in_proj.weight[rank * width : (rank + 1) * width])
        assert torch.equal(share.x_proj_weight, whole.x_proj_weight[rank : rank + 1])
        assert (share.n_mamba_heads, share.intermediate_size) == (1, width // 2)


def test_a_mixer_whose_heads_do_not_split_runs_whole(tmp_path, caplog):
    """3 key heads over 2 ranks: the gated delta-net keeps its whole parts, and the log says why."""
    with caplog.at_level(logging.INFO, logger="shardline.engine.parallel.recurrent"):
        whole, shares = mixer_parts("qwen3_5_text", tmp_path, linear_num_key_heads=3, linear_num_value_heads=3)
    for share in shares:
        assert share.num_k_heads == 3 and type(share.out_proj) is nn.Linear
        assert torch.equal(share.conv1d.weight, whole.conv1d.weight)
    assert "Qwen3_5GatedDeltaNet layers run whole on each of 2 ranks (its 3 key heads do not split over 2 ranks)" \
        in caplog.text


def test_short_conv_split_on_two_ranks(tmp_path):
    """lfm2: each rank runs half the short convolutions' channels (its state holds them)
    and half the attention heads, out_proj row-split in both."""
    model_dir = str(build_tiny_model(tmp_path, "lfm2", **CASES["lfm2"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    assert set(split) == set(whole) == {0, 2}
    for index in whole:
        assert whole[index]["conv"] == (2, 64) and split[index]["conv"] == (2, 32)


@pytest.mark.slow
def test_rwkv_split_on_two_ranks(tmp_path):
    """rwkv: each rank keeps half the time mix's WKV channels; the token shifts (over the
    hidden size) stay whole."""
    model_dir = str(build_tiny_model(tmp_path, "rwkv", **CASES["rwkv"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    for index, shapes in whole.items():
        assert split[index]["num"] == (shapes["num"][0] // 2,) and split[index]["att_shift"] == shapes["att_shift"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["kimi_linear", "bailing_hybrid"])
def test_kimi_delta_attention_split_on_two_ranks(tmp_path, arch):
    """Each rank keeps 2 of the 4 heads' delta-rule matrices and their q/k/v channels."""
    model_dir = str(build_tiny_model(tmp_path, arch, **CASES[arch]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    assert whole[0]["recurrent"] == (4, 16, 16) and split[0]["recurrent"] == (2, 16, 16)
    assert split[0]["conv"][1] * 2 == whole[0]["conv"][1]


@pytest.mark.slow
def test_lightning_attention_split_on_two_ranks(tmp_path):
    """minimax: each rank keeps 2 of the 4 heads' states; the norm over all heads sums
    its squares over ranks."""
    model_dir = str(build_tiny_model(tmp_path, "minimax", **CASES["minimax"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    assert whole[0]["kv"] == (4, 16, 16) and split[0]["kv"] == (2, 16, 16)


@pytest.mark.slow
def test_rg_lru_split_on_two_ranks(tmp_path):
    """recurrent_gemma: each rank keeps 2 of the RG-LRU's 4 heads, their 32 channels of
    state and convolution window."""
    model_dir = str(build_tiny_model(tmp_path, "recurrent_gemma", **CASES["recurrent_gemma"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    assert whole[0] == {"conv": (3, 64), "recurrent": (64,)} and split[0] == {"conv": (3, 32), "recurrent": (32,)}


@pytest.mark.slow
def test_mlstm_split_on_two_ranks(tmp_path):
    """xlstm: each rank keeps 2 of the 4 heads' matrix memories, normalisers and maxima."""
    model_dir = str(build_tiny_model(tmp_path, "xlstm", **CASES["xlstm"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    for index, shapes in whole.items():
        assert {name: shape[0] for name, shape in shapes.items()} == {"c": 4, "n": 4, "m": 4}
        assert split[index] == {name: (2, *shape[1:]) for name, shape in shapes.items()}


def test_a_mixer_run_whole_keeps_its_parts_from_the_name_rules():
    """Kimi delta attention with 3 heads over 2 ranks runs whole: its q/k/v_proj and o_proj
    (names the attention rules split) stay whole, while the MLA attention beside it splits."""
    config = tiny_config("kimi_linear", 512, **{**KDA, "linear_num_heads": 3})
    model = transformers.AutoModelForCausalLM.from_config(config)
    shard_model(model, RankGroup(0, 2, lambda: "no collective runs here"), num_attention_layers=1)
    mixer = model.get_submodule("model.layers.0.self_attn")
    assert mixer.num_heads == 3
    assert all(type(mixer.get_submodule(part)) is nn.Linear for part in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert mixer.q_proj.out_features == 48
    assert isinstance(model.get_submodule("model.layers.1.self_attn.o_proj"), RowParallelLinear)
