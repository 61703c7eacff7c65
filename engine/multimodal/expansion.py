"""Each image's placeholder expansion, reused across prompts: the token ids the
processor writes for one image and the arguments its image processor took, by the
image's size. A prompt whose images' expansions are known is expanded without the
processor: its text is tokenized as written (one placeholder token per image) and each
placeholder replaced by its image's expansion, and each image goes straight to the
image processor with the arguments the processor gave it.

Why this is the processor's own output:
- Only processors that run transformers' generic ``__call__`` take this path: it
  replaces each placeholder in the text by a per-image string, tokenizes the result,
  and calls the image processor with arguments that do not depend on the text.
- An expansion is spliced only when each of its tokens, and the placeholder, is a
  special added token without whitespace stripping: the tokenizer splits the text at
  such tokens before it tokenizes the pieces between them, so the pieces between
  placeholders tokenize alike with one placeholder token or with the expansion's
  tokens in its place.
- The expansion and the image processor's arguments depend on the image's size and
  the engine's fixed processor settings, not on its pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image
from transformers.processing_utils import ProcessorMixin

# The generic ProcessorMixin steps a processor must keep for its text to be spliced.
_GENERIC_STEPS = ("__call__", "get_text_with_replacements", "_process_images")


@dataclass(frozen=True)
class Expansion:
    """One image size's placeholder token ids and its image processor call's
    arguments (the images themselves aside)."""

    token_ids: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Expansions:
    """The expansions of one processor by image (size, mode); ``splices`` whether the
    processor's text may be spliced at all (see the module docstring)."""

    splices: bool
    plain_special_ids: frozenset[int]
    by_size: dict[tuple[tuple[int, int], str], Expansion] = field(default_factory=dict)

    @classmethod
    def of(cls, processor: Any, prompt_token_id: int) -> Expansions:
        """The expansions of ``processor`` (empty), splicing when it runs the generic
        steps and its placeholder token is a plain special token."""
        cls_ = type(processor)
        generic = isinstance(processor, ProcessorMixin) and all(
            getattr(cls_, name) is getattr(ProcessorMixin, name) for name in _GENERIC_STEPS)
        decoder = getattr(processor.tokenizer, "added_tokens_decoder", {}) or {}
        plain = frozenset(token_id for token_id, token in decoder.items()
                          if getattr(token, "special", False) and not getattr(token, "lstrip", True)
                          and not getattr(token, "rstrip", True))
        return cls(generic and prompt_token_id in plain, plain)

    def get(self, image: Image.Image) -> Expansion | None:
        return self.by_size.get((image.size, image.mode))

    def put(self, image: Image.Image, token_ids: list[int], call: tuple[tuple, dict] | None) -> None:
        """Keep ``image``'s expansion when it splices and its image processor call is known."""
        if call is not None and self.splicable(token_ids):
            self.by_size[(image.size, image.mode)] = Expansion(tuple(token_ids), call[0], dict(call[1]))

    def splicable(self, token_ids: list[int]) -> bool:
        return self.splices and bool(token_ids) and self.plain_special_ids.issuperset(token_ids)
