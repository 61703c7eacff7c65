"""Vectorised sampling for one step: logits of every sampling request at once.

Order of operations (vLLM's): a structured-output bitmask, when any row has one,
sets the tokens its grammar forbids to -inf; logprobs are taken from these logits
(the model's own where no row is restricted); then logit processors (allowed tokens,
logit bias, bad words, min_tokens, penalties), then greedy rows take the argmax and
random rows are tempered, truncated by top-k, top-p and min-p, and drawn by
inverse-CDF with one uniform per row. A seeded request draws its uniform from its
own generator, so its tokens do not depend on what else is in the batch.

A row is a sequence's SequenceRecord (sequences.py): its Request, params, generator,
per-token bans and its request's SamplingTraits, which say once per request whether
it draws at random, reads logprobs or has logit processors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sequences import SequenceRecord
from .structured import apply_token_bitmask

# One row's logprobs: (sampled token's logprob, [(token_id, logprob, rank), ...]).
TokenLogprobs = tuple[float, list[tuple[int, float, int]]]


@dataclass
class SamplerOutput:
    """One step's sampled tokens. ``token_ids`` [N] stays where the logits were; its
    host copy is started at once and ``host_token_ids`` waits for it, so the host can
    prepare the next step while the device still samples."""

    token_ids: torch.Tensor
    # Per row: its TokenLogprobs, or None where the row asks for none.
    logprobs: list[TokenLogprobs | None]
    # The host copy of token_ids (pinned on CUDA; token_ids itself on the CPU) and
    # the event that marks it filled (None on the CPU).
    host_ids: torch.Tensor
    copied: torch.cuda.Event | None = None

    @classmethod
    def start_copy(cls, token_ids: torch.Tensor, logprobs: list[TokenLogprobs | None]) -> SamplerOutput:
        if token_ids.device.type != "cuda":
            return cls(token_ids, logprobs, token_ids)
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(token_ids, logprobs, host_ids, copied)

    def host_token_ids(self) -> list[int]:
        """The sampled ids as a list; waits for the device to have sampled them."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_ids.tolist()


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SequenceRecord],
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [N, V] raw model logits, one row per entry of ``rows``; bitmask:
        [N, ceil(V / 32)] int32 allowed tokens (all bits set in unrestricted rows) or None."""
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.to(torch.float32)
        if bitmask is None and all(row.traits.argmax_only for row in rows):
            return SamplerOutput.start_copy(self._choose_tokens(logits, rows, []), [None] * len(rows))
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        want_logprobs = any(r.traits.wants_logprobs for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = apply_logit_processors(logits, rows)
        token_ids = self._choose_tokens(logits, rows, [i for i, r in enumerate(rows) if r.traits.is_random])
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, [r.params.logprobs for r in rows])
        return SamplerOutput.start_copy(token_ids, logprobs)

    def _choose_tokens(self, logits: torch.Tensor, rows: list[SequenceRecord], random_rows: list[int]) -> torch.Tensor:
        """Each row's token: the argmax, or a draw for the rows at ``random_rows``. Which
        rows draw is known on the host: deciding it from a device tensor would wait for
        the forward pass before any of the sampling is queued."""
        token_ids = greedy_tokens(logits)
        if not random_rows:
            return token_ids
        sub_rows = [rows[i] for i in random_rows]
        index = to_device(random_rows, torch.int64, logits.device)
        token_ids[index] = sample_random(logits[index], sub_rows, self._uniforms(sub_rows))
        return token_ids

    def _uniforms(self, rows: list[SequenceRecord]) -> torch.Tensor:
        shared = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        for i, row in enumerate(rows):
            if row.generator is not None:
                shared[i] = torch.rand(1, generator=row.generator, dtype=torch.float64)[0]
        return shared


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) ([N, V] -> [N] int64): the first index of each row's
    maximum, NaN counting as the maximum. On CPU through numpy's vectorised argmax,
    which returns the same indices several times faster than torch's over
    vocabulary-wide rows (bench/bench_host.py's token choice)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(logits.numpy(), axis=1))
    return logits.argmax(dim=-1)


def apply_logit_processors(logits: torch.Tensor, rows: list[SequenceRecord]) -> torch.Tensor:
    """Allowed tokens, logit bias, bad words, min_tokens and penalties. logits: [N, V].

    Per-row settings are gathered into flat (row, token) index lists first, so each
    processor is one indexed tensor operation over the whole batch."""
    if not any(row.traits.has_logit_processors or row.blocked_token_ids or row.banned_token_ids for row in rows):
        return logits
    vocab_size, device = logits.shape[1], logits.device
    allowed_rows, allowed_ids, bias_rows, bias_ids, bias_values, ban_rows, ban_ids = ([] for _ in range(7))
    for i, row in enumerate(rows):
        params = row.params
        if params.allowed_token_ids is not None:
            ids = [t for t in params.allowed_token_ids if t < vocab_size]
            allowed_rows += [i] * len(ids)
            allowed_ids += ids
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab_size]
            bias_rows += [i] * len(ids)
            bias_ids += ids
            bias_values += [params.logit_bias[t] for t in ids]
        banned = [t for t in row.blocked_token_ids + row.banned_token_ids if t < vocab_size]
        ban_rows += [i] * len(banned)
        ban_ids += banned
    if allowed_rows:
        keep = torch.ones_like(logits, dtype=torch.bool)
        restricted = sorted(set(allowed_rows))
        keep[restricted] = False
        keep[allowed_rows, allowed_ids] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if bias_rows:
        index = (to_device(bias_rows, torch.int64, device), to_device(bias_ids, torch.int64, device))
        logits = logits.index_put(index, to_device(bias_values, logits.dtype, device), accumulate=True)
    if ban_rows:
        index = (to_device(ban_rows, torch.int64, device), to_device(ban_ids, torch.int64, device))
        logits = logits.index_put(index, torch.full((), float("-inf"), dtype=logits.dtype, device=device))
    if any(row.traits.has_penalties for row in rows):
        logits = apply_penalties(logits, rows)
    return logits


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, copied without waiting for the device's
    queued work (a blocking copy would synchronise with the forward pass)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _token_keys(token_lists: list[list[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs of each row's list as flat keys row * V + token,
    sorted, with how often each occurs; ids past the vocabulary have no logit and are left out."""
    lengths = [len(tokens) for tokens in token_lists]
    if not sum(lengths):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ids = np.concatenate([np.asarray(tokens, dtype=np.int64) for tokens in token_lists if tokens])
    keys = np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab_size, lengths) + ids
    return np.unique(keys[(ids >= 0) & (ids < vocab_size)], return_counts=True)


def apply_penalties(logits: torch.Tensor, rows: list[SequenceRecord]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output tokens, presence and
    frequency over output tokens only. logits: [N, V] -> a new [N, V]."""
    params = [r.params for r in rows]
    return penalise(logits, [r.sequence.prompt_token_ids for r in rows], [r.sequence.output_token_ids for r in rows],
                    [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                    [p.presence_penalty for p in params])


def penalise(logits: torch.Tensor, prompt_tokens: list[list[int]], output_tokens: list[list[int]],
             repetition: list[float], frequency: list[float], presence: list[float]) -> torch.Tensor:
    """Row i's logits with repetition[i] applied at every token of its prompt and
    output, then frequency[i] times each output token's count and presence[i] once per
    output token subtracted. logits: [N, V] -> a new [N, V].

    Only the logits of tokens a row has seen are read and written (gathered by flat
    key, penalised, put back into one copy of the logits): no [N, V] count or mask
    tensor is built, which at a large vocabulary and batch would cost more than the
    rest of sampling."""
    num_rows, vocab_size = logits.shape
    dtype, device = logits.dtype, logits.device
    output_keys, output_counts = _token_keys(output_tokens, vocab_size)
    seen_keys = np.union1d(_token_keys(prompt_tokens, vocab_size)[0], output_keys)  # sorted, output keys among them
    penalised = logits.clone(memory_format=torch.contiguous_format)
    if not len(seen_keys):
        return penalised
    flat = penalised.view(num_rows * vocab_size)
    seen_rows = seen_keys // vocab_size
    counts = np.zeros(len(seen_keys), dtype=np.int64)
    counts[np.searchsorted(seen_keys, output_keys)] = output_counts
    rep, freq, pres, count = (torch.from_numpy(values).to(device=device, dtype=dtype, non_blocking=True)
                              for values in (np.asarray(repetition, dtype=np.float64)[seen_rows],
                                             np.asarray(frequency, dtype=np.float64)[seen_rows],
                                             np.asarray(presence, dtype=np.float64)[seen_rows], counts))
    index = torch.from_numpy(seen_keys).to(device, non_blocking=True)
    # The whole-vocabulary formulas, in the logits' dtype, at the seen tokens only
    # (elsewhere every term leaves the logit as it is).
    values = flat[index]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - freq * count
    values = values - pres * (count > 0).to(dtype)
    flat[index] = values
    return penalised


def sample_random(logits: torch.Tensor, rows: list[SequenceRecord], uniforms: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then inverse-CDF sampling. logits: [N, V]."""
    dtype = logits.dtype
    vocab_size = logits.shape[1]
    device = logits.device
    temperature = to_device([r.params.temperature for r in rows], dtype, device)[:, None]
    top_k = to_device([r.params.top_k or vocab_size for r in rows], torch.int64, device)[:, None]
    top_p = to_device([r.params.top_p for r in rows], dtype, device)[:, None]
    min_p = to_device([r.params.min_p for r in rows], dtype, device)[:, None]
    sorted_logits, sorted_ids = torch.sort(logits / temperature, dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (always the first token).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    outside = (mass_before >= top_p) | (probs < min_p * probs[:, :1])
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms.to(device=device, dtype=dtype, non_blocking=True)[:, None] * cdf[:, -1:]
    picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab_size - 1)
    # Never land on a zero-probability token through rounding at the cdf's end.
    last_kept = (probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    picks = torch.minimum(picks, last_kept)
    return sorted_ids.gather(1, picks).squeeze(1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row that asks (num_top not None): the chosen token's logprob, and the
    top-k entries (token_id, logprob, rank) followed by the chosen token's entry.
    logprobs: [N, V] log-softmax; token_ids: [N]; k = -1 means the whole vocabulary."""
    vocab_size = logprobs.shape[1]
    ks = [None if k is None else (vocab_size if k == -1 else k) for k in num_top]
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_k = max((k for k in ks if k is not None), default=0)
    top = logprobs.topk(max_k, dim=-1) if max_k else None
    chosen_list, ranks_list, ids_list = chosen[:, 0].tolist(), ranks.tolist(), token_ids.tolist()
    # [N, max_k] each; empty when no row asks for top entries (every k is 0).
    top_values: list[list[float]] = top.values.tolist() if top is not None else []
    top_ids: list[list[int]] = top.indices.tolist() if top is not None else []
    result: list[TokenLogprobs | None] = []
    for i, k in enumerate(ks):
        if k is None:
            result.append(None)
            continue
        entries = [(top_ids[i][j], top_values[i][j], j + 1) for j in range(k)]
        result.append((chosen_list[i], entries + [(ids_list[i], chosen_list[i], ranks_list[i])]))
    return result
