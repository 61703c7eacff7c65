"""Two gloo ranks on CPU give one rank's (and transformers') greedy tokens, through chunked
prefill, preemption and prefix hits; a rank that dies or stops answering fails the step
with an error naming it, and no rank process outlives its engine."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.group import TensorParallelError
from shardline.engine.parallel.layers import GatheredLMHead, ReducedOutput, RowParallelLinear, VocabParallelEmbedding

from ..hf_reference import hf_greedy, random_prompts

MAX_TOKENS = 12
GDN = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
           layer_types=["linear_attention", "full_attention", "linear_attention"])
MLA = dict(num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=24,
           q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=1, topk_group=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Engine options for every case: steps of 16 tokens cut the longer prompts into chunks.
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)


def prompts_for(vocab_size: int) -> list[list[int]]:
    """Eight prompts: three sharing a 32-token prefix (two blocks: prefix hits) and five
    of their own, 4 to 44 tokens long."""
    shared = random_prompts(3, (9, 12), vocab_size, seed=1, shared_prefix=32)
    return shared + random_prompts(5, (4, 12), vocab_size, seed=2)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def check_against_one_rank(model_dir: str, kv_bytes_per_rank: int | None = None,
                           reference_dtype: torch.dtype = torch.float64) -> LLM:
    """Generate with 2 ranks and with 1; assert the same tokens, transformers' own (in
    ``reference_dtype``), and that prompts decide them; return the 2-rank engine (open)
    for further checks."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=reference_dtype, attn_implementation="eager").eval()
    prompts = prompts_for(reference.config.get_text_config().vocab_size)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    one_rank = LLM(model_dir, **OPTIONS)
    try:
        assert generate(one_rank, prompts) == expected
    finally:
        one_rank.close()
    options = dict(OPTIONS, kv_cache_memory_bytes=kv_bytes_per_rank) if kv_bytes_per_rank else OPTIONS
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **options)
    try:
        assert generate(two_ranks, prompts) == expected
    except BaseException:
        two_ranks.close()
        raise
    return two_ranks


def rank_processes(llm: LLM) -> list:
    followers = llm.llm_engine.runner.followers
    assert followers is not None
    return list(followers.processes)


def assert_closed(llm: LLM, processes: list) -> None:
    llm.close()
    assert not any(process.is_alive() for process in processes)


def test_dense_model_on_two_ranks(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    # 8 blocks of 16 tokens per rank (each holds one of the two key-value heads): the
    # eight requests growing by 12 tokens cannot all stay, so some are preempted.
    block_bytes = 2 * 16 * 1 * (16 + 16) * 4
    llm = check_against_one_rank(model_dir, kv_bytes_per_rank=8 * block_bytes)
    processes = rank_processes(llm)
    engine = llm.llm_engine
    model = engine.runner.model
    kinds = {type(module) for module in model.modules()}
    assert {RowParallelLinear, VocabParallelEmbedding, GatheredLMHead} <= kinds
    assert engine.runner.kv_caches[0][0].shape[2] == 1  # one of the model's 2 key-value heads per rank
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate
    assert_closed(llm, processes)


def test_mla_and_experts_on_two_ranks(tmp_path):
    """deepseek_v3: latent attention with heads split, routed experts split over their
    intermediate size, shared experts and the dense first layer split as MLPs."""
    model_dir = str(build_tiny_model(tmp_path, "deepseek_v3", **MLA))
    # transformers' grouped expert kernel takes no float64
    llm = check_against_one_rank(model_dir, reference_dtype=torch.float32)
    processes = rank_processes(llm)
    kinds = {type(module) for module in llm.llm_engine.runner.model.modules()}
    assert {RowParallelLinear, ReducedOutput, GatheredLMHead} <= kinds
    assert_closed(llm, processes)


@pytest.mark.slow
def test_moe_model_on_two_ranks(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "qwen2_moe", **MOE))
    llm = check_against_one_rank(model_dir, reference_dtype=torch.float32)
    assert_closed(llm, rank_processes(llm))


@pytest.mark.slow
def test_hybrid_model_on_two_ranks(tmp_path):
    """qwen3_5_text: attention, MLPs and the gated delta-net layers' heads split
    (tests/engine/parallel/test_tp_recurrent.py checks the state each rank keeps)."""
    model_dir = str(build_tiny_model(tmp_path, "qwen3_5_text", **GDN))
    llm = check_against_one_rank(model_dir)
    assert_closed(llm, rank_processes(llm))


@pytest.mark.slow
def test_key_value_heads_fewer_than_ranks(tmp_path):
    """One key-value head: each rank holds it beside its half of the query heads."""
    model_dir = str(build_tiny_model(tmp_path, "llama", num_key_value_heads=1))
    llm = check_against_one_rank(model_dir)
    assert llm.llm_engine.runner.kv_caches[0][0].shape[2] == 1
    assert_closed(llm, rank_processes(llm))


def generate_in_thread(llm: LLM, timeout: float) -> BaseException | None:
    """Run a generate call with a bound on how long it may take; return what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            generate(llm, [[5, 6, 7, 8]])
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"generate still waiting after {timeout} s: the group hangs"
    return raised[0] if raised else None


def test_a_killed_rank_fails_the_step_naming_it(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    processes = rank_processes(llm)
    assert generate(llm, [[5, 6, 7, 8]])
    os.kill(processes[0].pid, signal.SIGKILL)
    processes[0].join(30)
    error = generate_in_thread(llm, timeout=120)
    assert isinstance(error, TensorParallelError)
    assert f"rank 1 (pid {processes[0].pid}) exited with code -9" in str(error)
    # The group stays failed: the next call fails at once with the same reason.
    again = generate_in_thread(llm, timeout=120)
    assert isinstance(again, TensorParallelError) and "exited with code -9" in str(again)
    assert_closed(llm, processes)


@pytest.mark.slow
def test_a_rank_that_stops_answering_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_TP_TIMEOUT_S", "20")
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    processes = rank_processes(llm)
    os.kill(processes[0].pid, signal.SIGSTOP)
    try:
        error = generate_in_thread(llm, timeout=180)
    finally:
        os.kill(processes[0].pid, signal.SIGCONT)
    assert isinstance(error, TensorParallelError)
    assert "stopped answering" in str(error)
    assert_closed(llm, processes)



@pytest.mark.slow
def test_a_forward_that_fails_on_rank_0_fails_the_group(tmp_path):
    """Rank 0's forward raising part-way leaves rank 1 inside the step's collectives: later
    steps must not run out of step with it, so they raise."""
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    processes = rank_processes(llm)

    def fail(module, args, output):
        raise RuntimeError("a failure on rank 0 alone")

    layers = llm.llm_engine.runner.model.model.layers
    hook = layers[1].register_forward_hook(fail)
    error = generate_in_thread(llm, timeout=120)
    assert isinstance(error, RuntimeError) and "a failure on rank 0 alone" in str(error)
    hook.remove()
    again = generate_in_thread(llm, timeout=120)
    assert isinstance(again, TensorParallelError)
    assert "rank 0's forward raised RuntimeError: a failure on rank 0 alone" in str(again)
    assert_closed(llm, processes)
