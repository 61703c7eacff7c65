"""Run a recurrent kind over packed steps and its Hugging Face module on each sequence
alone, so tests can compare outputs and final states.

A schedule is a list of steps; a step is a list of (sequence index, token count):
each sequence's tokens are taken in order, and a sequence's state is carried from
the step that last ran it, as the engine's slots carry it. States of sequences that
have not started are filled with a large value, so a read that should not happen
shows in the output.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

UNSET = 1.0e6


def randomize(module: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """float64, weights N(0, std) (norm weights 1 + N(0, std)), so outputs depend on context."""
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype) * std
            param.copy_(noise + 1.0 if "norm" in name else noise)
    return module.eval()


def hf_reference(module, config, sequence: torch.Tensor, layer_idx: int, **kwargs):
    """The HF module on one sequence [L, hidden] with a fresh cache: (output [L, hidden], cache)."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = module(sequence[None], cache=cache, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return out[0], cache


def run_schedule(kind, module, config, sequences: list[torch.Tensor], schedule,
                 prompt_len: int | None = None) -> tuple[list, list]:
    """Run ``schedule`` through ``kind``; return each sequence's output [L, hidden] and final states.
    ``prompt_len``: each sequence's first tokens that are its prompt (the rest generated),
    told to a kind that reads it as the runner tells it."""
    shapes = kind.state_shapes(module, config)
    states = [
        {name: torch.full(shape, UNSET, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        for _ in sequences
    ]
    consumed = [0] * len(sequences)
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        chunks = [sequences[i][consumed[i] : consumed[i] + n] for i, n in step]
        assert all(len(c) == n for c, (_, n) in zip(chunks, step)), "schedule runs past a sequence"
        cu_seqlens = torch.tensor([0] + [n for _, n in step]).cumsum(0)
        has_initial_state = torch.tensor([consumed[i] > 0 for i, _ in step])
        gathered = {name: torch.stack([states[i][name] for i, _ in step]) for name in shapes}
        extra = {}
        if prompt_len is not None and kind.reads_prompt_tokens:
            extra["num_prompt_tokens"] = torch.tensor([min(max(prompt_len - consumed[i], 0), n) for i, n in step])
        with torch.no_grad():
            out = kind.forward(module, torch.cat(chunks), cu_seqlens, has_initial_state, gathered, **extra)
        for b, (i, n) in enumerate(step):
            outputs[i].append(out[cu_seqlens[b] : cu_seqlens[b + 1]])
            for name in shapes:
                states[i][name] = gathered[name][b].clone()
            consumed[i] += n
    assert consumed == [len(s) for s in sequences], "schedule leaves tokens unrun"
    return [torch.cat(o) for o in outputs], states


def assert_matches_references(outputs: list, states: list, references: list, hf_states, tolerance: float) -> None:
    """Each sequence's output and final states (run_schedule's) against the HF module's
    (hf_reference's, one per sequence; ``hf_states`` reads a cache's states by name)."""
    for i, (expected, cache) in enumerate(references):
        torch.testing.assert_close(outputs[i], expected, rtol=tolerance, atol=tolerance, msg=f"sequence {i} output")
        for state_name, value in hf_states(cache).items():
            torch.testing.assert_close(states[i][state_name], value.to(states[i][state_name].dtype), rtol=tolerance,
                                       atol=tolerance, msg=f"sequence {i} state {state_name}")


def whole(lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Every sequence in one step."""
    return [[(i, n) for i, n in enumerate(lengths)]]


def chunked(lengths: list[int], seed: int, max_chunk: int = 7) -> list[list[tuple[int, int]]]:
    """Sequences cut at random points (chunks of 1 .. max_chunk), starting at different steps."""
    gen = torch.Generator().manual_seed(seed)
    remaining = list(lengths)
    schedule = []
    step_index = 0
    while any(remaining):
        step = []
        for i, left in enumerate(remaining):
            if left == 0 or i > step_index:  # sequence i joins at step i
                continue
            n = min(left, int(torch.randint(1, max_chunk + 1, (), generator=gen)))
            step.append((i, n))
            remaining[i] -= n
        schedule.append(step)
        step_index += 1
    return schedule


def prefill_then_decode(lengths: list[int], prefill: int) -> list[list[tuple[int, int]]]:
    """Each sequence's first ``prefill`` tokens in one step, then one token per step."""
    remaining = list(lengths)
    schedule = [[(i, min(prefill, n)) for i, n in enumerate(lengths)]]
    remaining = [n - min(prefill, n) for n in lengths]
    while any(remaining):
        schedule.append([(i, 1) for i, left in enumerate(remaining) if left])
        remaining = [max(0, left - 1) for left in remaining]
    return schedule


def make_sequences(lengths: list[int], hidden: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen, dtype=torch.float64) for n in lengths]
