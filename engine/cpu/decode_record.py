"""What a recorded decode step is made of (engine/cpu/decode_programs.py records and
replays them): the guard that watches torch while a step is recorded, the torch
operations kept as steps, the attention calls that cut the record into stretches, and
the check that a record replays exactly.

Invariants:
- A stretch's items run in the order the step ran them: ranges of the recorded kernel
  calls, and the torch steps that ran between them.
- What a record's calls and torch steps write is what the fused layers write: tensors
  allocated while it was recorded, which it keeps (``Program.kept``, all of which the
  check overwrites before it replays), and its inputs (hidden states, rotary tables,
  attention outputs), which every replay fills first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.programs import CallProgram, CallRecorder
from .decode_attention_record import RecordedAttention, StepTables, write_back

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default})
_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


@dataclass
class TorchStep:
    """A torch operation between the kernel calls of a record: run again with the same
    arguments (the same tensors), its fresh outputs copied into the ones it gave then,
    which later calls read. ``stretch`` and ``position``: the stretch it ran in and how
    many kernel calls the record held before it."""

    stretch: int
    position: int
    func: Any
    args: tuple
    kwargs: dict
    fresh: list[tuple[int, torch.Tensor]]  # (index in the outputs, the recorded output)

    def replay(self) -> None:
        out = self.func(*self.args, **self.kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for index, recorded in self.fresh:
            recorded.copy_(outs[index])


class RecordGuard(TorchDispatchMode):
    """Keeps every tensor allocated while it is active and not paused, and every other
    torch operation as a step to replay (its fresh outputs kept); notes the first
    operation a replay cannot repeat (one that gives anything but tensors, such as a
    number Python goes on to read)."""

    def __init__(self, recorder: CallRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.held: list[torch.Tensor] = []
        self.steps: list[TorchStep] = []
        self.stretch = 0  # attention calls so far
        self.refused: str | None = None
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        if func in _ALLOCATIONS:
            self.held.append(out)
        elif not ((func.is_view or func in _VIEWS) and _aliases(out, args[0])):  # reshape copies where it must
            outs = out if isinstance(out, (list, tuple)) else (out,)
            if not outs or not all(isinstance(tensor, torch.Tensor) for tensor in outs):
                self.refused = self.refused or f"the layers compute {func} in torch, which Python reads"
                return out
            inputs = {_storage(tensor) for tensor in _tensors((args, kwargs))}
            fresh = [(index, tensor) for index, tensor in enumerate(outs) if _storage(tensor) not in inputs]
            if any(_storage(tensor) is None for _, tensor in fresh):
                self.refused = self.refused or f"the layers compute {func} in torch into an opaque tensor"
                return out
            self.held.extend(tensor for _, tensor in fresh)
            self.steps.append(TorchStep(self.stretch, len(self.recorder.calls), func, args, kwargs, fresh))
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage; None for a tensor without one (oneDNN's
    opaque packed weights)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _aliases(out: Any, source: Any) -> bool:
    """Whether every tensor of ``out`` views ``source``'s storage."""
    if not isinstance(source, torch.Tensor):
        return False
    pointer = _storage(source)
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return pointer is not None and all(isinstance(tensor, torch.Tensor) and _storage(tensor) == pointer
                                       for tensor in outs)


@dataclass
class Cut:
    """One attention call in a record: the layer's attention function and arguments,
    and the output the next stretch reads."""

    attend: Callable[..., torch.Tensor]
    attention: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attended: torch.Tensor | None = None


# One item of a stretch: a range [start, stop) of the recorded kernel calls, or a torch step.
Item = tuple[int, int] | TorchStep


@dataclass
class Program:
    """A recorded step. Without ``tables``: its stretches run around its cuts, each cut's
    attention called from Python. With them, the attention calls are among the recorded
    ones (cpu/decode_attention_record.py, one per cut in ``attended_calls``) and the one
    stretch is the whole step; the cuts are kept for the record's check."""

    calls: CallProgram
    stretches: list[list[Item]]  # stretch i runs before cut i (the last one after the last cut)
    cuts: list[Cut]
    hidden: torch.Tensor  # [1, T, width]: the step's hidden states entering the first layer
    cos: torch.Tensor
    sin: torch.Tensor
    out: torch.Tensor  # the last layer's output
    kept: list[torch.Tensor]
    held_bytes: int
    tables: StepTables | None = None
    attended_calls: list[RecordedAttention] | None = None


def stretch_items(start: int, stop: int, steps: list[TorchStep]) -> list[Item]:
    """The items of one stretch: its kernel calls [start, stop) with its torch steps
    where they ran among them."""
    items: list[Item] = []
    for step in steps:
        if step.position > start:
            items.append((start, step.position))
            start = step.position
        items.append(step)
    if stop > start:
        items.append((start, stop))
    return items


def run_stretch(calls: CallProgram, items: list[Item]) -> None:
    for item in items:
        if isinstance(item, tuple):
            calls.run(*item)
        else:
            item.replay()


def replays_exactly(program: Program, result: torch.Tensor) -> bool:
    """Whether replaying the stretches, every kept tensor first overwritten, gives the
    recorded step's queries, keys, values and output (see the module docstring); with
    the attention among the calls, its outputs too (overwritten first as well), and
    where the replay wrote other keys and values than the step's, the step's are
    written back."""
    expected = [(cut.query.clone(), cut.key.clone(), cut.value.clone()) for cut in program.cuts]
    folded = program.tables is not None
    attended = [cut.attended.clone() for cut in program.cuts if cut.attended is not None] if folded else []
    for tensor in [*program.kept, *(cut.attended for cut in program.cuts if folded and cut.attended is not None)]:
        tensor.fill_(float("nan") if tensor.is_floating_point() else -1)
    for items in program.stretches:
        run_stretch(program.calls, items)
    exact = torch.equal(program.out, result) and all(
        torch.equal(cut.query, query) and torch.equal(cut.key, key) and torch.equal(cut.value, value)
        for cut, (query, key, value) in zip(program.cuts, expected, strict=True))
    if folded:
        assert program.tables is not None and program.attended_calls is not None
        exact = exact and not int(program.tables.out_of_range) and len(attended) == len(program.cuts) and all(
            cut.attended is not None and torch.equal(cut.attended, output)
            for cut, output in zip(program.cuts, attended, strict=True))
        program.tables.out_of_range.zero_()
        if not exact:
            for recorded, (_, key, value) in zip(program.attended_calls, expected, strict=True):
                write_back(recorded, key, value)
    return exact
