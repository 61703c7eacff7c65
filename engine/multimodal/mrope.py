"""Multimodal rotary positions (M-RoPE) of the Qwen vision-language family: each token
has three position ids (temporal, height, width), computed per request from its
images' grids.

The rule (the Qwen-VL models' own, restated):
- a text token's three ids are equal: the previous token's largest id plus one (0 for
  the first token);
- an image of ``h`` x ``w`` tokens (after the encoder's spatial merge) starting where
  the next text token would start, at ``base``, puts its token in row ``r``, column
  ``c`` (row-major order) at (``base``, ``base + r``, ``base + c``); the text after it
  starts at ``base + max(h, w)``.

So a text token at prompt index ``p`` has ids ``p + shift``, where ``shift`` sums
``max(h, w) - h * w`` over the images before it, and generated tokens continue with
the shift of the whole prompt (the request's delta). The ids depend on the request's
own images only: they are the same whether a step computes the prompt whole, in
chunks that split an image, after a prefix-cache hit or again after preemption.

Invariants:
- An image's placeholder positions are contiguous and number ``h * w`` (checked when
  the processor step builds the request's ImageInputs).
- ``mrope_positions(positions, images)[:, i]`` depends on ``positions[i]`` and the
  images alone.
- No image's placeholders run straight into the next image's (refused: the models
  read one run of image tokens as one image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .inputs import ImageInput

if TYPE_CHECKING:
    from ..core.scheduler import ScheduledRequest


def mrope_delta(images: Sequence[ImageInput]) -> int:
    """How far a request's generated tokens' ids run ahead of their index: the sum of
    ``max(h, w) - h * w`` over its images."""
    return sum(_advance(image) - image.num_rows for image in images)


def mrope_positions(positions: np.ndarray, images: Sequence[ImageInput]) -> np.ndarray:
    """The [3, n] int64 M-RoPE ids of one request's tokens at prompt/output indices
    ``positions`` [n] (any order, any chunk), given its images in prompt order."""
    # positions: [n] int64
    ids = np.broadcast_to(positions, (3, len(positions))).copy()
    shift = 0  # the sum over images before the current one
    for image in images:
        assert image.grid is not None, f"image {image.image_hash} has no M-RoPE grid"
        _, _, width = image.grid
        inside = (positions >= image.start) & (positions < image.end)
        if inside.any():
            rows = positions[inside] - image.start
            base = image.start + shift
            ids[0, inside] = base
            ids[1, inside] = base + rows // width
            ids[2, inside] = base + rows % width
        shift += _advance(image) - image.num_rows
        ids[:, positions >= image.end] += _advance(image) - image.num_rows
    return ids


def step_mrope_positions(scheduled: Sequence[ScheduledRequest], query_start_loc: np.ndarray,
                         positions: np.ndarray) -> np.ndarray:
    """A packed step's [3, 1, T] M-RoPE ids: request i's tokens lie at
    ``query_start_loc[i]:query_start_loc[i + 1]`` of ``positions`` [T]; a request
    without images has its 1-D positions in all three rows, one past its last image
    (decoding) its positions plus its delta."""
    shift = np.zeros(len(scheduled), dtype=np.int64)
    inside: list[int] = []  # requests computing tokens at or before their last image
    for index, item in enumerate(scheduled):
        images = item.request.images
        if not images:
            continue
        if item.start >= images[-1].end:
            shift[index] = mrope_delta(images)
        else:
            inside.append(index)
    ids = np.broadcast_to(positions + np.repeat(shift, np.diff(query_start_loc)), (3, len(positions))).copy()
    for index in inside:
        first, last = int(query_start_loc[index]), int(query_start_loc[index + 1])
        ids[:, first:last] = mrope_positions(positions[first:last], scheduled[index].request.images)
    return ids[:, None]


def check_mrope_image(request_id: str, image: ImageInput) -> None:
    """ValueError naming the request when an image's placeholders cannot take M-RoPE ids:
    not contiguous, or not one per grid cell."""
    assert image.grid is not None, f"image {image.image_hash} has no M-RoPE grid"
    frames, height, width = image.grid
    if frames != 1 or image.num_rows != height * width or image.end - image.start != image.num_rows:
        raise ValueError(f"request {request_id!r}: an image's {image.num_rows} placeholder tokens at prompt "
                         f"positions {image.start}..{image.end - 1} do not form its {frames}x{height}x{width} "
                         "token grid (one contiguous run of height * width tokens, one frame)")


def check_adjacent_images(request_id: str, images: Sequence[ImageInput]) -> None:
    """ValueError naming the request when one image's placeholders run straight into the
    next one's: the models read a run of image tokens as one image (transformers' rope
    index then fails), so their prompts put text (the vision end and start markers)
    between images."""
    for before, after in zip(images, images[1:]):
        if after.start == before.end:
            raise ValueError(f"request {request_id!r}: two images' placeholder tokens are adjacent (prompt positions "
                             f"{before.start}..{after.end - 1}); this model reads a run of image tokens as one image, "
                             "so each image needs its own markers (<|vision_start|>, <|vision_end|>) or text between")


def _advance(image: ImageInput) -> int:
    """How far an image moves the next text token's ids: max(h, w)."""
    assert image.grid is not None, f"image {image.image_hash} has no M-RoPE grid"
    return max(image.grid[1], image.grid[2])
