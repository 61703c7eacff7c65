"""What tool-call parsing produces and what a request asks of it.

A request whose chat offered tools says how its completion may call them
(``ToolChoice``): ``auto`` (the model chooses, in its own format, which the engine's
tool-call parser reads), ``required`` (the output is constrained to a JSON list of
``{"name", "parameters"}`` calls) or ``named`` (constrained to one function's
arguments). Each sample then carries a ``ToolCallOutput``: its calls (OpenAI's
shape: an id, a function name, the arguments as JSON text) and the text beside them.

Invariants:
- A call's ``arguments`` is the JSON text of an object; its ``name`` is one of the
  request's tools when the request listed them.
- A completion whose call cannot be read keeps its whole answer text as ``content``,
  has no calls, and says why in ``error``: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

ToolMode = Literal["auto", "required", "named"]
TOOL_MODES: tuple[ToolMode, ...] = ("auto", "required", "named")


class ToolParserError(ValueError):
    """A tool-call parser this tokenizer cannot use, or a name no parser has."""


class MalformedToolCall(ValueError):
    """A tool call the model wrote that cannot be read (raised inside parsers, reported
    on the sample's ToolCallOutput)."""


@dataclass(frozen=True)
class ToolChoice:
    """How a request's completion may call its tools (shardline's own request field:
    vLLM's offline API does not parse tool calls). ``tool_names`` are the functions
    offered; ``name`` is the forced one when ``mode`` is "named"; ``parallel`` False
    allows one call at most (OpenAI's ``parallel_tool_calls``); ``parameters`` maps a
    function name to its parameters' JSON schema, for formats whose arguments are text
    to be typed by it (Qwen3-Coder's XML)."""

    mode: ToolMode = "auto"
    tool_names: tuple[str, ...] = ()
    name: str | None = None
    parallel: bool = True
    parameters: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.mode not in TOOL_MODES:
            raise ValueError(f"tool_choice.mode must be one of {', '.join(TOOL_MODES)}, got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError(f"tool_choice.name is set exactly when mode is 'named'; got mode={self.mode!r}, "
                             f"name={self.name!r}")
        if self.name is not None and self.tool_names and self.name not in self.tool_names:
            raise ValueError(f"tool_choice.name {self.name!r} is not among the tools ({', '.join(self.tool_names)})")


@dataclass(frozen=True)
class ToolCall:
    """One function call, as OpenAI's ``tool_calls`` entries carry it."""

    name: str
    arguments: str  # the JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """The chat completion message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallOutput:
    """A sample's answer read for tool calls: the calls, the text beside them (None
    when there is none), and why the calls could not be read (None when they could)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None

    @property
    def called(self) -> bool:
        return bool(self.calls)


class ToolCallParser(Protocol):
    """Reads one model format's tool calls from a sample's answer tokens."""

    name: str

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        """The calls and content of the answer ``token_ids`` under the request's ``choice``
        (only formats that write untyped arguments read it); MalformedToolCall when the
        answer opens a call that cannot be read."""
        ...


def arguments_text(value: Any, where: str) -> str:
    """A call's arguments as JSON object text; models write an object, or (some) its
    JSON text as a string. MalformedToolCall otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"{where}: arguments are a string that is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise MalformedToolCall(f"{where}: arguments must be a JSON object, got {json.dumps(value)[:80]}")
    return json.dumps(value, ensure_ascii=False)


def json_call(text: str, where: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """A call written as one JSON object ``{"name": ..., "arguments": {...}}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"{where} is not JSON ({exc}): {text.strip()[:120]!r}") from None
    return call_from_object(value, where, arguments_keys)


def call_from_object(value: Any, where: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) \
        -> ToolCall:
    """A call from a decoded JSON object with a name and (under one of ``arguments_keys``)
    its arguments; missing arguments are an empty object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise MalformedToolCall(f"{where} must be an object with a function name, got {json.dumps(value)[:120]}")
    key = next((key for key in arguments_keys if key in value), None)
    return ToolCall(value["name"], arguments_text({} if key is None else value[key], where))


def content_or_none(text: str) -> str | None:
    """Text beside calls, stripped of the whitespace around them; None when empty."""
    text = text.strip()
    return text or None


def check_calls(output: ToolCallOutput, choice: ToolChoice, raw_text: str) -> ToolCallOutput:
    """``output`` with a call to a function the request did not offer, or several calls
    where the request allowed one, reported as malformed."""
    if output.error is not None:
        return output
    if not choice.parallel and len(output.calls) > 1:
        return malformed(raw_text, f"the model made {len(output.calls)} calls, but parallel_tool_calls is false")
    if not choice.tool_names:
        return output
    unknown = [call.name for call in output.calls if call.name not in choice.tool_names]
    if not unknown:
        return output
    return malformed(raw_text, f"the model called {unknown[0]!r}, which is not among the tools "
                               f"({', '.join(choice.tool_names)})")


def malformed(raw_text: str, reason: str) -> ToolCallOutput:
    """A sample whose calls could not be read: its whole answer kept as content."""
    return ToolCallOutput(content=raw_text, calls=(), error=f"malformed tool call: {reason}")

