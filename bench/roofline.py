"""The roofline a generate run cannot beat on this host: each step's time is at least
the bytes it must read over the memory bandwidth, and at least its arithmetic over the
matmul peak. A run's bound is the sum over its steps.

The steps are those of an ideal schedule of the workload: every prompt prefilled
(compute: the linears of every prompt token, the causal attention; the last layer
projects only keys and values for rows that sample nothing, and the LM head runs at
sampled rows only, as the engine does), then the sequences decode together in waves
of at most ``max_num_seqs``, each decode step reading every weight once plus the keys
and values of every sequence's context (its prompt and the tokens decoded so far).
The first output token comes from the prefill, so a sequence decodes ``output_len - 1``
steps. Embedding rows, norms and KV writes are left out: the bound stays a lower bound.

The roofline lets a decode step's reads of the KV cache overlap the linears'
arithmetic. A thread that runs the attention and the linears one after the other
cannot: its bound (``in_turn_s``) gives each decode step its KV bytes over the
bandwidth plus the larger of its weight bytes over the bandwidth and its arithmetic
over the peak. The ratio of the two bounds is the roofline share such a run reaches
with every part at its own limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-shaped decoder the roofline counts."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> ModelShape:
        """The shape of a transformers Llama-family config, its weights in ``dtype``."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size,
                   torch.finfo(dtype).bits // 8)

    @property
    def kv_params(self) -> int:
        """One layer's key and value projection weights."""
        return 2 * self.hidden_size * self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One layer's linear weights: q, k, v, o and the gated MLP."""
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim + self.kv_params
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads of the weights: every layer's linears and the LM head."""
        return (self.num_layers * self.layer_params + self.head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, num_queries: int, context: int) -> int:
        """Scores and weighted values of ``num_queries`` rows over ``context`` keys, one layer."""
        return 4 * self.num_heads * self.head_dim * num_queries * context

    def prefill_flops(self, prompt_len: int) -> int:
        """A prompt's prefill: every layer's linears and causal attention for each token but
        the last layer's, which projects keys and values only except at the sampled last
        row; the LM head at that row."""
        n = prompt_len
        layers = (self.num_layers - 1) * (2 * self.layer_params * n + 2 * self.num_heads * self.head_dim * n * (n + 1))
        last = 2 * self.kv_params * n + 2 * (self.layer_params - self.kv_params) + self.attention_flops(1, n)
        return layers + last + 2 * self.head_params

    def decode_step(self, contexts: list[int]) -> tuple[int, int]:
        """(bytes read, flops) of one decode step of sequences whose contexts (keys read,
        the new token's included) are ``contexts``."""
        rows = len(contexts)
        total_context = sum(contexts)
        read = self.weight_bytes + self.kv_bytes_per_token * total_context
        flops = 2 * (self.num_layers * self.layer_params + self.head_params) * rows
        return read, flops + self.num_layers * self.attention_flops(1, total_context)


@dataclass(frozen=True)
class Roofline:
    """A run's lower bound in seconds, split by what bounds it."""

    prefill_s: float  # compute-bound prefill
    decode_memory_s: float  # decode steps bound by their reads
    decode_compute_s: float  # decode steps bound by their arithmetic
    decode_bytes: int  # bytes every decode step together reads
    in_turn_s: float  # the whole run with each decode step's KV reads after its linears, not overlapped

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_memory_s + self.decode_compute_s

    def describe(self) -> str:
        return (f"prefill {self.prefill_s:.2f} s compute-bound, decode {self.decode_memory_s:.2f} s memory-bound "
                f"+ {self.decode_compute_s:.2f} s compute-bound ({self.decode_bytes / 1e9:.1f} GB read)")


def roofline(shape: ModelShape, prompt_lens: list[int], output_len: int, max_num_seqs: int,
             bandwidth: float, peak_flops: float) -> Roofline:
    """The bound of generating ``output_len`` tokens after each prompt (see the module
    docstring); ``bandwidth`` in bytes/s, ``peak_flops`` in FLOP/s."""
    prefill_s = sum(shape.prefill_flops(n) for n in prompt_lens) / peak_flops
    memory_s = compute_s = in_turn_s = 0.0
    decode_bytes = 0
    for start in range(0, len(prompt_lens), max_num_seqs):
        wave = prompt_lens[start : start + max_num_seqs]
        for step in range(1, output_len):
            read, flops = shape.decode_step([n + step for n in wave])
            decode_bytes += read
            if read / bandwidth >= flops / peak_flops:
                memory_s += read / bandwidth
            else:
                compute_s += flops / peak_flops
            kv_read = read - shape.weight_bytes
            in_turn_s += kv_read / bandwidth + max(shape.weight_bytes / bandwidth, flops / peak_flops)
    return Roofline(prefill_s, memory_s, compute_s, decode_bytes, prefill_s + in_turn_s)


def memory_bandwidth(clock, size_bytes: int = 512 << 20, repeats: int = 4) -> dict[str, float]:
    """Best observed bytes/s of streaming a ``size_bytes`` buffer (far past the caches)
    by ``clock``: a read (a sum over it) and a copy (its bytes read plus written)."""
    source = torch.ones(size_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # both buffers' pages touched before timing
    candidates = {"read": (lambda: source.sum(), size_bytes), "copy": (lambda: target.copy_(source), 2 * size_bytes)}
    best: dict[str, float] = {}
    for name, (stream, moved) in candidates.items():
        stream()
        seconds = float("inf")
        for _ in range(repeats):
            start = clock()
            stream()
            seconds = min(seconds, clock() - start)
        best[name] = moved / seconds
    return best
