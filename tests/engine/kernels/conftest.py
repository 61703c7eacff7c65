"""Kernel tests run on CPU tensors through Triton's interpreter, or, on a machine
with CUDA, on the GPU with the kernels compiled (same tests, tensors on DEVICE).

TRITON_INTERPRET must be set before triton is first imported: triton.jit reads it
when a function is decorated, and triton's own library functions (tl.sum, tl.max,
...) are decorated at triton's import. So it is set here, at collection time. If
something imported triton earlier (transformers and torch._dynamo do), the
interpreter cannot be enabled any more and the kernel tests fail saying so; the
fix is to set the variable in a conftest nearer the root, or in the environment.
"""

import os
import sys
from pathlib import Path

import torch  # noqa: E402  (importing torch does not import triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_IMPORTED_TOO_EARLY = (DEVICE == "cpu" and "triton" in sys.modules
                             and os.environ.get("TRITON_INTERPRET") != "1")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _require_interpreter():
    if TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before tests/engine/kernels/conftest.py could set "
                    "TRITON_INTERPRET=1; set it in tests/conftest.py or the environment")


@dataclass
class PagedBatch:
    """A packed batch whose keys and values are already in a paged cache."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                self.block_tables)


def make_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    value_head_dim: int | None = None,
) -> PagedBatch:
    """Sequences with context_lens[b] cached tokens and query_lens[b] new ones.

    Block ids are shuffled (no sequence owns a contiguous run), and every cache slot
    that belongs to no sequence holds NaN, so a kernel reading one fails loudly.
    Values have ``value_head_dim`` per head (default head_dim).
    """
    value_head_dim = value_head_dim or head_dim
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq) + 1
    # Unused table entries point far outside the cache: reading one would fault.
    block_tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full((*cache_shape[:3], value_head_dim), float("nan"))
    for seq, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        owned, block_ids = block_ids[:n_blocks], block_ids[n_blocks:]
        block_tables[seq, :n_blocks] = torch.tensor(owned, dtype=torch.int32)
        for pos in range(seq_len):
            block, offset = owned[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
            v_cache[block, offset] = torch.randn(num_kv_heads, value_head_dim, generator=generator)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return PagedBatch(
        q=q.to(DEVICE, dtype),
        k_cache=k_cache.to(DEVICE, dtype),
        v_cache=v_cache.to(DEVICE, dtype),
        query_start_loc=query_start_loc.to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
    )


@pytest.fixture
def paged_batch():
    """Factory: paged_batch(context_lens, query_lens, **shape) -> PagedBatch."""
    return make_paged_batch


def feature_options(feature: str | None, num_heads: int) -> dict:
    """One attention feature's options (engine/attention/context.py's AttentionOptions
    fields), large enough to change every output: sink logits around the scores'
    size, ALiBi slopes of the usual geometric series, chunks that cut the longer
    contexts; "all" combines them."""
    generator = torch.Generator().manual_seed(7)
    if feature is None:
        return {}
    if feature == "sinks":
        return dict(sinks=(torch.randn(num_heads, generator=generator) * 2).to(DEVICE))
    if feature == "alibi":
        return dict(alibi_slopes=(2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads)).to(DEVICE))
    if feature == "chunked":
        return dict(chunk_size=12)
    if feature == "all":
        return {**feature_options("sinks", num_heads), **feature_options("alibi", num_heads), "chunk_size": 20}
    raise ValueError(f"unknown feature {feature!r}")


FEATURES = ["sinks", "alibi", "chunked", "all"]
# Each feature alone in float32, all of them together in float32 and bfloat16.
FEATURE_DTYPES = [("sinks", torch.float32), ("alibi", torch.float32), ("chunked", torch.float32),
                  ("all", torch.float32), ("all", torch.bfloat16)]


def _instruction_macros(compiler: str, target: str) -> frozenset[str]:
    """The compiler's predefined macros for ``-march=target`` among those the C
    kernels' sources name (their instruction set branches)."""
    import re
    import subprocess

    from shardline.engine.kernels import native

    named = set()
    for source in Path(native.__file__).parent.glob("*.[ch]"):
        named.update(re.findall(r"\b(__[A-Z0-9_]+__)\b", source.read_text()))
    result = subprocess.run([compiler, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull],
                            capture_output=True, text=True)
    return frozenset(named.intersection(re.findall(r"^#define (\w+)", result.stdout, flags=re.MULTILINE)))


def _kernel_targets() -> list[str]:
    """The host's own target, and narrower ones this compiler builds for the host's
    architecture: AVX2 (x86-64-v3) and the SSE2 baseline on x86, plain ARMv8 on ARM. A
    narrower target whose instruction macros equal the host's own (x86-64-v3 on an
    AVX2-only host) compiles the same code paths and is left out."""
    import platform

    from shardline.engine.kernels import native

    narrower = {"x86_64": ["x86-64-v3", "x86-64"], "aarch64": ["armv8-a"]}.get(platform.machine(), [])
    compiler = native._compiler()
    if compiler is None:
        return ["native"]
    own = _instruction_macros(compiler, "native")
    return ["native"] + [target for target in narrower
                         if native.compiler_vector_isa(compiler, target) != "scalar"
                         and _instruction_macros(compiler, target) != own]


@pytest.fixture(params=_kernel_targets())
def kernel_target(request, monkeypatch) -> str:
    """Every test using it runs with the C kernels built for each target in turn
    (SHARDLINE_CPU_TARGET), so the code paths of narrower hosts are tested here too."""
    monkeypatch.setenv("SHARDLINE_CPU_TARGET", request.param)
    return request.param
