"""OpenAI Responses API objects for ``/v1/responses`` lines: one Response per line.

Its ``output`` items, in the order the model wrote them: a ``reasoning`` item (the
reasoning parser's split, as ``reasoning_text`` content) when the model reasoned, a
``message`` with the answer's text (the content beside any calls), and one
``function_call`` item per tool call the engine read. ``status`` is "incomplete"
(``incomplete_details.reason`` "max_output_tokens") when the length limit cut the
answer. ``usage`` counts input, cached, output and reasoning tokens.
"""

from __future__ import annotations

import uuid
from typing import Any

from .openai_requests import OpenAIRow


def response_object(row: OpenAIRow, output: Any, created: int) -> dict[str, Any]:
    """The Response for a finished ``/v1/responses`` row (``output``: its RequestOutput)."""
    [sample] = output.outputs  # a /v1/responses row runs with n=1
    cut = sample.finish_reason == "length"
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(sample.token_ids)
    echo = row.echo
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created, "model": row.model_name,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "output": output_items(sample, "incomplete" if cut else "completed"),
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "metadata": echo.get("metadata"), "parallel_tool_calls": echo.get("parallel_tool_calls", True) is not False,
        "temperature": echo.get("temperature"), "top_p": echo.get("top_p"),
        "tool_choice": echo.get("tool_choice") or "auto", "tools": echo.get("tools") or [],
        "text": echo.get("text"), "reasoning": echo.get("reasoning"), "user": echo.get("user"),
        "usage": {"input_tokens": prompt_tokens,
                  # No request asks to write the cache: the prefix cache keeps prompts by itself.
                  "input_tokens_details": {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0},
                  "output_tokens": completion_tokens,
                  "output_tokens_details": {"reasoning_tokens": sample.num_reasoning_tokens},
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def output_items(sample: Any, status: str) -> list[dict[str, Any]]:
    """A sample's reasoning, message and function_call items."""
    items: list[dict[str, Any]] = []
    if sample.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": sample.reasoning}], "status": status})
    calls = sample.tool_calls
    text = sample.text if calls is None else calls.content
    if text or calls is None or not calls.calls:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": text or "", "annotations": []}]})
    for call in calls.calls if calls is not None else ():
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items
