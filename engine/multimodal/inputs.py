"""The typed objects a processed image prompt carries from the processor step to the
scheduler, the KV cache and the runner.

Invariants:
- ``ImageInput.positions`` are the prompt positions that take the image's encoder
  output rows, increasing; row ``i`` of the encoder output goes to ``positions[i]``.
- ``ImageInput.image_hash`` names the image's pixels (or the user's
  ``multi_modal_uuids`` name): two inputs with one hash have the same encoder output,
  so the encoder cache and the prefix cache may share it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of one prompt: its hash, the prompt positions its encoder rows fill,
    and the processor's tensors for it alone (as the model's forward takes one image's:
    e.g. ``pixel_values`` [1, C, H, W], or Qwen-VL's [patches, C * T * P * P] with
    ``image_grid_thw`` [1, 3]), which the vision encoder reads."""

    image_hash: str
    positions: tuple[int, ...]
    pixel_inputs: dict[str, torch.Tensor]
    # (frames, height, width) in placeholder tokens, for models whose rotary positions
    # follow the image's grid (M-RoPE, engine/multimodal/mrope.py); else None.
    grid: tuple[int, int, int] | None = None
    # Whether the image's rows attend to each other both ways (VisionSpec.bidirectional).
    bidirectional: bool = False

    @property
    def start(self) -> int:
        """The first prompt position the image fills."""
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past the last prompt position the image fills."""
        return self.positions[-1] + 1

    @property
    def num_rows(self) -> int:
        """The encoder output rows (one per position)."""
        return len(self.positions)

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """(first, last + 1) encoder rows whose positions lie in [start, end)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt after the model's processor: its text (None for token prompts), its
    token ids with every image expanded into its placeholder tokens, and its images in
    prompt order. ``LLMEngine.add_request`` takes it as it takes a raw prompt."""

    prompt: str | None
    prompt_token_ids: list[int]
    images: tuple[ImageInput, ...]
    modalities: tuple[str, ...] = ("image",)
