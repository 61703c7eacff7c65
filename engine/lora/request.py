"""LoRA adapter requests (vLLM's LoRARequest) and the rules that pick one per prompt.

This module imports no torch: the pipeline's row parsing and the engine's request
validation use it. The adapter files are read in ``lora_adapter.py``, the batched
layers live in ``lora/layers.py`` and the slot cache in ``lora/manager.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class LoRAError(ValueError):
    """A LoRA adapter cannot be used: missing files, rank too large, modules the
    model lacks, an unsupported PEFT option, or a conflicting adapter id."""


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT-format adapter directory to apply to one request.

    ``lora_int_id`` must be positive and unique per adapter within one engine: it
    is the adapter's identity in the slot cache and in the prefix cache.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")


def lora_cache_salt(lora_request: LoRARequest | None) -> tuple[str, int] | None:
    """The prefix-cache salt of a request's adapter (None without one).

    KV computed under one adapter is wrong for any other, so the salt separates
    them. The id suffices because the LoRAManager rejects an id that is reused for
    a different path within one engine; the tuple has a stable repr, as the KV
    cache's block hash requires.
    """
    return None if lora_request is None else ("lora", lora_request.lora_int_id)


def resolve_lora_request(
    prompt: Any,
    explicit_lora_request: LoRARequest | None,
    default_mm_loras: Mapping[str, str] | None,
) -> LoRARequest | None:
    """The adapter a prompt runs with, under vLLM's default per-modality LoRA rule.

    ``default_mm_loras`` maps a modality ("image", "audio", ...) to an adapter
    directory. A prompt dict whose ``multi_modal_data`` holds exactly one modality
    with a registered default gets that adapter, named after the modality, with id
    = the modality's position among the sorted registered modalities + 1. Conflicts:
    - an explicit request always wins; a warning is logged when its id differs from
      the modality's default id;
    - a prompt matching several registered modalities gets the explicit request (or
      none), with a warning, since a request carries one adapter.
    Every other prompt keeps ``explicit_lora_request`` unchanged.
    """
    if not default_mm_loras or not isinstance(prompt, Mapping):
        return explicit_lora_request
    mm_data = prompt.get("multi_modal_data")
    if not isinstance(mm_data, Mapping):
        return explicit_lora_request
    matching = sorted(set(mm_data) & set(default_mm_loras))
    if not matching:
        return explicit_lora_request
    if len(matching) > 1:
        logger.warning(
            "prompt uses modalities %s, which all have default LoRA adapters; a request "
            "applies one adapter, so none of these defaults is used (keeping %r)",
            matching, explicit_lora_request,
        )
        return explicit_lora_request
    modality = matching[0]
    default_id = sorted(default_mm_loras).index(modality) + 1
    if explicit_lora_request is not None:
        if explicit_lora_request.lora_int_id != default_id:
            logger.warning(
                "prompt uses modality %r, whose default LoRA has id %d, but LoRA request %r was "
                "given explicitly; the explicit request is used",
                modality, default_id, explicit_lora_request,
            )
        return explicit_lora_request
    return LoRARequest(modality, default_id, default_mm_loras[modality])
