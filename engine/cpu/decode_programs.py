"""Decode steps of a fused Llama-family decoder replayed from recorded kernel calls.

On a decode step the CPU path's decoder layers (cpu/layers.py) run the same C kernels
in the same order every time: norm, the q/k/v projection, rotation, attention, o_proj,
norm, the MLP's linears and activation, the residual add. For a few rows each kernel
is quick, and launching it from Python (module calls, checks, ctypes' argument
conversion) costs as much again. ``DecodePrograms`` records, once per row count, the
kernel calls of one such step (kernels/programs.py) and replays them on later steps
in one C call per stretch between attention calls; attention itself runs as always,
from Python, since its work depends on each step's context lengths and block tables.

How a step of T rows becomes a program:
- Its first WARM_STEPS steps run as usual (any lazy set-up happens there).
- The next one runs as usual with a recorder on and its inputs in buffers the program
  keeps: the hidden states entering the first layer and the rotary tables. Every
  kernel call is noted; every tensor the layers allocate is kept (a replay writes the
  same addresses); the attention calls cut the record into stretches, and their
  outputs are kept as the next stretch's input. A torch operation that computes
  between them (oneDNN's linear, where it won the race for a shape) is kept as a step
  of its stretch, run again with the same tensors and its fresh outputs copied into
  the recorded ones. One whose result Python reads (a number, a condition), a kernel
  call that returns a status or an adapter-wrapped layer (LoRA, whose work changes
  per step) leaves the size unrecorded.
- What a replay can repeat is only what the layers read from these: the hidden
  states, the rotary tables, the attention outputs and their own weights. The fused
  layers read nothing else of a step (its positions reach them as the rotary tables;
  everything else of the step, attention's own).
- The record is then checked: every kept tensor is overwritten with NaN (or -1) and
  the stretches replayed over the step's own attention outputs; the queries, keys,
  values and the last layer's output must come out bit for bit as the step computed
  them, else the size keeps running as usual (a kernel call the recorder missed would
  leave NaN behind).
- Later steps of T rows copy their hidden states and rotary tables into the buffers,
  replay the stretches around their attention calls (each output copied into the
  kept one) and give the last layer's output.
Every program is dropped when any of the layers' modules, parameters or buffers is
replaced or holds new storage (its old storage is kept until then). The number of
programs and the memory they keep are bounded (MAX_PROGRAMS, MAX_HELD_BYTES; the least
recently replayed goes first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from ..attention.context import AttentionContext
from ..kernels.programs import CallProgram, CallRecorder
from ..lora.layers import BatchedLoRALinear

logger = logging.getLogger(__name__)

# Steps of at most this many rows are recorded (past it a step's kernels outweigh their launches).
MAX_ROWS = 64
# Steps of a row count that run as usual before one is recorded.
WARM_STEPS = 2
# Programs one decoder keeps, and the bytes of tensors they may keep together: past
# either, the least recently replayed is dropped (and recorded again if its size returns).
MAX_PROGRAMS = 16
MAX_HELD_BYTES = 256 << 20

# Parameters, buffers and submodules registered on any module (torch's global
# registration hooks): where this moves, a decoder's programs look their layers over
# again (a replaced module or parameter is one the programs do not read).
_registrations = 0


def _registered(*_: object) -> None:
    global _registrations
    _registrations += 1


for _register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                  register_module_module_registration_hook):
    _register(_registered)

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default})
_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


@dataclass
class _TorchStep:
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


class _Guard(TorchDispatchMode):
    """Keeps every tensor allocated while it is active and not paused, and every other
    torch operation as a step to replay (its fresh outputs kept); notes the first
    operation a replay cannot repeat (one that gives anything but tensors, such as a
    number Python goes on to read)."""

    def __init__(self, recorder: CallRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.held: list[torch.Tensor] = []
        self.steps: list[_TorchStep] = []
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
            self.steps.append(_TorchStep(self.stretch, len(self.recorder.calls), func, args, kwargs, fresh))
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
class _Cut:
    """One attention call in a record: the layer's attention function and arguments,
    and the output the next stretch reads."""

    attend: Callable[..., torch.Tensor]
    attention: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attended: torch.Tensor | None = None


# One item of a stretch: a range [start, stop) of the recorded kernel calls, or a torch step.
_Item = tuple[int, int] | _TorchStep


@dataclass
class _Program:
    calls: CallProgram
    stretches: list[list[_Item]]  # stretch i runs before cut i (the last one after the last cut)
    cuts: list[_Cut]
    hidden: torch.Tensor  # [1, T, width]: the step's hidden states entering the first layer
    cos: torch.Tensor
    sin: torch.Tensor
    out: torch.Tensor  # the last layer's output
    kept: list[torch.Tensor]
    held_bytes: int


class DecodePrograms:
    """The recorded decode steps of one decoder's fused layers (see the module
    docstring), by row count, dtype and thread count."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.replays = 0  # steps replayed (the tests read it)
        self._programs: OrderedDict[tuple, _Program] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._refused: dict[tuple, str] = {}
        self._weights: list[torch.Tensor] = []  # the layers' parameters and buffers, held
        self._pointers: list[int] = []  # their data when the programs were recorded
        self._parts: tuple[int, ...] = ()  # the ids of the layers' modules, parameters and buffers
        self._registrations = -1

    def __getstate__(self) -> dict[str, object]:
        # A copy (deepcopy, pickle) records its own: the addresses here are this one's.
        return {"layers": self.layers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layers"])

    def forward(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                run_layers: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor | None:
        """The last layer's output for a step of hidden [1, T, width], replayed or recorded
        where the step qualifies, else None (the caller runs the layers). ``run_layers``
        runs every layer as usual."""
        rows = hidden.shape[1]
        if (rows > MAX_ROWS or hidden.dim() != 3 or hidden.shape[0] != 1 or ctx.max_query_len != 1
                or (ctx.sampled_rows is not None and ctx.sampled_rows.numel() != rows)):
            return None
        key = (rows, hidden.dtype, torch.get_num_threads())
        program = self._programs.get(key)
        if program is not None:
            if self._moved():
                self.clear()
                return None
            self._programs.move_to_end(key)
            return self._replay(program, hidden, position_embeddings, ctx)
        if key in self._refused:
            return None
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen <= WARM_STEPS:
            return None
        return self._record(key, hidden, position_embeddings, run_layers)

    def clear(self) -> None:
        """Drop every program (the layers' weights moved or were replaced)."""
        self._programs.clear()
        self._seen.clear()
        self._refused.clear()
        self._weights, self._pointers, self._parts, self._registrations = [], [], (), -1

    def _moved(self) -> bool:
        """Whether any of the layers' modules, parameters or buffers was replaced, or
        holds new storage, since the programs were recorded."""
        if self._registrations != _registrations:
            if self._layer_parts() != self._parts:
                return True
            self._registrations = _registrations
        for tensor, pointer in zip(self._weights, self._pointers):
            if tensor.data_ptr() != pointer:
                return True
        return False

    def _layer_parts(self) -> tuple[int, ...]:
        return tuple(map(id, (*self.layers.modules(), *self.layers.parameters(), *self.layers.buffers())))

    def _replay(self, program: _Program, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        program.hidden.copy_(hidden)
        program.cos.copy_(position_embeddings[0])
        program.sin.copy_(position_embeddings[1])
        stretches = program.stretches
        _run_stretch(program.calls, stretches[0])
        for index, cut in enumerate(program.cuts):
            attended = cut.attend(cut.attention, cut.query, cut.key, cut.value, ctx)
            assert cut.attended is not None
            cut.attended.copy_(attended)
            _run_stretch(program.calls, stretches[index + 1])
        self.replays += 1
        return program.out

    def _refuse(self, key: tuple, why: str) -> None:
        self._refused[key] = why
        logger.info("decode steps of %d rows are not replayed: %s", key[0], why)

    def _record(self, key: tuple, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                run_layers: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
                ) -> torch.Tensor:
        """Run the step with a recorder on (its output is the step's own), and keep the
        program where it replays exactly."""
        if any(isinstance(module, BatchedLoRALinear) for module in self.layers.modules()):
            self._refuse(key, "adapter-wrapped layers change their work per step")
            return run_layers(hidden, position_embeddings)
        inputs = hidden.clone(), position_embeddings[0].clone(), position_embeddings[1].clone()
        recorder, cuts = CallRecorder(), []
        guard = _Guard(recorder)
        with recorder, guard, self._cut_at_attention(recorder, guard, cuts):
            out = run_layers(inputs[0], (inputs[1], inputs[2]))
        result = out.clone()
        why = recorder.error or guard.refused
        if not why and len(cuts) != len(self.layers):
            why = f"{len(cuts)} attention calls for {len(self.layers)} layers"
        held_bytes = sum(tensor.untyped_storage().nbytes() for tensor in guard.held)
        if not why and held_bytes > MAX_HELD_BYTES:
            why = f"its buffers ({held_bytes >> 20} MiB) would pass the programs' bound ({MAX_HELD_BYTES >> 20} MiB)"
        calls = None if why else CallProgram.build(recorder.calls)
        if calls is None:
            self._refuse(key, why or "the program executor cannot be built here")
            return result
        bounds = [0, *(cut_at for cut_at, _ in cuts), len(recorder.calls)]
        stretches = [_stretch(bounds[index], bounds[index + 1], [step for step in guard.steps if step.stretch == index])
                     for index in range(len(bounds) - 1)]
        program = _Program(calls, stretches, [cut for _, cut in cuts], *inputs, out, guard.held, held_bytes)
        if not _replays_exactly(program, result):
            self._refuse(key, "a replay did not give the step's own outputs")
            return result
        if not self._programs:
            self._track_weights()
        # The least recently replayed go first where this one would pass either bound.
        while self._programs and (len(self._programs) >= MAX_PROGRAMS
                                  or self._held_bytes() + held_bytes > MAX_HELD_BYTES):
            dropped, _ = self._programs.popitem(last=False)
            self._seen.pop(dropped, None)
        self._programs[key] = program
        return result

    def _held_bytes(self) -> int:
        return sum(program.held_bytes for program in self._programs.values())

    def _track_weights(self) -> None:
        self._weights = [*self.layers.parameters(), *self.layers.buffers()]
        self._pointers = [tensor.data_ptr() for tensor in self._weights]
        self._parts, self._registrations = self._layer_parts(), _registrations

    @contextmanager
    def _cut_at_attention(self, recorder: CallRecorder, guard: _Guard, cuts: list[tuple[int, _Cut]]
                          ) -> Iterator[None]:
        """Each layer's attention call (its ``_attend``) cuts the record: it runs
        unrecorded, and its arguments and output are noted."""
        def cutting(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def attend_cut(attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           ctx: AttentionContext) -> torch.Tensor:
                cut = _Cut(attend, attention, query, key, value)
                cuts.append((len(recorder.calls), cut))
                recorder.paused = guard.paused = True
                try:
                    cut.attended = attend(attention, query, key, value, ctx)
                finally:
                    recorder.paused = guard.paused = False
                guard.stretch += 1
                return cut.attended
            return attend_cut

        for layer in self.layers:
            layer.__dict__["_attend"] = cutting(layer._attend)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("_attend", None)


def _stretch(start: int, stop: int, steps: list[_TorchStep]) -> list[_Item]:
    """The items of one stretch: its kernel calls [start, stop) with its torch steps
    where they ran among them."""
    items: list[_Item] = []
    for step in steps:
        if step.position > start:
            items.append((start, step.position))
            start = step.position
        items.append(step)
    if stop > start:
        items.append((start, stop))
    return items


def _run_stretch(calls: CallProgram, items: list[_Item]) -> None:
    for item in items:
        if isinstance(item, tuple):
            calls.run(*item)
        else:
            item.replay()


def _replays_exactly(program: _Program, result: torch.Tensor) -> bool:
    """Whether replaying the stretches, every kept tensor first overwritten, gives the
    recorded step's queries, keys, values and output (see the module docstring)."""
    expected = [(cut.query.clone(), cut.key.clone(), cut.value.clone()) for cut in program.cuts]
    for tensor in program.kept:
        tensor.fill_(float("nan") if tensor.is_floating_point() else -1)
    for items in program.stretches:
        _run_stretch(program.calls, items)
    return torch.equal(program.out, result) and all(
        torch.equal(cut.query, query) and torch.equal(cut.key, key) and torch.equal(cut.value, value)
        for cut, (query, key, value) in zip(program.cuts, expected, strict=True))
