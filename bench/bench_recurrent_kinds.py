"""Recurrent layer kinds against their Hugging Face modules, one layer at the Llama
benchmark's width (hidden 512), float32, CPU: a packed prefill of several prompts in
one call against the module run on each prompt alone, and a decode step of many
requests in one call against the module's batched single-token step.

    python bench/bench_recurrent_kinds.py [--prompts 4] [--prompt-len 256] [--decode-batch 32]
                                          [--delta-chunks 8,16,32,64] [--core-only]

Prints milliseconds per call and tokens per second for each side and their ratio,
then the chunked gated delta rule (engine/recurrent/delta_rule.py) at each of
``--delta-chunks`` chunk sizes on a packed prefill of prompts of 32-512 tokens
(qwen3_5's 8 value heads of 64; the thread's CPU time, best of 5), and the gated
delta-net's whole recurrent core through the CPU kernel against its torch path.
Not a test: the numbers depend on the machine (and, on a shared one, on its load).
"""

from __future__ import annotations

import argparse
import functools
import random
import time

import torch
import transformers
from transformers import DynamicCache

from shardline.engine.kernels.recurrent_reference import l2_normalize
from shardline.engine.recurrent.delta_rule import chunk_gated_delta_rule_varlen
from shardline.engine.recurrent.gated_delta_net import GATED_DELTA_NET
from shardline.engine.recurrent.kda import KIMI_DELTA
from shardline.engine.recurrent.linear_attention import LIGHTNING
from shardline.engine.recurrent.mamba import MAMBA
from shardline.engine.recurrent.mamba2 import MAMBA2

HIDDEN = 512


def _layers():
    """(name, kind, HF module, config, whether the module takes a DynamicCache)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    from transformers.models.mamba.modeling_mamba import MambaMixer
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    mamba2 = transformers.Mamba2Config(hidden_size=HIDDEN, num_heads=16, head_dim=64, expand=2, state_size=64,
                                       n_groups=1, num_hidden_layers=1)
    mamba = transformers.MambaConfig(hidden_size=HIDDEN, intermediate_size=1024, state_size=16, num_hidden_layers=1)
    minimax = transformers.MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=8, head_dim=64, num_hidden_layers=2,
                                         layer_types=["linear_attention", "full_attention"])
    kimi = transformers.KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=8, linear_head_dim=64,
                                         num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return [
        ("mamba2", MAMBA2, Mamba2Mixer(mamba2, 0), mamba2, True),
        ("mamba", MAMBA, MambaMixer(mamba, 0), mamba, True),
        ("minimax lightning", LIGHTNING, MiniMaxLightningAttention(minimax, 0), minimax, False),
        ("kimi delta", KIMI_DELTA, KimiLinearDeltaAttention(kimi, 0), kimi, True),
    ]


def _timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _hf_call(module, x, cache):
    if cache is None:
        return module(x, position_embeddings=None, attention_mask=None)
    return module(x, cache=cache)


def bench_layer(name, kind, module, config, takes_cache, prompts: int, prompt_len: int, decode_batch: int) -> None:
    module = module.eval()
    gen = torch.Generator().manual_seed(0)
    shapes = kind.state_shapes(module, config)

    def fresh_states(batch):
        return {n: torch.zeros((batch, *shape), dtype=dtype) for n, (shape, dtype) in shapes.items()}

    x = torch.randn(prompts, prompt_len, HIDDEN, generator=gen)
    cu = torch.arange(prompts + 1) * prompt_len
    fresh = torch.zeros(prompts, dtype=torch.bool)
    with torch.no_grad():
        ours = _timed(lambda: kind.forward(module, x.reshape(-1, HIDDEN), cu, fresh, fresh_states(prompts)))
        theirs = _timed(lambda: [_hf_call(module, x[i : i + 1], DynamicCache(config=config) if takes_cache else None)
                                 for i in range(prompts)])
    tokens = prompts * prompt_len
    print(f"{name:18s} prefill {prompts}x{prompt_len}: shardline {ours * 1e3:8.1f} ms ({tokens / ours:9.0f} tok/s)  "
          f"HF per prompt {theirs * 1e3:8.1f} ms ({tokens / theirs:9.0f} tok/s)  ratio {theirs / ours:5.2f}")

    if not takes_cache:  # MiniMax keeps its decode state in its own cache class
        return
    step = torch.randn(decode_batch, HIDDEN, generator=gen)
    cu = torch.arange(decode_batch + 1)
    continuing = torch.ones(decode_batch, dtype=torch.bool)
    states = fresh_states(decode_batch)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        _hf_call(module, torch.randn(decode_batch, 4, HIDDEN, generator=gen), cache)  # HF's prefill fills its cache
        ours = _timed(lambda: kind.forward(module, step, cu, continuing, states), repeats=10)
        theirs = _timed(lambda: _hf_call(module, step[:, None], cache), repeats=10)
    print(f"{name:18s} decode {decode_batch} requests: shardline {ours * 1e3:6.2f} ms  "
          f"HF batched {theirs * 1e3:6.2f} ms  ratio {theirs / ours:5.2f}")


def bench_delta_chunks(chunk_sizes: list[int], num_prompts: int = 8, heads: int = 8, head_dim: int = 64) -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    lengths = [rng.randint(32, 512) for _ in range(num_prompts)]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    tokens = int(cu[-1])
    query, key = (l2_normalize(torch.randn(tokens, heads, head_dim, generator=gen)) for _ in range(2))
    value = torch.randn(tokens, heads, head_dim, generator=gen)
    g, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads, generator=gen)
    for size in chunk_sizes:
        best = float("inf")
        for _ in range(5):
            state = torch.zeros(num_prompts, heads, head_dim, head_dim)
            start = time.thread_time()
            chunk_gated_delta_rule_varlen(query * head_dim ** -0.5, key, value, g, beta, cu, state, chunk_size=size)
            best = min(best, time.thread_time() - start)
        print(f"gated delta rule, chunks of {size:3d}: {best * 1e3:7.1f} ms for {tokens} tokens "
              f"({tokens / best:8.0f} tok/s)")


def bench_gated_delta_core(num_prompts: int = 32, decode_batch: int = 32) -> None:
    """The gated delta-net's recurrent core (convolution, l2 norms, delta rule) at the
    hybrid benchmark's heads: the CPU kernel (kernels/cpu_recurrent.py) against the
    torch path, on a packed prefill of prompts of 32-512 tokens and a decode step; one
    thread, timed by its CPU time, best of 5 interleaved runs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from shardline.engine.kernels.cpu_recurrent import delta_rule_core, recurrent_kernel_available
    from shardline.engine.recurrent.gated_delta_net import _torch_core

    if not recurrent_kernel_available(torch.float32, 64, 64):
        print("gated delta-net core: the recurrent kernel cannot be built here")
        return
    config = transformers.Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_key_heads=4, linear_num_value_heads=8,
                                            linear_key_head_dim=64, linear_value_head_dim=64, num_hidden_layers=1,
                                            linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    module = Qwen3_5GatedDeltaNet(config, 0).eval()
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for name, lengths, continuing in (("prefill", [rng.randint(32, 512) for _ in range(num_prompts)], False),
                                      ("decode", [1] * decode_batch, True)):
        tokens, heads = sum(lengths), module.num_v_heads
        mixed = torch.randn(tokens, module.conv_dim, generator=gen)
        g, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads, generator=gen)
        cu = torch.tensor([0, *lengths]).cumsum(0)
        flags = torch.full((len(lengths),), continuing)
        states = {n: torch.zeros((len(lengths), *shape), dtype=dtype)
                  for n, (shape, dtype) in GATED_DELTA_NET.state_shapes(module, config).items()}
        runs = {"kernel": functools.partial(delta_rule_core, mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias,
                                            g, beta, cu, flags, states["conv"], states["recurrent"],
                                            module.num_k_heads),
                "torch": functools.partial(_torch_core, module, mixed, g, beta, cu, flags, states)}
        best = dict.fromkeys(runs, float("inf"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(5):
                for side, run in runs.items():
                    start = time.thread_time()
                    run()
                    best[side] = min(best[side], time.thread_time() - start)
        finally:
            torch.set_num_threads(threads)
        print(f"gated delta-net core, {name} of {tokens} tokens: kernel {best['kernel'] * 1e3:7.2f} ms, "
              f"torch {best['torch'] * 1e3:7.2f} ms ({best['torch'] / best['kernel']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--delta-chunks", default="8,16,32,64", help="chunk sizes of the delta-rule sweep")
    parser.add_argument("--core-only", action="store_true",
                        help="only the gated delta-net core's kernel and torch path")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, hidden {HIDDEN}")
    if args.core_only:
        with torch.inference_mode():
            bench_gated_delta_core()
        return
    for layer in _layers():
        bench_layer(*layer, args.prompts, args.prompt_len, args.decode_batch)
    with torch.inference_mode():
        bench_delta_chunks([int(size) for size in args.delta_chunks.split(",")])
        bench_gated_delta_core()


if __name__ == "__main__":
    main()
