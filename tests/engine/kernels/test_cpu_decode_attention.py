"""The CPU paged decode attention (C, through ctypes) against the plain-torch reference."""

import dataclasses
import shutil
from typing import TypedDict

import pytest
import torch

from shardline.engine.kernels import paged_attention_reference
from shardline.engine.kernels.cpu_attention import decode_attention, decode_kernel_available

from ..cpu.paths_taken import taken_unless_forced_off
from .conftest import feature_options, make_paged_batch

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine uses its torch path")
# The kernel against its reference, built for each target in turn.
each_target = pytest.mark.usefixtures("kernel_target")

# bfloat16 is read into float32 and rounded once on the way out: one bfloat16 step.
class Tolerance(TypedDict):
    atol: float
    rtol: float


TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5), torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2)}


def run_kernel(batch, requests: list[int], scale: float, sliding_window=None, softcap=None, **features):
    q, k_cache, v_cache = batch.q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu()
    # rows the kernel must leave alone keep 7
    out = torch.full((*q.shape[:2], v_cache.shape[3]), 7.0, dtype=q.dtype)
    assert decode_kernel_available(k_cache, q.shape[1], v_cache.shape[3])
    decode_attention(q, k_cache, v_cache, batch.block_tables.cpu(), batch.seq_lens.cpu().long(),
                     batch.query_start_loc[:-1].cpu().long(), torch.tensor(requests, dtype=torch.int64),
                     out, scale, sliding_window, softcap, **features)
    return out


def reference(batch, scale: float, sliding_window=None, softcap=None, **features):
    if batch.q.dtype == torch.bfloat16:  # the exact answer for the stored bfloat16 values
        widened = dataclasses.replace(batch, q=batch.q.float(), k_cache=batch.k_cache.float(),
                                      v_cache=batch.v_cache.float())
        return reference(widened, scale, sliding_window, softcap, **features).to(torch.bfloat16)
    return paged_attention_reference(batch.q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), batch.block_tables.cpu(),
                                     scale, sliding_window, softcap, **features)


@each_target
@pytest.mark.parametrize("feature,dtype", [("sinks", torch.float64), ("alibi", torch.float64),
                                           ("chunked", torch.float64), ("all", torch.float64),
                                           ("all", torch.float32), ("all", torch.bfloat16)])
def test_attention_features(feature, dtype):
    """Sinks, ALiBi and chunked attention (engine/attention/context.py's AttentionOptions)."""
    batch = make_paged_batch([0, 4, 15, 16, 39, 90], [1] * 6, num_heads=8, num_kv_heads=2, block_size=8,
                             dtype=dtype)
    features = feature_options(feature, 8)
    out = run_kernel(batch, list(range(6)), 0.3, **features)
    torch.testing.assert_close(out, reference(batch, 0.3, **features), **TOLERANCE[dtype])


@each_target
@pytest.mark.parametrize("head_dim,value_head_dim,dtype", [(48, 32, torch.float64), (192, 128, torch.float32),
                                                           (64, 128, torch.bfloat16)])
def test_value_head_size_of_its_own(head_dim, value_head_dim, dtype):
    """Values of another head size than keys (multi-head latent attention's layout)."""
    batch = make_paged_batch([0, 7, 33, 70], [1] * 4, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                             value_head_dim=value_head_dim, dtype=dtype)
    out = run_kernel(batch, [0, 1, 2, 3], head_dim ** -0.5, sliding_window=40)
    torch.testing.assert_close(out, reference(batch, head_dim ** -0.5, 40), **TOLERANCE[dtype])


@each_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_decode_matches_reference(dtype, block_size, num_heads, num_kv_heads):
    context_lens = [0, 5, 16, 31, 100, 257]
    batch = make_paged_batch(context_lens, [1] * len(context_lens), num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size, dtype=dtype)
    out = run_kernel(batch, list(range(len(context_lens))), 0.17)
    torch.testing.assert_close(out, reference(batch, 0.17), **TOLERANCE[dtype])


@each_target
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_head_dims(head_dim, dtype):
    batch = make_paged_batch([3, 40, 77], [1, 1, 1], head_dim=head_dim, dtype=dtype)
    out = run_kernel(batch, [0, 1, 2], head_dim**-0.5)
    torch.testing.assert_close(out, reference(batch, head_dim**-0.5), **TOLERANCE[dtype])


@each_target
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_sliding_window_and_softcap(sliding_window, softcap, dtype):
    batch = make_paged_batch([0, 4, 15, 16, 39, 90], [1] * 6, block_size=8, dtype=dtype)
    out = run_kernel(batch, list(range(6)), 0.3, sliding_window, softcap)
    expected = reference(batch, 0.3, sliding_window, softcap)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@each_target
def test_only_listed_requests_are_written():
    """A mixed step: prefill chunks (several query tokens) are left to the torch path."""
    context_lens, query_lens = [10, 0, 33, 7], [1, 12, 1, 5]
    batch = make_paged_batch(context_lens, query_lens, dtype=torch.float64)
    out = run_kernel(batch, [0, 2], 0.125)
    expected = reference(batch, 0.125)
    starts = batch.query_start_loc.tolist()
    for request in (0, 2):
        torch.testing.assert_close(out[starts[request]], expected[starts[request]], **TOLERANCE[torch.float64])
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[[starts[0], starts[2]]] = False
    assert (out[untouched] == 7.0).all()


@each_target
def test_strided_query():
    """The engine hands the kernel q as a transposed view of [1, H, T, D]."""
    batch = make_paged_batch([20, 50], [1, 1], num_heads=4, num_kv_heads=2, dtype=torch.float32)
    expected = reference(batch, 0.2)
    batch.q = batch.q.cpu().transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D], H-major memory
    assert not batch.q.is_contiguous()
    torch.testing.assert_close(run_kernel(batch, [0, 1], 0.2), expected, **TOLERANCE[torch.float32])


def test_unsupported_shapes_fall_back():
    cache = torch.zeros(4, 16, 1, 512)  # head_dim 512 is past the kernel's limit
    assert not decode_kernel_available(cache, 1)
    assert not decode_kernel_available(torch.zeros(4, 16, 2, 64, dtype=torch.float16), 4)


def test_engine_without_a_compiler_uses_the_torch_path(tmp_path, tiny_llama_dir):
    """CC pointing at no compiler: a warning, no kernel, and the same greedy tokens."""
    import os
    import subprocess
    import sys

    script = (
        "from shardline import LLM, SamplingParams\n"
        "from shardline.engine.kernels import cpu_attention\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32')\n"
        "out = llm.generate({'prompt_token_ids': [5, 6, 7, 8]}, SamplingParams(max_tokens=6), use_tqdm=False)\n"
        "print(cpu_attention.load_library() is None, out[0].outputs[0].token_ids)\n"
    )
    runs = {}
    # Without a compiler, an empty cache (nothing built to load); with one, the suite's
    # cache, whose kernels the other tests have built already.
    for name, compiler, cache in (("none", "/nonexistent/cc", str(tmp_path / "none")),
                                  ("cc", os.environ.get("CC", "cc"), os.environ.get("SHARDLINE_CACHE_DIR"))):
        env = {**os.environ, "CC": compiler}
        env.pop("SHARDLINE_CACHE_DIR", None)
        env.update({"SHARDLINE_CACHE_DIR": cache} if cache else {})
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        runs[name] = result.stdout.strip().splitlines()[-1]
    assert runs["none"].startswith("True ") and runs["cc"].startswith("False ")
    assert runs["none"].split(" ", 1)[1] == runs["cc"].split(" ", 1)[1]


@each_target
@pytest.mark.parametrize("num_heads,num_kv_heads,num_requests", [(96, 3, 5), (64, 2, 1), (12, 3, 40), (5, 5, 2)])
def test_many_heads_per_item_and_odd_head_counts(num_heads, num_kv_heads, num_requests):
    """Work items split a request's KV heads by a divisor, within the kernel's per-item limit."""
    context_lens = [7 + 11 * r for r in range(num_requests)]
    batch = make_paged_batch(context_lens, [1] * num_requests, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=16, dtype=torch.float64)
    out = run_kernel(batch, list(range(num_requests)), 0.25)
    torch.testing.assert_close(out, reference(batch, 0.25), **TOLERANCE[torch.float64])


@taken_unless_forced_off("decode_kernel")
def test_bfloat16_engine_decodes_with_the_kernel(tiny_llama_dir, monkeypatch):
    """dtype bfloat16 on CPU: decode steps go through the native kernel (not the torch
    gather path), and greedy tokens agree with the torch path's on this model."""
    from shardline import LLM, SamplingParams
    from shardline.engine.kernels import cpu_attention

    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(3, 40))}]
    llm = LLM(tiny_llama_dir, dtype="bfloat16")
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    assert calls and set(calls) == {torch.bfloat16}
    calls.clear()
    llm = LLM(tiny_llama_dir, dtype="bfloat16", attention_backend="torch")
    torch_path = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    assert not calls and native == torch_path



def check_contexts_past_one_chunk(dtype, block_size, num_heads, num_kv_heads, head_dim=64):
    context_lens = [0, 7, 130, 600, 1500]
    batch = make_paged_batch(context_lens, [1] * len(context_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=dtype)
    requests = list(range(len(context_lens)))
    for window, features in ((None, {}), (300, {}), (None, {**feature_options("all", num_heads), "chunk_size": 700})):
        out = run_kernel(batch, requests, 0.125, window, **features)
        torch.testing.assert_close(out, reference(batch, 0.125, window, **features), **TOLERANCE[dtype])


@each_target
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 1, 64), (6, 2, 128)])
def test_contexts_past_one_chunk(num_heads, num_kv_heads, head_dim):
    """Head sizes 64 and 128, which the kernel attends in chunks of 8192 scores over an
    item's query rows (cpu_decode_chunked.h: 1024 keys for 8 rows, 256 for 32; float32
    on every build, bfloat16 on 8-lane ones): contexts of
    several chunks, a window and attention chunks that start inside one, sinks and
    ALiBi carried across them, odd query heads per KV head; each call reads more than
    1 MiB of keys and values (CACHED_CALL_BYTES), so its L2 prefetches run."""
    check_contexts_past_one_chunk(torch.float32, 16, num_heads, num_kv_heads, head_dim)


@each_target
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_bfloat16_items_by_block_size(head_dim, block_size):
    """bfloat16 at head sizes 64 and 128 takes the vector item for blocks of up to 16
    keys on 16-lane builds and the chunked one past them (on 8-lane builds, the chunked
    one at every size): contexts of several chunks, windows, sinks, ALiBi and attention
    chunks at each."""
    check_contexts_past_one_chunk(torch.bfloat16, block_size, 8, 2, head_dim)


@pytest.mark.slow
@each_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 2), (6, 2), (32, 1)])
def test_contexts_past_one_chunk_every_block_size(dtype, block_size, num_heads, num_kv_heads):
    """test_contexts_past_one_chunk in bfloat16 too and at every block size."""
    check_contexts_past_one_chunk(dtype, block_size, num_heads, num_kv_heads)
