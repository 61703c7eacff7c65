"""The vision encoder's outputs, cached by image hash, and their scatter into a step's
input embeddings at the image placeholders.

Invariants:
- An image's encoder output is computed once while it stays cached: a step encodes,
  in one batch per pixel shape, only the images whose rows it needs and the cache
  does not hold; ``num_encoded_images`` counts them.
- A step's embeddings are the token embeddings of its input ids, with each scheduled
  placeholder position that an image fills replaced by that image's encoder row for
  it: a chunked prefill that splits an image's placeholders takes the rows of the
  positions it computes, and positions a prefix-cache hit skipped need none.
- The cache holds at most ``capacity_bytes`` of outputs of images not needed by the
  step being built (least recently used leave first); an image it dropped is encoded
  again when next needed, to the same output. A budget in bytes keeps more images of a
  small model than of a large one, in bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from .inputs import ImageInput
from .qwen_vl import DeepstackRows, install_deepstack_inputs, split_deepstack
from .specs import VisionSpec

if TYPE_CHECKING:
    from ..core.scheduler import ScheduledRequest

DEFAULT_CAPACITY_BYTES = 1 << 30


class EncoderCache:
    """Encoder outputs ([rows, hidden], in the model's dtype, on its device) by image hash."""

    def __init__(self, model: nn.Module, spec: VisionSpec, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        assert isinstance(model, PreTrainedModel), f"{type(model).__name__} is not a transformers model"
        self.model = model
        self.spec = spec
        self.capacity_bytes = capacity_bytes
        self.outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded_images = 0  # images the vision encoder has run on
        self.num_encoder_calls = 0  # batches it ran
        if spec.deepstack:
            install_deepstack_inputs(model)

    def get(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """The encoder output of each image, encoding the missing ones in batches."""
        missing: dict[str, ImageInput] = {}
        for image in images:
            if image.image_hash in self.outputs:
                self.outputs.move_to_end(image.image_hash)
            else:
                missing.setdefault(image.image_hash, image)
        found = {image_hash: self.outputs[image_hash] for image_hash in {i.image_hash for i in images}
                 if image_hash in self.outputs}
        found.update(self._encode(list(missing.values())))
        self._evict(keep=set(found))
        return [found[image.image_hash] for image in images]

    def _encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Run the encoder on ``images``, one batch per shape of their pixel tensors."""
        encoded: dict[str, torch.Tensor] = {}
        groups: dict[tuple, list[ImageInput]] = {}
        for image in images:
            shape = tuple((key, tuple(value.shape)) for key, value in sorted(image.pixel_inputs.items()))
            groups.setdefault(shape, []).append(image)
        parameter = next(self.model.parameters())
        for group in groups.values():
            batch = {key: torch.cat([image.pixel_inputs[key] for image in group]).to(parameter.device)
                     for key in group[0].pixel_inputs}
            batch = {key: value.to(parameter.dtype) if value.is_floating_point() else value
                     for key, value in batch.items()}
            outputs = self.spec.encode(self.model, batch, [image.num_rows for image in group])
            self.num_encoder_calls += 1
            for image, output in zip(group, outputs):
                if output.shape[0] != image.num_rows:
                    raise RuntimeError(f"the vision encoder gave {output.shape[0]} rows for an image the processor "
                                       f"gave {image.num_rows} placeholder tokens")
                encoded[image.image_hash] = output.to(parameter.dtype)
                self.outputs[image.image_hash] = encoded[image.image_hash]
                self.num_bytes += _nbytes(encoded[image.image_hash])
                self.num_encoded_images += 1
        return encoded

    def _evict(self, keep: set[str]) -> None:
        for image_hash in list(self.outputs):
            if self.num_bytes <= self.capacity_bytes:
                return
            if image_hash not in keep:
                self.num_bytes -= _nbytes(self.outputs.pop(image_hash))

    def clear(self) -> None:
        self.outputs.clear()
        self.num_bytes = 0

    def step_embeddings(self, input_ids: torch.Tensor, scheduled: Sequence[ScheduledRequest],
                        query_starts: np.ndarray | Sequence[int]) -> StepImages | None:
        """The step's input embeddings [1, T, hidden] with image rows scattered in (and a
        deepstack model's rows for its early layers), or None when no scheduled token
        is an image placeholder (the ids suffice). ``query_starts[i]``: where request
        i's tokens start in the packed step."""
        # input_ids: [1, T]
        needed: list[tuple[int, ImageInput, int, int]] = []  # (packed offset of position 0, image, rows)
        for index, item in enumerate(scheduled):
            images = item.request.images
            if not images:
                continue
            start, end = item.start, item.start + item.num_new_tokens
            for image in images:
                if image.end <= start or image.start >= end:
                    continue
                first, last = image.rows_in(start, end)
                if first < last:
                    needed.append((int(query_starts[index]) - start, image, first, last))
        if not needed:
            return None
        outputs = self.get([image for _, image, _, _ in needed])
        embeddings = self.model.get_input_embeddings()(input_ids)
        targets = [offset + position for offset, image, first, last in needed
                   for position in image.positions[first:last]]
        rows = torch.cat([output[first:last] for (_, _, first, last), output in zip(needed, outputs)])
        index = torch.tensor(targets, device=embeddings.device)
        deepstack = None
        if self.spec.deepstack:
            rows, deepstack = split_deepstack(rows, index, embeddings.shape[1], embeddings.shape[-1])
        embeddings[0, index] = rows.to(embeddings.dtype)
        return StepImages(embeddings, deepstack)


@dataclass(frozen=True)
class StepImages:
    """A step's image inputs: ``embeddings`` [1, T, hidden], and for a deepstack model
    (Qwen3-VL) the rows its early decoder layers add (None otherwise)."""

    embeddings: torch.Tensor
    deepstack: DeepstackRows | None = None


def _nbytes(output: torch.Tensor) -> int:
    return output.numel() * output.element_size()


def fills_images(scheduled: Sequence[ScheduledRequest]) -> bool:
    """Whether any scheduled token is an image placeholder (the step then runs on input
    embeddings; a decode step never is one)."""
    return any(image.start < item.start + item.num_new_tokens and image.end > item.start
               for item in scheduled for image in item.request.images)


def image_key_limits(scheduled: Sequence[ScheduledRequest], query_starts: np.ndarray | Sequence[int],
                     positions: np.ndarray) -> np.ndarray | None:
    """[T] int64 the last key position each packed query sees (AttentionContext's
    ``key_limits``), or None when every query sees keys up to its own position: a row
    of an image attending both ways (ImageInput.bidirectional) sees its image's whole
    run of placeholders, which the scheduler keeps in one step. ``positions``: [T] each
    packed token's position."""
    limits = None
    for index, item in enumerate(scheduled):
        start, end = item.start, item.start + item.num_new_tokens
        for image in item.request.images:
            if not image.bidirectional or image.end <= start or image.start >= end:
                continue
            if limits is None:
                limits = np.array(positions, dtype=np.int64)
            for first, last in _runs(image.positions):  # transformers' blocks: runs of placeholders
                rows = np.arange(max(first, start), min(last, end)) - start + int(query_starts[index])
                limits[rows] = last - 1
    return limits


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last + 1) of each run of consecutive positions."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs
