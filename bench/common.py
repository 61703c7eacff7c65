"""Shared pieces of the benchmarks: the random-weight model and the workload."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch
import transformers

from shardline.engine.tiny import build_tokenizer

# The speed issue's model: Llama-shaped, random weights, float32.
LLAMA_BENCH_CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1536, vocab_size=16384, max_position_embeddings=2048,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)


def build_bench_model(path: Path | None = None, **overrides) -> str:
    """Write the benchmark model (random weights) and a tokenizer; return its directory."""
    path = Path(path or tempfile.mkdtemp(prefix="shardline-bench-"))
    build_tokenizer(path)
    config = transformers.LlamaConfig(**{**LLAMA_BENCH_CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path))
    return str(path)


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def non_embedding_params(model: torch.nn.Module) -> int:
    embedding = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embedding


def peak_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """Best observed torch.mm FLOP/s on this machine's CPU: the roofline's peak."""
    import time

    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
