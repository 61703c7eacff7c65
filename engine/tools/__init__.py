"""Tool calls: what a request's tool choice asks, one parser per model format (Hermes,
Llama 3 JSON, Mistral, DeepSeek, gpt-oss harmony) chosen by vLLM's name or from the
chat template, and the calls each sample carries. Imports no other engine package."""

from .calls import MalformedToolCall, ToolCall, ToolCallOutput, ToolCallParser, ToolChoice, ToolParserError
from .registry import TOOL_CALL_PARSERS, detect_tool_parser, make_tool_parser, read_tool_calls, tool_parser_for

__all__ = ["TOOL_CALL_PARSERS", "MalformedToolCall", "ToolCall", "ToolCallOutput", "ToolCallParser", "ToolChoice",
           "ToolParserError", "detect_tool_parser", "make_tool_parser", "read_tool_calls", "tool_parser_for"]
