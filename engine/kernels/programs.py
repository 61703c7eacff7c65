"""Recording the C kernels' calls and replaying them in one call.

A decode step on the CPU runs dozens of small C kernels per layer, each launched from
Python: module calls, shape checks and ctypes' argument conversion cost more than
some of the kernels themselves. A ``CallRecorder`` notes every call of a declared
kernel function (kernels/native.py's ``declare``) while it is active: the function's
address, its ctypes signature and its arguments as the integers and floats ctypes
passed. A ``CallProgram`` holds such calls and runs a range of them in one ctypes
call of a small C executor, generated for the program's signatures (each call cast
to its function's exact prototype, so no calling-convention tricks) and built once
per host like the other kernels.

A replay passes the recorded arguments again: the same addresses, sizes and thread
counts. Whoever records a program keeps alive every buffer those addresses point
into and fills the inputs that vary in place (engine/cpu/decode_programs.py).
Recorded calls must return nothing: a kernel that reports a status (kv_write, the
prefill attention) is not replayed, since no one would read the status; recording
one marks the recording unusable. A function of no arguments that returns a value
is a query of the library (what it was built with) and is left out.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .native import DECLARED, NativeLibrary, cache_dir

logger = logging.getLogger(__name__)

# ctypes' type codes (a simple type's ``_type_``) by the C type a generated call passes.
_INTEGER_TYPES = {"q": "int64_t", "Q": "uint64_t", "i": "int32_t", "I": "uint32_t", "h": "int16_t",
                  "H": "uint16_t", "b": "int8_t", "B": "uint8_t", "?": "_Bool"}
_REAL_TYPES = {"f": "float", "d": "double"}
_POINTER = "p"


def _code(argtype: Any) -> str:
    """The code of one ctypes argument type: "p" for any pointer, else its ``_type_``
    ("l" and "L", C's long, as the 64- or 32-bit integer they are here)."""
    if argtype is ctypes.c_void_p or (isinstance(argtype, type) and issubclass(argtype, ctypes._Pointer)):
        return _POINTER
    code = getattr(argtype, "_type_", None)
    if code in ("l", "L"):
        return ("q" if code == "l" else "Q") if ctypes.sizeof(argtype) == 8 else ("i" if code == "l" else "I")
    if not isinstance(code, str) or (code not in _INTEGER_TYPES and code not in _REAL_TYPES):
        raise TypeError(f"a recorded kernel argument of ctypes type {argtype!r} is not an integer, float or pointer")
    return code


@dataclass(frozen=True)
class RecordedCall:
    """One kernel call: the function's address and name, its argument codes, and the
    arguments in order as integers (pointers and integers) and floats."""

    address: int
    name: str
    codes: str
    ints: tuple[int, ...]
    reals: tuple[float, ...]


def _record(function: Any, arguments: tuple) -> RecordedCall:
    argtypes = function.argtypes
    if argtypes is None or len(argtypes) != len(arguments):
        raise TypeError(f"kernel {function.__name__} was called without its declared signature")
    codes = signature_codes(argtypes)
    ints: list[int] = []
    reals: list[float] = []
    for code, value in zip(codes, arguments, strict=True):
        if code in _REAL_TYPES:
            if not isinstance(value, (int, float)):
                raise TypeError(f"kernel {function.__name__} got {value!r} for a float argument")
            reals.append(float(value))
        elif value is None and code == _POINTER:
            ints.append(0)
        elif isinstance(value, int):  # bool included; held as int64, the unsigned in two's complement
            ints.append(int(value) - (1 << 64) if value >= 1 << 63 else int(value))
        else:
            raise TypeError(f"kernel {function.__name__} got {type(value).__name__} {value!r}, which a replay "
                            "cannot pass again")
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None, function
    return RecordedCall(address, function.__name__, codes, tuple(ints), tuple(reals))


class RecorderBusy(RuntimeError):
    """Another thread is recording: the kernels' hooks serve one recording at a time."""


class CallRecorder:
    """While active (a context manager), every call of a declared kernel function made
    by the thread that entered it is appended to ``calls`` after it ran, unless
    ``paused`` (other threads' calls are not this recording's). ``error`` says why the
    recording cannot be replayed (a call that returns a status, an argument a replay
    cannot pass), else None. One records at a time in a process: entering while another
    is active raises RecorderBusy (the caller runs without recording). The functions
    watched are those declared when it is entered: a library first loaded while it is
    active goes unseen (decode_record.py's check of a record finds such a call missing)."""

    _lock = threading.Lock()  # held by the active recorder

    def __init__(self) -> None:
        self.calls: list[RecordedCall] = []
        self.paused = False
        self.error: str | None = None
        self._hooked: list[Any] = []
        self._thread = threading.get_ident()

    def __enter__(self) -> CallRecorder:
        if not CallRecorder._lock.acquire(blocking=False):
            raise RecorderBusy("another thread is recording kernel calls")
        self._thread = threading.get_ident()
        for function in {id(function): function for function in DECLARED}.values():
            function.errcheck = self._seen
            self._hooked.append(function)
        return self

    def __exit__(self, *exc: object) -> None:
        for function in self._hooked:
            del function.errcheck
        self._hooked.clear()
        CallRecorder._lock.release()

    def _seen(self, result: object, function: Any, arguments: tuple) -> object:
        """ctypes' errcheck hook: called after each call of a hooked function."""
        if self.paused or self.error is not None or threading.get_ident() != self._thread:
            return result
        if function.restype is not None:
            if not arguments:  # a query of the library's build: nothing to replay
                return result
            self.error = f"kernel {function.__name__} returns a value, which a replay would not check"
            return result
        try:
            self.calls.append(_record(function, arguments))
        except TypeError as error:
            self.error = str(error)
        return result


def executor_source_for(signatures: list[str]) -> str:
    """C source of ``program_run(steps, count, ints, reals)``: steps are rows of four
    int64 (the function's address, its signature's index in ``signatures``, the offsets
    of its arguments in ``ints`` and ``reals``), each called through its own prototype."""
    cases = []
    for index, codes in enumerate(signatures):
        types, values = [], []
        next_int = next_real = 0
        for code in codes:
            if code == _POINTER:
                types.append("void *")
                values.append(f"(void *)(uintptr_t)i[{next_int}]")
                next_int += 1
            elif code in _INTEGER_TYPES:
                types.append(_INTEGER_TYPES[code])
                values.append(f"({_INTEGER_TYPES[code]})i[{next_int}]")
                next_int += 1
            else:
                types.append(_REAL_TYPES[code])
                values.append(f"({_REAL_TYPES[code]})r[{next_real}]")
                next_real += 1
        prototype = f"void (*)({', '.join(types) or 'void'})"
        cases.append(f"        case {index}: (({prototype})function)({', '.join(values)}); break;")
    return "\n".join([
        "/* Generated by engine/kernels/programs.py: replays recorded kernel calls. */",
        "#include <stdint.h>",
        "",
        "void program_run(const int64_t *steps, int64_t count, const int64_t *ints, const double *reals) {",
        "    for (int64_t s = 0; s < count; s++) {",
        "        const int64_t *step = steps + 4 * s;",
        "        const uintptr_t function = (uintptr_t)step[0];",
        "        const int64_t *i = ints + step[2];",
        "        const double *r = reals + step[3];",
        "        (void)i; (void)r;",
        "        switch (step[1]) {",
        *cases,
        "        default: return;",
        "        }",
        "    }",
        "}",
        "",
    ])


def _declare_executor(library: ctypes.CDLL) -> None:
    run = library.program_run
    run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    run.restype = None


_EXECUTORS: dict[tuple[str, ...], NativeLibrary] = {}


def _executor(signatures: tuple[str, ...]) -> Callable[..., None] | None:
    """The built executor for these signatures (None where it cannot be built)."""
    library = _EXECUTORS.get(signatures)
    if library is None:
        source = executor_source_for(list(signatures))
        path = cache_dir() / "programs" / f"program_{hashlib.sha256(source.encode()).hexdigest()[:16]}.c"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            scratch.write_text(source)
            scratch.replace(path)
        library = _EXECUTORS[signatures] = NativeLibrary(path, _declare_executor, "decode steps call each kernel")
    loaded = library.load()
    return None if loaded is None else loaded.program_run


class CallProgram:
    """Recorded calls, replayed a range at a time by ``run(start, stop)`` in one ctypes
    call. ``build`` returns None where the executor cannot be built."""

    def __init__(self, calls: list[RecordedCall], run: Callable[..., None], signatures: tuple[str, ...]) -> None:
        self.calls = calls
        index = {codes: position for position, codes in enumerate(signatures)}
        steps, ints, reals = [], [], []
        for call in calls:
            steps += [call.address, index[call.codes], len(ints), len(reals)]
            ints += call.ints
            reals += call.reals
        # Held here: the executor reads them on every run.
        self.steps = torch.tensor(steps, dtype=torch.int64)
        self.ints = torch.tensor(ints or [0], dtype=torch.int64)
        self.reals = torch.tensor(reals or [0.0], dtype=torch.float64)
        self._run = run
        self._steps, self._ints, self._reals = self.steps.data_ptr(), self.ints.data_ptr(), self.reals.data_ptr()

    @classmethod
    def build(cls, calls: list[RecordedCall]) -> CallProgram | None:
        signatures = tuple(sorted({call.codes for call in calls}))
        run = _executor(signatures)
        return None if run is None else cls(calls, run, signatures)

    def run(self, start: int, stop: int) -> None:
        """Replay calls [start, stop)."""
        if stop > start:
            self._run(self._steps + 32 * start, stop - start, self._ints, self._reals)


def signature_codes(argtypes: list) -> str:
    """The codes a recorded call of a function with these ctypes argument types has."""
    return "".join(_code(argtype) for argtype in argtypes)

