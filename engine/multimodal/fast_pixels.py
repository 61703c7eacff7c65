"""A shorter path through transformers' PIL-backed image processors for RGB images:
the same resize, centre crop, rescale and normalize, without the per-call argument
checks, the image's round trips between PIL and numpy and the float64 pass over every
pixel.

The resize is the processor's own PIL call on the same pixels. Rescale and normalize
act on each channel's uint8 values one by one, so their result for a value is a table
of 256 entries per channel, computed once per setting by the processor's own
``rescale`` and ``normalize`` on the 256 values: a lookup gives exactly the processor's
floats (tests/engine/multimodal/test_fast_pixels.py asserts bit-equality per family).

Invariants:
- The path is taken only for a processor whose class keeps PilBackend's preprocessing
  methods (a model that overrides one, such as LLaVA-NeXT's tiling, always runs its
  own), for RGB PIL images and settings this module reads in full; any other call is
  passed to the processor as it is.
- Its answer has the processor's keys, dtypes and values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_transforms import get_resize_output_image_size
from transformers.image_utils import ChannelDimension

# PilBackend's methods a processor class must keep for the path to be its equal.
_BACKEND_METHODS = ("__call__", "preprocess", "_preprocess_image_like_inputs", "_prepare_image_like_inputs",
                    "process_image", "convert_to_rgb", "_preprocess", "resize", "center_crop", "rescale",
                    "normalize", "_standardize_kwargs")
# Settings the path reads; every other resolved setting must be unset (None or False).
_READ = frozenset({"return_tensors", "do_convert_rgb", "do_resize", "size", "resample", "do_center_crop",
                   "crop_size", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                   "default_to_square"})


def takes_fast_path(image_processor: Any) -> bool:
    """Whether ``image_processor`` preprocesses as PilBackend itself does."""
    if not isinstance(image_processor, PilBackend):
        return False
    cls = type(image_processor)
    return all(getattr(cls, name) is getattr(PilBackend, name) for name in _BACKEND_METHODS)


class FastPixels:
    """Wraps an image processor (see the module docstring); every other attribute is
    the wrapped processor's."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor
        self.enabled = takes_fast_path(image_processor)
        self._plans: dict[str, _Plan | None] = {}

    def __call__(self, images: Any, *args: Any, **kwargs: Any) -> Any:
        pictures = images if isinstance(images, (list, tuple)) else [images]
        plan = self._plan(kwargs) if self.enabled and not args else None
        if plan is None or not pictures or not all(_is_rgb(picture) for picture in pictures):
            return self.image_processor(images, *args, **kwargs)
        arrays = [array for array in (plan.crop(picture) for picture in pictures) if array is not None]
        if len(arrays) != len(pictures) or len({array.shape for array in arrays}) != 1:
            # A crop larger than the image (the processor pads it), or images of several sizes.
            return self.image_processor(images, *args, **kwargs)
        return BatchFeature({"pixel_values": plan.lookup(arrays)})

    def __getattr__(self, name: str) -> Any:
        if name == "image_processor":  # not yet set (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.image_processor, name)

    def _plan(self, kwargs: Mapping[str, Any]) -> _Plan | None:
        key = repr(sorted(kwargs.items()))
        if key not in self._plans:
            self._plans[key] = _Plan.resolve(self.image_processor, kwargs)
        return self._plans[key]


def _is_rgb(picture: Any) -> bool:
    return isinstance(picture, Image.Image) and picture.mode == "RGB"


class _Plan:
    """One call's resolved settings: the resize and crop sizes and the value table."""

    def __init__(self, settings: Mapping[str, Any], table: np.ndarray) -> None:
        self.settings = settings
        self.table = table  # [3, 256]: channel c's output for uint8 value v at [c, v]

    @classmethod
    def resolve(cls, image_processor: Any, kwargs: Mapping[str, Any]) -> _Plan | None:
        """The settings ``image_processor.preprocess`` would use for ``kwargs`` (its
        defaults filled in as it fills them), None where this path does not read them all."""
        if not set(kwargs) <= _READ or kwargs.get("return_tensors") != "pt":
            return None
        settings = dict(kwargs)
        for name in image_processor._valid_kwargs_names:
            settings.setdefault(name, getattr(image_processor, name, None))
        settings = image_processor._standardize_kwargs(**settings)
        if any(value not in (None, False) for name, value in settings.items() if name not in _READ):
            return None
        # do_convert_rgb is read and has nothing to do: the path takes RGB images only.
        if settings.get("resample") is None:
            settings["resample"] = Image.Resampling.BILINEAR  # PilBackend.resize's default
        if not isinstance(settings["resample"], int):
            return None
        size, crop = settings.get("size"), settings.get("crop_size")
        if settings.get("do_resize") and (size is None or _resized(size, 1, 1) is None):
            return None
        if settings.get("do_center_crop") and (crop is None or not (crop.height and crop.width)):
            return None
        return cls(settings, _value_table(image_processor, settings))

    def crop(self, picture: Image.Image) -> np.ndarray | None:
        """One RGB image resized and cropped, [H, W, 3] uint8; None where it needs the
        processor (a crop larger than the resized image, which the processor pads)."""
        settings = self.settings
        if settings.get("do_resize"):
            height, width = _resized(settings["size"], picture.height, picture.width) or (0, 0)
            picture = picture.resize((width, height), resample=settings["resample"], reducing_gap=None)
        values = np.asarray(picture)
        if settings.get("do_center_crop"):
            crop = settings["crop_size"]
            top, left = (values.shape[0] - crop.height) // 2, (values.shape[1] - crop.width) // 2
            if top < 0 or left < 0:
                return None
            values = values[top : top + crop.height, left : left + crop.width]
        return values

    def lookup(self, arrays: list[np.ndarray]) -> torch.Tensor:
        """Images of one size, [H, W, 3] uint8 each, through the value table: [N, 3, H, W]."""
        height, width, channels = arrays[0].shape
        out = np.empty((len(arrays), channels, height, width), dtype=self.table.dtype)
        for index, values in enumerate(arrays):
            for channel in range(channels):
                np.take(self.table[channel], values[:, :, channel], out=out[index, channel])
        return torch.from_numpy(out)


def _resized(size: Any, height: int, width: int) -> tuple[int, int] | None:
    """(height, width) after PilBackend.resize for the two size forms the path reads."""
    if size.shortest_edge and not (size.longest_edge or size.max_height or size.height):
        # The processor's own rule, on a stand-in of the image's shape (it reads only the shape).
        stand_in = np.broadcast_to(np.uint8(0), (3, height, width))
        new_height, new_width = get_resize_output_image_size(stand_in, size=size.shortest_edge,
                                                             default_to_square=False,
                                                             input_data_format=ChannelDimension.FIRST)
        return int(new_height), int(new_width)
    if size.height and size.width and not (size.shortest_edge or size.longest_edge or size.max_height):
        return int(size.height), int(size.width)
    return None


def _value_table(image_processor: Any, settings: Mapping[str, Any]) -> np.ndarray:
    """Each channel's 256 uint8 values through the processor's own rescale and
    normalize, [3, 256]."""
    values: np.ndarray = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()  # [C, H=1, W]
    if settings.get("do_rescale"):
        values = image_processor.rescale(values, settings["rescale_factor"])
    if settings.get("do_normalize"):
        values = image_processor.normalize(values, settings["image_mean"], settings["image_std"])
    return np.ascontiguousarray(values).reshape(3, 256)
