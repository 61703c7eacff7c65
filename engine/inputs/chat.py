"""Rendering chat conversations into prompts with the tokenizer's chat template."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..multimodal.media import MEDIA_PART_TYPES

if TYPE_CHECKING:  # only the annotations name it: importing this module loads no transformers
    from transformers import PreTrainedTokenizerBase

CONTENT_FORMATS = ("auto", "string", "openai")

# A template that loops over a message's content, or tests whether it is a string,
# expects OpenAI-style content parts.
_ITERATES_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)|content['\"]?\]?\s+is\s+(not\s+)?string"
)


class ChatRenderError(ValueError):
    """A conversation is malformed or the chat template cannot render it."""


@dataclass
class ChatOptions:
    """How conversations are rendered (vLLM's LLM.chat keyword arguments)."""

    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None  # JSON schemas or Python functions
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {self.chat_template_content_format!r}"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message, which cannot be combined "
                "with add_generation_prompt=True (which starts a new assistant turn); set one of them"
            )
        self.chat_template_kwargs = dict(self.chat_template_kwargs or {})


def is_conversation(value: Any) -> bool:
    """True for one conversation (a list of message dicts), False for a list of them."""
    return isinstance(value, Sequence) and not isinstance(value, str) and (
        len(value) == 0 or isinstance(value[0], dict)
    )


def _text_of(content: Any, where: str, media: list[dict] | None = None) -> str:
    """The text of a message's content; image parts go to ``media`` (a model that
    takes images) or are refused (``media`` None)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            modality = MEDIA_PART_TYPES.get(str(part.get("type"))) if isinstance(part, dict) else None
            if modality == "image" and media is not None:
                media.append(part)
                continue
            if modality is not None:
                raise ChatRenderError(
                    f"{where}: a {part['type']!r} part carries {modality} input, which this model cannot take; "
                    "the conversation is refused rather than run without it")
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatRenderError(
                    f"{where}: content parts must be {{'type': 'text', 'text': str}}, got {part!r:.100}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatRenderError(f"{where}: content must be a string or a list of text parts, got {content!r:.100}")


def normalize_messages(conversation: Any, content_format: str, media: list[dict] | None = None) -> list[dict]:
    """Validate messages and shape their content as the template expects. With
    ``media`` (a model that takes images), image parts are appended to it in order and
    become transformers' ``{"type": "image"}`` parts, which the template renders as the
    model's image placeholder."""
    if not isinstance(conversation, Sequence) or isinstance(conversation, str) or not conversation:
        raise ChatRenderError(f"a conversation must be a non-empty list of messages, got {conversation!r:.100}")
    messages = []
    for position, message in enumerate(conversation):
        where = f"message {position}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatRenderError(f"{where} must be a dict with a string 'role', got {message!r:.100}")
        message = dict(message)
        content = message.get("content")
        num_media = len(media) if media is not None else 0
        text = _text_of(content, where, media)  # validates the parts too
        if media is not None and len(media) > num_media and isinstance(content, list):
            if content_format == "string":
                raise ChatRenderError(f"{where} has image parts, but the chat template takes string content, "
                                      "where they would be lost (chat_template_content_format='openai' keeps them)")
            message["content"] = [{"type": "image"} if MEDIA_PART_TYPES.get(str(part.get("type"))) else part
                                  for part in content]
        elif content_format == "string":
            message["content"] = text
        elif not isinstance(content, list):
            message["content"] = [{"type": "text", "text": text}]
        messages.append(message)
    return messages


def resolve_content_format(options: ChatOptions, tokenizer: PreTrainedTokenizerBase) -> str:
    if options.chat_template_content_format != "auto":
        return options.chat_template_content_format
    template = options.chat_template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default", "")
    return "openai" if _ITERATES_CONTENT.search(template) else "string"


def render_chat(tokenizer: PreTrainedTokenizerBase, conversation: Any, options: ChatOptions,
                media: list[dict] | None = None) -> list[int]:
    """Token ids of ``conversation`` rendered with the chat template; with ``media``, a
    model that takes images: their parts are appended to it (see normalize_messages)."""
    messages = normalize_messages(conversation, resolve_content_format(options, tokenizer), media)
    # transformers takes tools as JSON schemas or functions (a list of either).
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None if options.tools is None else list(options.tools)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=options.chat_template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tools=tools,
            tokenize=False,
            **options.chat_template_kwargs,
        )
    except Exception as exc:  # jinja2 raises many types; all mean "cannot render"
        raise ChatRenderError(f"the chat template cannot render this conversation: {exc}") from exc
    assert isinstance(text, str), "apply_chat_template(tokenize=False) renders one string"
    # The template already wrote any BOS it wants; do not add another.
    return tokenizer(text, add_special_tokens=False).input_ids


def structured_delimiters(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """Special tokens that come as an opening/closing pair ("<x>" and "</x>"), such as
    thinking or tool-call markers: the model's structured output delimiters."""
    special = {
        token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special
    }
    return {t for t in special if t.startswith("<") and not t.startswith("</") and "</" + t[1:] in special} | {
        t for t in special if t.startswith("</") and "<" + t[2:] in special
    }


def keeps_special_tokens(tokenizer: PreTrainedTokenizerBase, options: ChatOptions) -> bool:
    """Whether outputs must keep special tokens so structured parts stay parseable:
    tools or thinking are on and the tokenizer has structured delimiters."""
    wants_structure = bool(options.tools) or bool(options.chat_template_kwargs.get("enable_thinking"))
    return wants_structure and bool(structured_delimiters(tokenizer))
