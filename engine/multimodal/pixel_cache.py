"""The image processor's outputs, cached by image hash: an image that recurs (the same
picture under a second instruction, a dataset's repeated rows) is resized and
normalized once.

The cache wraps the processor's own image processor, so each processor's code (its
placeholder expansion, its tokenization of the text around them) runs as it is; only
the call that turns one image into its pixel tensors is answered from the cache.

Invariants:
- A call is answered from the cache only when it holds exactly one image whose hash
  the caller declared for this call (``declare``), with the same arguments as the
  cached call: the image processor is a function of the image's pixels and its
  arguments, so the answer equals what it would compute.
- Every answer of a call is a deep copy: a processor that changes the tensors it is
  handed never changes what the cache holds. ``shared`` answers hand out the cache's
  own tensors, uncopied, to a caller that only reads them (the engine's splice path,
  whose tensors go to the encoder's batch by concatenation).
- The cache holds at most ``capacity_bytes`` of tensors (least recently used leave
  first); ``capacity_bytes`` 0 caches nothing.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image


class PixelCache:
    """Wraps an image processor (see the module docstring); every other attribute is
    the wrapped processor's."""

    def __init__(self, image_processor: Any, capacity_bytes: int) -> None:
        self.image_processor = image_processor
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self._hashes: dict[int, str] = {}  # id of a PIL image of the call in progress -> its hash
        # The arguments (images aside) of the latest call on a list of one image, which
        # engine/multimodal/expansion.py reuses for that image's size.
        self.last_call: tuple[tuple, dict[str, Any]] | None = None

    def declare(self, hashes: Mapping[int, str]) -> None:
        """The hashes of the images the next calls may hand over, by ``id`` (the caller
        holds the images and its processor's lock until it declares again)."""
        self._hashes = dict(hashes)

    def __call__(self, images: Any, *args: Any, **kwargs: Any) -> Any:
        return self._answer(images, args, kwargs, copies=True)

    def shared(self, images: Any, *args: Any, **kwargs: Any) -> Any:
        """As a call, but the answer's tensors are the cache's own (neither a hit nor a
        stored miss is copied): for a caller that never changes them. Saves a copy of
        every image's pixels where most images are seen once."""
        return self._answer(images, args, kwargs, copies=False)

    def _answer(self, images: Any, args: tuple, kwargs: dict[str, Any], copies: bool) -> Any:
        self.last_call = (args, dict(kwargs)) if _nesting(images) == "[i]" else None
        key = self._key(images, args, kwargs)
        if key is None or self.capacity_bytes <= 0:
            return self.image_processor(images, *args, **kwargs)
        cached = self.entries.get(key)
        if cached is not None:
            self.entries.move_to_end(key)
            self.num_hits += 1
            return copy.deepcopy(cached[0]) if copies else cached[0]
        output = self.image_processor(images, *args, **kwargs)
        size = sum(_nbytes(value) for value in _leaves(output))
        if size <= self.capacity_bytes:
            self.entries[key] = (copy.deepcopy(output) if copies else output, size)
            self.num_bytes += size
            while self.num_bytes > self.capacity_bytes:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.num_bytes -= dropped
        return output

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: the wrapped processor's settings
        # and methods (its patch counts, its save_pretrained).
        if name == "image_processor":  # not yet set (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.image_processor, name)

    def _key(self, images: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[str, str] | None:
        leaves = list(_leaves(images))
        if len(leaves) != 1 or not isinstance(leaves[0], Image.Image):
            return None
        image_hash = self._hashes.get(id(leaves[0]))
        if image_hash is None:
            return None
        return image_hash, repr((_nesting(images), args, sorted(kwargs.items())))


def _leaves(value: Any) -> Iterator[Any]:
    """What ``value`` holds once lists, tuples and mappings are opened."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _nesting(images: Any) -> str:
    """The list structure around the images ([[image]] and image differ for a processor)."""
    if isinstance(images, (list, tuple)):
        return "[" + ",".join(_nesting(item) for item in images) + "]"
    return "i"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return 64
