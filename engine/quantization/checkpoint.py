"""Lazy access to a checkpoint's safetensors tensors by name.

A quantized checkpoint is read tensor by tensor as each quantized module is built, so
no file is read whole and no tensor is held twice. ``CheckpointTensors`` opens the
checkpoint's safetensors files once (one file, or the shards its
``model.safetensors.index.json`` lists) and answers by tensor name; a name the
checkpoint lacks is one error line naming the tensor, what it was needed for and the
checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Bytes read through one mapping of a file before it is unmapped (and mapped again on
# the next read), so a large checkpoint's pages do not all stay resident while it loads.
REMAP_BYTES = 256 << 20


class QuantizedCheckpointError(ModelLoadError):
    """A quantized checkpoint's tensors cannot be used as its quantization_config says
    (a missing scale, a block size that does not match the weight, a wrong dtype or
    shape); the message names the tensor and the problem."""


class CheckpointTensors:
    """The tensors of one checkpoint directory, read lazily by name.

    ``get(name)`` reads one tensor (onto ``device``); ``dtype``/``shape`` read only the
    header. The file handles stay open for the object's life (``close`` ends it)."""

    def __init__(self, directory: str | os.PathLike[str], device: torch.device | str = "cpu") -> None:
        self.directory = Path(directory)
        self.device = torch.device(device)
        self._file_of: dict[str, str] = _tensor_files(self.directory)
        # The name each tensor is stored under, by the name it is asked for (``rename``).
        self._stored: dict[str, str] = {name: name for name in self._file_of}
        self._stored_modules: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self._bytes_read: dict[str, int] = {}

    def rename(self, rename: Callable[[str], str]) -> None:
        """Answer by ``rename(stored name)`` from now on (the names the model's
        parameters have, where transformers renames a checkpoint's keys at load); two
        stored tensors renamed alike are refused."""
        file_of_stored = {stored: self._file_of[name] for name, stored in self._stored.items()}
        stored: dict[str, str] = {}
        for name in file_of_stored:
            renamed = rename(name)
            if renamed in stored:
                raise QuantizedCheckpointError(
                    f"checkpoint {self.directory}: tensors {stored[renamed]!r} and {name!r} both name {renamed!r}")
            stored[renamed] = name
        self._file_of = {renamed: file_of_stored[name] for renamed, name in stored.items()}
        self._stored = stored
        self._stored_modules = {}
        for renamed, name in stored.items():
            renamed_parts, stored_parts = renamed.split("."), name.split(".")
            # Each module path above the tensor, up to where the two names part.
            for depth in range(1, min(len(renamed_parts), len(stored_parts))):
                if renamed_parts[-depth] != stored_parts[-depth]:
                    break
                self._stored_modules[".".join(renamed_parts[:-depth])] = ".".join(stored_parts[:-depth])

    def stored_module(self, module_name: str) -> str:
        """The module path the checkpoint stores ``module_name``'s tensors under (its
        ignore list names modules so)."""
        return self._stored_modules.get(module_name, module_name)

    def stored_name(self, name: str) -> str:
        """The name ``name`` is stored under in the safetensors files."""
        return self._stored.get(name, name)

    def names(self) -> set[str]:
        """Every tensor name the checkpoint holds."""
        return set(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def _handle(self, name: str, what: str) -> Any:
        file_name = self._file_of.get(name)
        if file_name is None:
            raise QuantizedCheckpointError(
                f"checkpoint {self.directory} has no tensor {name!r}{f' ({what})' if what else ''}")
        handle = self._handles.get(file_name)
        if handle is None:
            handle = safe_open(str(self.directory / file_name), framework="pt", device=str(self.device))
            self._handles[file_name] = handle
        return handle

    def get(self, name: str, what: str = "") -> torch.Tensor:
        """The tensor ``name`` on this object's device, in memory of its own; ``what`` says
        what it is needed for in the error raised when the checkpoint lacks it."""
        return self._count(name, self._handle(name, what).get_tensor(self.stored_name(name)))

    def get_part(self, name: str, index: tuple[slice, ...], what: str = "") -> torch.Tensor:
        """The part ``index`` (one slice per leading dimension) of tensor ``name``, in
        memory of its own: only that part's bytes are read (a tensor-parallel rank's
        share, engine/parallel/loading.py)."""
        part = self._count(name, self._handle(name, what).get_slice(self.stored_name(name))[index])
        # Parts are read far apart in the file (every rank's share lies between them):
        # unmapped after each, so the pages read do not stay resident.
        self._handles.pop(self._file_of[name], None)
        return part

    def _count(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read from ``name``'s file, in memory of its own; the file is
        unmapped once REMAP_BYTES were read through its mapping."""
        # A CPU tensor may be a view of the file's mapping, which would keep the whole
        # file mapped (and every page read of it resident) as long as the tensor lives.
        tensor = tensor.clone() if tensor.device.type == "cpu" else tensor
        # The pages read stay resident while the file is mapped: unmap it every so often.
        file_name = self._file_of[name]
        self._bytes_read[file_name] = self._bytes_read.get(file_name, 0) + tensor.numel() * tensor.element_size()
        if self._bytes_read[file_name] >= REMAP_BYTES:
            self._handles.pop(file_name, None)
            self._bytes_read[file_name] = 0
        return tensor

    def dtype(self, name: str, what: str = "") -> torch.dtype:
        """The stored dtype of ``name`` (reads the header only)."""
        return _SAFETENSORS_DTYPES[self._handle(name, what).get_slice(self.stored_name(name)).get_dtype()]

    def shape(self, name: str, what: str = "") -> tuple[int, ...]:
        """The stored shape of ``name`` (reads the header only)."""
        return tuple(self._handle(name, what).get_slice(self.stored_name(name)).get_shape())

    def close(self) -> None:
        self._handles.clear()


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


def _tensor_files(directory: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative to ``directory``) that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise QuantizedCheckpointError(f"{index} has no weight_map")
        return {str(name): str(file) for name, file in weight_map.items()}
    files = [SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else sorted(
        path.name for path in directory.glob("*.safetensors"))
    if not files:
        raise QuantizedCheckpointError(f"checkpoint {directory} has no safetensors files")
    found: dict[str, str] = {}
    for file_name in files:
        with safe_open(str(directory / file_name), framework="pt") as handle:
            found.update((name, file_name) for name in handle.keys())
    return found
