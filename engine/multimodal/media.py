"""The media a prompt carries (vLLM's ``multi_modal_data``), validated before any
model work: which modalities, how many items, and whether the model takes them.

Invariant: a prompt's media are used or the request is refused; never dropped.
This module imports no torch and no PIL at import time: the pipeline's row checks
and the pooling engine read it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..config import ConfigError, EngineConfig

# The fields of a prompt dict the engines read (vLLM's TextPrompt and TokensPrompt).
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids")
# The modalities vLLM's offline API names; the engine runs images (on vision models).
MODALITIES = ("image", "audio", "video")
# Chat content part types that carry media, and their modality (vLLM's part names).
MEDIA_PART_TYPES = {
    "image_url": "image", "image_pil": "image", "image_embeds": "image", "input_image": "image",
    "image": "image", "audio_url": "audio", "input_audio": "audio", "audio": "audio",
    "video_url": "video", "video": "video",
}
# Engine options only an engine that takes images reads (vLLM's names).
IMAGE_OPTIONS = ("mm_processor_kwargs", "limit_mm_per_prompt", "allowed_local_media_path", "allowed_media_domains")


def refuse_image_options(config: EngineConfig, why: str) -> None:
    """ConfigError naming the first of IMAGE_OPTIONS that ``config`` sets, for an engine
    that takes no images (``why``: which and why); an option that cannot apply is
    refused, never ignored."""
    for name in IMAGE_OPTIONS:
        if getattr(config, name):
            raise ConfigError(f"{name} is set, but {why}")


def check_prompt_keys(request_id: str, prompt: Any) -> None:
    """ValueError naming the request when a prompt dict has a field no engine reads
    (a misspelt ``multi_modal_data`` must not run as a text prompt)."""
    if not isinstance(prompt, Mapping):
        return
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if unknown:
        raise ValueError(f"request {request_id!r}: unknown prompt field(s) {', '.join(map(repr, unknown))}; "
                         f"a prompt dict takes {', '.join(PROMPT_KEYS)}")


def prompt_media(request_id: str, prompt: Any) -> dict[str, list[Any]]:
    """The prompt's media: modality -> its items (a single item becomes a list of one);
    empty for a str or a dict without media. ValueError naming the request for a
    malformed ``multi_modal_data`` or ``multi_modal_uuids``."""
    if not isinstance(prompt, Mapping):
        return {}
    data = prompt.get("multi_modal_data")
    uuids = prompt.get("multi_modal_uuids")
    if data is None:
        if uuids:
            raise ValueError(f"request {request_id!r}: multi_modal_uuids names media, but the prompt has no "
                             "multi_modal_data")
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"request {request_id!r}: multi_modal_data must be a dict of modality -> item(s), "
                         f"got {type(data).__name__}")
    media: dict[str, list[Any]] = {}
    for modality, items in data.items():
        if modality not in MODALITIES:
            raise ValueError(f"request {request_id!r}: multi_modal_data has modality {modality!r}; the "
                             f"modalities are {', '.join(MODALITIES)}")
        listed = list(items) if isinstance(items, (list, tuple)) else [items]
        if listed:
            media[modality] = listed
    return media


def media_uuids(request_id: str, prompt: Any, media: Mapping[str, Sequence[Any]]) -> dict[str, list[str | None]]:
    """``multi_modal_uuids`` lined up with ``media``: modality -> one name (or None) per
    item. ValueError naming the request when the shapes differ or a name is not a str."""
    uuids = prompt.get("multi_modal_uuids") if isinstance(prompt, Mapping) else None
    if uuids is None:
        return {modality: [None] * len(items) for modality, items in media.items()}
    if not isinstance(uuids, Mapping):
        raise ValueError(f"request {request_id!r}: multi_modal_uuids must be a dict of modality -> name(s), "
                         f"got {type(uuids).__name__}")
    result: dict[str, list[str | None]] = {}
    for modality, items in media.items():
        names = uuids.get(modality)
        listed: list[str | None] = ([None] * len(items) if names is None
                                    else list(names) if isinstance(names, (list, tuple)) else [names])
        if len(listed) != len(items) or not all(name is None or isinstance(name, str) for name in listed):
            raise ValueError(f"request {request_id!r}: multi_modal_uuids[{modality!r}] must hold one str (or "
                             f"None) per {modality} item ({len(items)}), got {names!r:.100}")
        result[modality] = listed
    extra = sorted(set(uuids) - set(media))
    if extra:
        raise ValueError(f"request {request_id!r}: multi_modal_uuids names modality(ies) {extra} that "
                         "multi_modal_data does not carry")
    return result


def refuse_media(request_id: str, media: Mapping[str, Sequence[Any]], model: str,
                 accepted: Sequence[str] = ()) -> None:
    """ValueError naming the request and the modality when ``media`` holds a modality
    the model does not take (``accepted``): running without it would be silently wrong."""
    for modality, items in media.items():
        if modality in accepted:
            continue
        if accepted:
            why = f"it takes {', '.join(accepted)} input only"
        else:
            why = "it is a text-only model (no processor of its takes images, audio or video)"
        raise ValueError(f"request {request_id!r} carries {len(items)} {modality} item(s) (multi_modal_data"
                         f"[{modality!r}]), but model {model!r} cannot take {modality} input: {why}; the "
                         "request is refused rather than run without it")
