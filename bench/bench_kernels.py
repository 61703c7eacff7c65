"""GPU micro-benchmark of the Triton kernels: paged attention (decode, prefill) and KV store.

    python bench/bench_kernels.py [--head-dim 128] [--heads 32] [--kv-heads 8]

Prints time per call and the KV bytes read per second (the decode roofline is memory
bandwidth). Needs a CUDA GPU; it checks each kernel against its reference first.
"""

from __future__ import annotations

import argparse

import torch

from shardline.engine.kernels import (
    paged_attention,
    paged_attention_reference,
    store_kv_cache,
    triton_available,
)


def make_batch(context_lens, query_lens, args, device):
    """Random paged caches and queries; block ids shuffled across sequences."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // args.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    block_ids = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32,
                               device=device)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = block_ids[start:start + n]
        start += n
    cache_shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(cache_shape, dtype=args.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=args.dtype, device=device)
    q = torch.randn(sum(query_lens), args.heads, args.head_dim, dtype=args.dtype, device=device)
    query_start_loc = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, query_start_loc, seq_lens_t, block_tables), sum(seq_lens)


def bench_attention(name, context_lens, query_lens, args):
    import triton.testing

    batch, num_keys = make_batch(context_lens, query_lens, args, "cuda")
    scale = args.head_dim ** -0.5
    max_query_len = max(query_lens)
    out = paged_attention(*batch, scale, max_query_len=max_query_len)
    expected = paged_attention_reference(*batch, scale)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    ms = triton.testing.do_bench(
        lambda: paged_attention(*batch, scale, max_query_len=max_query_len))
    kv_bytes = 2 * num_keys * args.kv_heads * args.head_dim * batch[0].element_size()
    print(f"{name:<34} {ms * 1e3:9.1f} us  {kv_bytes / ms / 1e6:8.1f} GB/s of KV")


def bench_store(num_tokens, args):
    import triton.testing

    num_blocks = -(-num_tokens // args.block_size)
    k = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device="cuda")
    v = torch.randn_like(k)
    k_cache = torch.zeros(num_blocks, args.block_size, args.kv_heads, args.head_dim,
                          dtype=args.dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * args.block_size, device="cuda")[:num_tokens]
    ms = triton.testing.do_bench(lambda: store_kv_cache(k, v, k_cache, v_cache, slots))
    moved = 4 * k.numel() * k.element_size()  # read and write, k and v
    print(f"{f'store_kv_cache T={num_tokens}':<34} {ms * 1e3:9.1f} us  "
          f"{moved / ms / 1e6:8.1f} GB/s moved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("bench_kernels needs a CUDA GPU and triton")
    torch.manual_seed(0)
    bench_attention("decode 64 seqs x 1024 ctx", [1023] * 64, [1] * 64, args)
    bench_attention("decode 256 seqs x 2048 ctx", [2047] * 256, [1] * 256, args)
    bench_attention("prefill 8 x 1024 fresh", [0] * 8, [1024] * 8, args)
    bench_attention("prefill chunk 4 x 512 on 1536 ctx", [1536] * 4, [512] * 4, args)
    bench_attention("mixed 4 x 512 chunks + 128 decodes", [1536] * 4 + [1023] * 128,
                    [512] * 4 + [1] * 128, args)
    bench_store(8192, args)


if __name__ == "__main__":
    main()
