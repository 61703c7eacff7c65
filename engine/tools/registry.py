"""Tool-call parsers by vLLM's names, the one the chat template implies, and the one
function that reads a sample's calls (the output processor asks it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .calls import (
    MalformedToolCall,
    ToolCallOutput,
    ToolCallParser,
    ToolChoice,
    ToolParserError,
    check_calls,
    malformed,
)
from .deepseek import CALLS_BEGIN, DeepSeekParser
from .forced import forced_calls
from .harmony import HarmonyToolParser
from .hermes import OPEN, HermesParser
from .llama3 import PYTHON_TAG, Llama3JsonParser
from .mistral import TOOL_CALLS, MistralParser
from .qwen3_xml import Qwen3XmlParser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BUILDERS: dict[str, Callable[[PreTrainedTokenizerBase], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "deepseek_v3": lambda tokenizer: DeepSeekParser(tokenizer, "deepseek_v3"),
    "deepseek_v31": lambda tokenizer: DeepSeekParser(tokenizer, "deepseek_v31"),
    "openai": HarmonyToolParser,
    "qwen3_coder": lambda tokenizer: Qwen3XmlParser(tokenizer, "qwen3_coder"),
    "qwen3_xml": lambda tokenizer: Qwen3XmlParser(tokenizer, "qwen3_xml"),
}
TOOL_CALL_PARSERS = tuple(_BUILDERS)

# What a chat template writes when it shows the model how to call tools, most
# specific first: the first marker found names the parser (Qwen3-Coder's XML calls
# sit inside hermes' markers).
_TEMPLATE_MARKERS = (
    ("to=functions.", "openai"),
    ("<function=", "qwen3_coder"),
    (CALLS_BEGIN, "deepseek_v3"),
    (TOOL_CALLS, "mistral"),
    (OPEN, "hermes"),
    (PYTHON_TAG, "llama3_json"),
)


def make_tool_parser(name: str, tokenizer: PreTrainedTokenizerBase) -> ToolCallParser:
    """The parser ``name`` for ``tokenizer``; ToolParserError for an unknown name or a
    tokenizer without the format's special tokens."""
    if name not in _BUILDERS:
        raise ToolParserError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got {name!r}")
    return _BUILDERS[name](tokenizer)


def detect_tool_parser(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The parser the tokenizer's chat template implies (by the tool-call markers it
    writes), or None when it shows no format this engine reads."""
    template = getattr(tokenizer, "chat_template", None)
    texts = list(template.values()) if isinstance(template, dict) else [template] if isinstance(template, str) else []
    return next((name for marker, name in _TEMPLATE_MARKERS if any(marker in text for text in texts)), None)


def tool_parser_for(name: str | None, tokenizer: PreTrainedTokenizerBase) -> ToolCallParser | None:
    """The engine's parser: ``name``'s (ToolParserError when it cannot read this
    tokenizer), else the one the chat template implies when the tokenizer has its
    tokens, else None (requests may still force calls; an ``auto`` one is refused)."""
    if name is not None:
        return make_tool_parser(name, tokenizer)
    detected = detect_tool_parser(tokenizer)
    if detected is None:
        return None
    try:
        return make_tool_parser(detected, tokenizer)
    except ToolParserError:
        return None


def read_tool_calls(parser: ToolCallParser | None, choice: ToolChoice, token_ids: list[int],
                    text: str) -> ToolCallOutput:
    """A sample's calls under ``choice``: forced calls from the answer ``text``, the
    model's own (``auto``) by ``parser`` from the answer's ``token_ids``. A call that
    cannot be read, or names a function not offered, is reported with the text kept."""
    try:
        if choice.mode == "auto":
            assert parser is not None, "the engine refuses an auto tool choice without a parser"
            output = parser.parse(token_ids, choice)
        else:
            output = forced_calls(text, choice)
    except MalformedToolCall as exc:
        return malformed(text, str(exc))
    return check_calls(output, choice, text)
