"""The processor step: a prompt with images becomes token ids in which each image is
expanded into the model's placeholder tokens, plus one ImageInput per image (its
hash, the positions its encoder rows fill, its pixel tensors).

The model's own processor (transformers' AutoProcessor, read from the model
directory) does the expansion and the pixel preprocessing, so the engine's prompt is
the one transformers' generate sees. A text prompt goes through the processor whole;
a token prompt (``prompt_token_ids``, and chats, which the chat template renders)
holds one placeholder token per image, which is replaced by what the processor
writes for that image alone.

Runs on the caller's threads (llm.py's worker pool): images are decoded and hashed
in parallel, the processor is called under a lock. The processor's image processor is
wrapped by a cache of its outputs by image hash (engine/multimodal/pixel_cache.py), so
an image that recurs is resized and normalized once, around a shorter path through
transformers' PIL image processors (engine/multimodal/fast_pixels.py). Where the
processor's text expansion may be spliced (engine/multimodal/expansion.py), a prompt
whose images' sizes were seen before is tokenized as written and expanded without the
processor.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from PIL import Image

from ..config import ConfigError, EngineConfig
from .expansion import Expansions
from .fast_pixels import FastPixels
from .image_only import load_processor
from .inputs import ImageInput, ProcessedPrompt
from .loading import MediaOptions, as_image
from .media import media_uuids, refuse_image_options, refuse_media
from .mrope import check_adjacent_images, check_mrope_image
from .pixel_cache import PixelCache
from .specs import VisionSpec, vision_spec

logger = logging.getLogger(__name__)

# Processor outputs that are not an image's own tensors.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


def image_hash(image: Image.Image, uuid: str | None) -> str:
    """The name of an image's pixels (``uuid`` when the user named it)."""
    if uuid is not None:
        return f"uuid:{uuid}"
    # SHA-256 through OpenSSL, which takes the CPU's SHA instructions where it has them
    # (faster than blake2b over a photo's pixels).
    hasher = hashlib.sha256()
    hasher.update(f"{image.mode}:{image.size}".encode())
    hasher.update(image.tobytes())
    return hasher.hexdigest()


@dataclass(frozen=True)
class MultimodalProcessor:
    """Expands image prompts for one vision-language model (see the module docstring)."""

    processor: Any  # a transformers ProcessorMixin
    spec: VisionSpec
    image_token_id: int
    max_images: int | None
    media_options: MediaOptions
    model: str
    hf_config: transformers.PretrainedConfig | None = None  # read by the spec's grid (M-RoPE models)
    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)  # mm_processor_kwargs, on every call
    # The processor's tokenizer is not safe to call from two threads at once (its Rust
    # side refuses a second borrow); image decoding and hashing run unlocked.
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    expansions: Expansions = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "expansions", Expansions.of(self.processor, self.prompt_token_id))

    @classmethod
    def load(cls, config: EngineConfig, hf_config: transformers.PretrainedConfig) -> MultimodalProcessor | None:
        """The processor of ``config.model`` if it is a vision-language model shardline
        runs with images, else None."""
        spec = vision_spec(hf_config)
        if spec is None:
            refuse_image_options(config, f"{config.model!r} takes no images here")
            return None
        kwargs = _processor_kwargs(config, spec)
        processor = load_processor(config.tokenizer or config.model, hf_config.model_type,
                                   revision=config.tokenizer_revision or config.revision,
                                   trust_remote_code=config.trust_remote_code)
        if processor is None or getattr(processor, "image_processor", None) is None:
            logger.warning("%s is a vision-language model without an image processor in its directory: it runs as "
                           "a text model, and its image prompts are refused", config.model)
            refuse_image_options(config, f"{config.model!r} has no image processor")
            return None
        processor.image_processor = PixelCache(FastPixels(processor.image_processor),
                                               int(config.mm_processor_cache_gb * (1 << 30)))
        limits = config.limit_mm_per_prompt or {}
        max_images = limits.get("image", spec.max_images)
        if spec.max_images is not None and max_images is not None:
            max_images = min(max_images, spec.max_images)
        options = MediaOptions(config.allowed_local_media_path, config.allowed_media_domains)
        return cls(processor, spec, spec.image_token_id(hf_config), max_images, options, config.model, hf_config,
                   kwargs)

    @property
    def image_token(self) -> str:
        token = self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
        assert isinstance(token, str), f"image token id {self.image_token_id} has no token"
        return token

    @property
    def prompt_token(self) -> str:
        """The token a prompt holds where an image goes: the processor's ``image_token``
        (Gemma 3's ``<start_of_image>``, which it expands into the row placeholders
        between its own markers), else the row placeholder itself."""
        token = getattr(self.processor, "image_token", None)
        return token if isinstance(token, str) else self.image_token

    @property
    def prompt_token_id(self) -> int:
        token_id = self.processor.tokenizer.convert_tokens_to_ids(self.prompt_token)
        assert isinstance(token_id, int), f"image token {self.prompt_token!r} has no id"
        return token_id

    def process(self, request_id: str, prompt: Mapping[str, Any], media: Mapping[str, Sequence[Any]]) \
            -> ProcessedPrompt:
        """The prompt's token ids with its images expanded, and its ImageInputs.
        ValueError naming the request for a modality the model does not take, an image
        that cannot be used, too many images, or placeholders that do not match them."""
        refuse_media(request_id, media, self.model, accepted=("image",))
        uuids = media_uuids(request_id, prompt, media)["image"]
        images = [as_image(request_id, item, f"image {index}") for index, item in enumerate(media["image"])]
        hashes = [image_hash(image, uuid) for image, uuid in zip(images, uuids)]
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(f"request {request_id!r} has {len(images)} images; model {self.model!r} takes at "
                             f"most {self.max_images} per prompt (limit_mm_per_prompt)")
        if "prompt_token_ids" in prompt:
            token_ids, pixels, counts = self._expand_token_ids(request_id, prompt["prompt_token_ids"], images,
                                                               hashes)
            text = prompt.get("prompt")
        else:
            text = prompt.get("prompt")
            if not isinstance(text, str) or not text:
                raise ValueError(f"request {request_id!r}: an image prompt needs a non-empty 'prompt' str or "
                                 "'prompt_token_ids'")
            token_ids, pixels, counts = self._process_text(request_id, text, images, hashes)
        positions = [i for i, token_id in enumerate(token_ids) if token_id == self.image_token_id]
        if sum(counts) != len(positions):
            raise ValueError(f"request {request_id!r}: the prompt has {len(positions)} image placeholder tokens "
                             f"where its {len(images)} image(s) need {sum(counts)}")
        inputs, first = [], 0
        for name, pixel_inputs, count in zip(hashes, pixels, counts):
            grid = None
            if self.spec.grid is not None:
                assert self.hf_config is not None, "an M-RoPE model's processor step without its config"
                grid = self.spec.grid(pixel_inputs, self.hf_config)
            inputs.append(ImageInput(name, tuple(positions[first:first + count]), pixel_inputs,
                                     grid, bidirectional=self.spec.bidirectional))
            if grid is not None:
                check_mrope_image(request_id, inputs[-1])
            first += count
        if self.spec.grid is not None:
            check_adjacent_images(request_id, inputs)
        return ProcessedPrompt(text, token_ids, tuple(inputs))

    def load_check_prompt(self, vocab_size: int) -> ProcessedPrompt:
        """The load check's image probe: a few text tokens, one noise image, a few more."""
        generator = torch.Generator().manual_seed(1)
        placeholders = (self.image_token_id, self.prompt_token_id)
        before, after = ([token_id if token_id not in placeholders else 3 for token_id in
                          torch.randint(3, vocab_size, (count,), generator=generator).tolist()] for count in (3, 4))
        picture = load_check_image()
        prompt = {"prompt_token_ids": [*before, self.prompt_token_id, *after], "multi_modal_data": {"image": picture}}
        return self.process("load-check-image", prompt, {"image": [picture]})

    def _call(self, request_id: str, text: str, images: list[Image.Image], hashes: list[str],
              expansion_of: Image.Image | None = None, **kwargs: Any) -> Any:
        """The processor's output for ``text`` and ``images``; with ``expansion_of``
        (a call on that one image alone), its expansion is kept for the image's size."""
        try:
            with self.lock:
                cache = self.processor.image_processor
                kwargs = {**self.processor_kwargs, **kwargs}
                if not isinstance(cache, PixelCache):
                    return self.processor(text=[text], images=images, return_tensors="pt", **kwargs)
                cache.declare({id(image): name for image, name in zip(images, hashes)})
                try:
                    outputs = self.processor(text=[text], images=images, return_tensors="pt", **kwargs)
                finally:
                    cache.declare({})  # ids of this call's images name nothing afterwards
                if expansion_of is not None:  # the arguments of this call's image processor call
                    self.expansions.put(expansion_of, outputs["input_ids"][0].tolist(), cache.last_call)
                return outputs
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: the model's processor cannot take this prompt and its "
                             f"{len(images)} image(s): {exc}") from exc

    def _process_text(self, request_id: str, text: str, images: list[Image.Image], hashes: list[str]) \
            -> tuple[list[int], list[dict[str, torch.Tensor]], list[int]]:
        spliced = self._splice_text(request_id, text, images, hashes) if self.expansions.splices else None
        if spliced is not None:
            return spliced
        outputs = self._call(request_id, text, images, hashes)
        token_ids = outputs["input_ids"][0].tolist()
        counts = self._counts(request_id, token_ids, images)
        pixels = self._split(outputs, counts)
        return token_ids, pixels, counts

    def _split(self, outputs: Mapping[str, Any], counts: list[int]) -> list[dict[str, torch.Tensor]]:
        """The processor's image tensors, one dict per image of ``counts[i]`` placeholder
        rows (the spec's split, else each tensor's leading rows)."""
        if self.spec.split_by_rows is not None:
            return self.spec.split_by_rows(outputs, counts)
        return (self.spec.split or _split_images)(outputs, len(counts))

    def _counts(self, request_id: str, token_ids: list[int], images: list[Image.Image]) -> list[int]:
        """How many placeholder tokens each image of a processed text prompt has."""
        total = sum(1 for token_id in token_ids if token_id == self.image_token_id)
        if self.spec.views is not None:  # views of as many rows each (Gemma 3's image and its crops)
            views = self.spec.views(self.processor, images, self.processor_kwargs)
            if total % sum(views):
                raise ValueError(f"request {request_id!r}: the prompt's {total} image placeholder tokens do not "
                                 f"split into its images' {sum(views)} views")
            return [count * (total // sum(views)) for count in views]
        if self.spec.count_rows is not None:
            counts = self.spec.count_rows(self.processor, token_ids, self.image_token_id)
            if len(counts) != len(images) or sum(counts) != total:
                raise ValueError(f"request {request_id!r}: the prompt's {total} image placeholder tokens do not "
                                 f"split into its {len(images)} images' runs")
            return counts
        count_tokens = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count_tokens is not None:
            data = count_tokens(image_sizes=[(image.height, image.width) for image in images])
            counts = list(data.num_image_tokens)
            if sum(counts) == total:
                return counts
            # Tiled images (Idefics3): as many rows in every tile, its tiles counted per image.
            tiles = list(getattr(data, "num_image_patches", None) or ())
            if self.spec.split_by_rows is not None and tiles and total % sum(tiles) == 0:
                return [count * (total // sum(tiles)) for count in tiles]
        if total % len(images):
            raise ValueError(f"request {request_id!r}: {total} image placeholder tokens do not split evenly "
                             f"among {len(images)} images")
        return [total // len(images)] * len(images)

    def _expand_token_ids(self, request_id: str, token_ids: Any, images: list[Image.Image], hashes: list[str]) \
            -> tuple[list[int], list[dict[str, torch.Tensor]], list[int]]:
        """Replace the one placeholder token of each image by its processor expansion."""
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a non-empty list of ints")
        prompt_token_id = self.prompt_token_id
        found = [i for i, token_id in enumerate(token_ids) if token_id == prompt_token_id]
        if len(found) != len(images):
            raise ValueError(f"request {request_id!r}: prompt_token_ids hold {len(found)} image placeholder "
                             f"token(s) ({self.prompt_token!r}, id {self.prompt_token_id}) for {len(images)} "
                             "image(s); put one where each image goes")
        return self._splice(token_ids, found, [self._expand_image(request_id, image, name)
                                               for image, name in zip(images, hashes)])

    def _splice(self, token_ids: Sequence[int], found: list[int],
                expansions: list[tuple[list[int], Mapping[str, Any]]]) \
            -> tuple[list[int], list[dict[str, torch.Tensor]], list[int]]:
        """``token_ids`` with the placeholder at each of ``found`` replaced by its image's
        expansion, and each image's tensors and rows."""
        expanded: list[int] = []
        pixels, counts, previous = [], [], 0
        for position, (expansion, outputs) in zip(found, expansions):
            expanded += list(token_ids[previous:position]) + expansion
            counts.append(expansion.count(self.image_token_id))
            pixels += self._split(outputs, counts[-1:])
            previous = position + 1
        return expanded + list(token_ids[previous:]), pixels, counts

    def _expand_image(self, request_id: str, image: Image.Image, name: str) -> tuple[list[int], Mapping[str, Any]]:
        """One image's placeholder expansion and its image tensors: from its size's known
        expansion and the image processor alone, else from the processor."""
        known = self.expansions.get(image)
        if known is None:
            outputs = self._call(request_id, self.prompt_token, [image], [name], expansion_of=image,
                                 add_special_tokens=False)
            return outputs["input_ids"][0].tolist(), outputs
        unused = set(getattr(self.processor, "unused_input_names", None) or ())
        with self.lock:
            cache = self.processor.image_processor
            if not isinstance(cache, PixelCache):
                outputs = cache([image], *known.args, **known.kwargs)
            else:
                cache.declare({id(image): name})
                try:  # the pixels go to the encoder's batch by concatenation, unchanged: no copy
                    outputs = cache.shared([image], *known.args, **known.kwargs)
                finally:
                    cache.declare({})
        return list(known.token_ids), {key: value for key, value in outputs.items() if key not in unused}

    def _splice_text(self, request_id: str, text: str, images: list[Image.Image], hashes: list[str]) \
            -> tuple[list[int], list[dict[str, torch.Tensor]], list[int]] | None:
        """A text prompt tokenized as written, each placeholder replaced by its image's
        expansion (engine/multimodal/expansion.py); None where that would not be the
        processor's output (placeholders that do not match the images, an expansion that
        does not splice: then the processor answers)."""
        with self.lock:
            token_ids = list(self.processor.tokenizer(text)["input_ids"])
        prompt_token_id = self.prompt_token_id
        found = [i for i, token_id in enumerate(token_ids) if token_id == prompt_token_id]
        if len(found) != len(images):
            return None
        expansions = [self._expand_image(request_id, image, name) for image, name in zip(images, hashes)]
        if not all(self.expansions.splicable(expansion) for expansion, _ in expansions):
            self.expansions.splices = False  # this processor's expansions hold text: it expands prompts itself
            return None
        return self._splice(token_ids, found, expansions)


def _processor_kwargs(config: EngineConfig, spec: VisionSpec) -> dict[str, Any]:
    """``config.mm_processor_kwargs`` when the model's processor takes each key here
    (VisionSpec.processor_kwargs); ConfigError naming the first key it does not."""
    kwargs = dict(config.mm_processor_kwargs or {})
    unknown = sorted(set(kwargs) - spec.processor_kwargs)
    if unknown:
        accepted = ", ".join(sorted(spec.processor_kwargs)) or "none"
        raise ConfigError(f"mm_processor_kwargs key {unknown[0]!r} is not taken for {spec.model_type} models "
                          f"(accepted: {accepted})")
    return kwargs


def _split_images(outputs: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
    """The processor's image tensors, one dict per image (each keeps a batch dim of 1)."""
    tensors = {key: value for key, value in outputs.items()
               if key not in _TEXT_KEYS and isinstance(value, torch.Tensor)}
    for key, value in tensors.items():
        assert value.shape[0] == num_images, f"processor output {key} {tuple(value.shape)} for {num_images} images"
    return [{key: value[i : i + 1] for key, value in tensors.items()} for i in range(num_images)]


def load_check_image(seed: int = 0) -> Image.Image:
    """A noise image for the load check's probe (any size: the processor resizes it)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (40, 48, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())
