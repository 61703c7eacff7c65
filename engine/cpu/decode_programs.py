"""Decode steps of a fused Llama-family decoder replayed from recorded kernel calls.

On a decode step the CPU path's decoder layers (cpu/layers.py) run the same C kernels
in the same order every time: norm, the q/k/v projection, rotation, attention, o_proj,
norm, the MLP's linears and activation, the residual add. For a few rows each kernel
is quick, and launching it from Python (module calls, checks, ctypes' argument
conversion) costs as much again. ``DecodePrograms`` records, once per row count, the
kernel calls of one such step (kernels/programs.py) and replays them on later steps.
Where the step's attention is the native decode kernel's alone, its calls are
recorded too, reading the step's slots, context lengths and block tables from buffers
each replay fills (cpu/decode_attention_record.py): the whole step is one C call.
Otherwise each stretch between attention calls is one C call, and attention runs as
always, from Python.

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
  per step) leaves the size unrecorded. Where the attention is recorded too, each
  attention call runs as usual first and then as recorded calls over the program's
  buffers, which must give the same output; else the size is recorded again on its
  next step, with the attention cutting the record.
- What a replay can repeat is only what the layers read from these: the hidden
  states, the rotary tables, the attention outputs and their own weights. The fused
  layers read nothing else of a step (its positions reach them as the rotary tables;
  everything else of the step, attention's own).
- The record is then checked: every kept tensor is overwritten with NaN (or -1) and
  the stretches replayed over the step's own attention outputs; the queries, keys,
  values and the last layer's output must come out bit for bit as the step computed
  them, else the size keeps running as usual (a kernel call the recorder missed would
  leave NaN behind).
- Later steps of T rows copy their hidden states and rotary tables into the buffers
  (and their attention's metadata, where it is recorded), replay the stretches around
  their attention calls (each output copied into the kept one) and give the last
  layer's output. A step whose block tables are wider than the buffers drops its
  program, which is recorded again with buffers twice as wide.
Every program is dropped when any of the layers' modules, parameters or buffers is
replaced or holds new storage (its old storage is kept until then). The number of
programs and the memory they keep are bounded (MAX_PROGRAMS, MAX_HELD_BYTES; the least
recently replayed goes first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..attention.context import AttentionContext
from ..kernels.programs import CallProgram, CallRecorder, RecorderBusy
from ..lora.layers import BatchedLoRALinear
from .decode_attention_record import RecordedAttention, StepTables, foldable, record_attention
from .decode_record import Cut, Program, RecordGuard, replays_exactly, run_stretch, stretch_items

if TYPE_CHECKING:
    from .layers import FusedDecoderLayer

logger = logging.getLogger(__name__)

# Steps of at most this many rows are recorded (past it a step's kernels outweigh their launches).
MAX_ROWS = 64
# Steps of a row count that run as usual before one is recorded.
WARM_STEPS = 2
# Programs one decoder keeps, and the bytes of tensors they may keep together: past
# either, the least recently replayed is dropped (and recorded again if its size returns).
MAX_PROGRAMS = 16
MAX_HELD_BYTES = 256 << 20


class _Registrations:
    """How many parameters, buffers and submodules have been registered on any module
    since the first program was recorded in this process, counted by torch's global
    registration hooks (installed then, once; they only count). Where the count moves,
    a decoder's programs look their layers over again: a replaced module or parameter
    is one the programs do not read."""

    count = 0
    _watching = False

    @classmethod
    def watch(cls) -> None:
        if not cls._watching:
            cls._watching = True
            for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                             register_module_module_registration_hook):
                register(cls._registered)

    @classmethod
    def _registered(cls, *_: object) -> None:
        cls.count += 1


class DecodePrograms:
    """The recorded decode steps of one decoder's fused layers (see the module
    docstring), by row count, dtype and thread count."""

    # Whether a step's attention may be recorded into its program (the tests turn it off).
    records_attention = True

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.replays = 0  # steps replayed (the tests read it)
        self._programs: OrderedDict[tuple, Program] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._refused: dict[tuple, str] = {}
        # Sizes whose attention cut the record (and why), and the block-table width the
        # next record of a size takes where its last one's was too narrow.
        self._cut_attention: dict[tuple, str] = {}
        self._widths: dict[tuple, int] = {}
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
            tables = program.tables
            if tables is not None and not tables.fits(ctx):
                # Recorded again on the next step of this size, wider where that was the cause.
                del self._programs[key]
                self._seen[key] = WARM_STEPS
                width = max(context.block_tables.shape[1] for context in (ctx, *ctx.group_contexts))
                if width > tables.width:
                    self._widths[key] = 2 * width
                return None
            self._programs.move_to_end(key)
            return self._replay(program, hidden, position_embeddings, ctx)
        if key in self._refused:
            return None
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen <= WARM_STEPS:
            return None
        return self._record(key, hidden, position_embeddings, run_layers, ctx)

    def clear(self) -> None:
        """Drop every program (the layers' weights moved or were replaced)."""
        self._programs.clear()
        self._seen.clear()
        self._refused.clear()
        self._cut_attention.clear()
        self._widths.clear()
        self._weights, self._pointers, self._parts, self._registrations = [], [], (), -1

    def _moved(self) -> bool:
        """Whether any of the layers' modules, parameters or buffers was replaced, or
        holds new storage, since the programs were recorded."""
        if self._registrations != _Registrations.count:
            if self._layer_parts() != self._parts:
                return True
            self._registrations = _Registrations.count
        for tensor, pointer in zip(self._weights, self._pointers):
            if tensor.data_ptr() != pointer:
                return True
        return False

    def _layer_parts(self) -> tuple[int, ...]:
        return tuple(map(id, (*self.layers.modules(), *self.layers.parameters(), *self.layers.buffers())))

    def _replay(self, program: Program, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        program.hidden.copy_(hidden)
        program.cos.copy_(position_embeddings[0])
        program.sin.copy_(position_embeddings[1])
        stretches = program.stretches
        if program.tables is not None:  # the whole step, its attention included
            program.tables.fill(ctx)
            run_stretch(program.calls, stretches[0])
            program.tables.check_written(ctx)
            self.replays += 1
            return program.out
        run_stretch(program.calls, stretches[0])
        for index, cut in enumerate(program.cuts):
            attended = cut.attend(cut.attention, cut.query, cut.key, cut.value, ctx)
            assert cut.attended is not None
            cut.attended.copy_(attended)
            run_stretch(program.calls, stretches[index + 1])
        self.replays += 1
        return program.out

    def _refuse(self, key: tuple, why: str) -> None:
        self._refused[key] = why
        logger.info("decode steps of %d rows are not replayed: %s", key[0], why)

    def _record(self, key: tuple, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                run_layers: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        """Run the step with a recorder on (its output is the step's own), and keep the
        program where it replays exactly."""
        if any(isinstance(module, BatchedLoRALinear) for module in self.layers.modules()):
            self._refuse(key, "adapter-wrapped layers change their work per step")
            return run_layers(hidden, position_embeddings)
        inputs = hidden.clone(), position_embeddings[0].clone(), position_embeddings[1].clone()
        recorder, cuts = CallRecorder(), []
        guard = RecordGuard(recorder)
        tables = None  # the buffers of the step's attention, where it is recorded too
        if self.records_attention and key not in self._cut_attention and foldable(ctx) is None:
            tables = StepTables.for_step(ctx, self._widths.get(key, 0))
        attended_calls: list[RecordedAttention | str] = []
        recording = ExitStack()
        try:
            recording.enter_context(recorder)
        except RecorderBusy:  # another engine's thread is recording: this step runs as usual
            self._seen[key] -= 1
            return run_layers(hidden, position_embeddings)
        with recording, guard, self._cut_at_attention(recorder, guard, cuts, ctx, tables, attended_calls):
            out = run_layers(inputs[0], (inputs[1], inputs[2]))
        result = out.clone()
        why = recorder.error or guard.refused
        failed = next((attended for attended in attended_calls if isinstance(attended, str)), None)
        if not why and failed:  # recorded again on the next step, the attention cutting the record
            self._cut_attention[key] = failed
            self._seen[key] -= 1
            logger.info("decode steps of %d rows replay around their attention: %s", key[0], failed)
            return result
        if not why and len(cuts) != len(self.layers):
            why = f"{len(cuts)} attention calls for {len(self.layers)} layers"
        held_bytes = sum(tensor.untyped_storage().nbytes() for tensor in guard.held)
        held_bytes += 0 if tables is None else tables.held_bytes()
        if not why and held_bytes > MAX_HELD_BYTES:
            why = f"its buffers ({held_bytes >> 20} MiB) would pass the programs' bound ({MAX_HELD_BYTES >> 20} MiB)"
        calls = None if why else CallProgram.build(recorder.calls)
        if calls is None:
            self._refuse(key, why or "the program executor cannot be built here")
            return result
        if tables is None:
            bounds = [0, *(cut_at for cut_at, _ in cuts), len(recorder.calls)]
            stretches = [stretch_items(bounds[index], bounds[index + 1],
                                       [step for step in guard.steps if step.stretch == index])
                         for index in range(len(bounds) - 1)]
        else:  # one stretch: the attention's calls are among the others
            stretches = [stretch_items(0, len(recorder.calls), guard.steps)]
        program = Program(calls, stretches, [cut for _, cut in cuts], *inputs, out, guard.held, held_bytes, tables,
                          None if tables is None else cast(list[RecordedAttention], attended_calls))
        if not replays_exactly(program, result):
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
        _Registrations.watch()
        self._parts, self._registrations = self._layer_parts(), _Registrations.count

    @contextmanager
    def _cut_at_attention(self, recorder: CallRecorder, guard: RecordGuard, cuts: list[tuple[int, Cut]],
                          step: AttentionContext, tables: StepTables | None,
                          attended_calls: list[RecordedAttention | str]) -> Iterator[None]:
        """Each layer's attention call (its ``_attend``) cuts the record: it runs
        unrecorded, and its arguments and output are noted. With ``tables``, its KV
        write and decode attention are then recorded over them (cpu/decode_attention_
        record.py; what each gave, or why not, goes to ``attended_calls``)."""
        def cutting(layer: FusedDecoderLayer, attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def attend_cut(attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           ctx: AttentionContext) -> torch.Tensor:
                cut = Cut(attend, attention, query, key, value)
                cuts.append((len(recorder.calls), cut))
                recorder.paused = guard.paused = True
                try:
                    cut.attended = attend(attention, query, key, value, ctx)
                    if tables is not None and ctx is step and getattr(layer, "attends_in_context", False):
                        recorder.paused = False
                        attended_calls.append(record_attention(tables, ctx, layer.layer.self_attn.layer_idx,
                                                               layer.attention_options, query, key, value,
                                                               cut.attended))
                    elif tables is not None:
                        attended_calls.append("a layer attends through another function or context")
                finally:
                    recorder.paused = guard.paused = False
                guard.stretch += 1
                return cut.attended
            return attend_cut

        for layer in self.layers:
            fused = cast("FusedDecoderLayer", layer)  # a fused decoder's layers all are (cpu/fused_decoder.py)
            layer.__dict__["_attend"] = cutting(fused, cast(Callable[..., torch.Tensor], layer._attend))
        try:
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("_attend", None)
