"""OpenAI Responses API request bodies (``/v1/responses`` lines of a Batch input file) as
the chat completion bodies the rest of the OpenAI input path reads.

A Responses body's ``input`` (a string, or input items: messages, ``function_call``
and ``function_call_output`` items), ``instructions`` (a system message first),
``max_output_tokens``, ``text.format`` (structured output), ``reasoning.effort`` (the
chat template's ``reasoning_effort``), ``tools`` (function tools, flat as the
Responses API writes them) and ``tool_choice`` map one to one onto a chat body. What
the Response object repeats (instructions, tools, text, reasoning, metadata, ...) is
kept beside it.

Invariant: a field or input item shardline cannot honour raises ResponsesInputError
naming it (the row fails with it; other lines run); none is dropped.
"""

from __future__ import annotations

from typing import Any

# Fields the Responses API accepts that change nothing in a batch answer.
_IGNORED = {"metadata", "store", "user", "service_tier", "safety_identifier", "prompt_cache_key", "truncation"}
_MAPPED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "reasoning",
           "tools", "tool_choice", "parallel_tool_calls", "stream", "background", "include"}
# vLLM's sampling extras, which its Responses endpoint takes too.
_EXTRAS = {"top_k", "min_p", "repetition_penalty", "seed", "stop", "presence_penalty", "frequency_penalty"}
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesInputError(ValueError):
    """A Responses body field shardline cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(f"{param} {message}")
        self.param, self.code = param, code


def chat_body_of_response(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat completion body that asks what the Responses ``body`` asks, and the
    fields its Response object repeats."""
    _check_fields(body)
    messages = _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ResponsesInputError("instructions", f"must be a string, got {instructions!r:.80}")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages}
    chat.update({name: body[name] for name in ("model", "temperature", "top_p", "parallel_tool_calls", *_EXTRAS)
                 if name in body})
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    echo = {name: body.get(name) for name in ("instructions", "max_output_tokens", "temperature", "top_p",
                                              "tool_choice", "metadata", "parallel_tool_calls", "user")}
    echo.update(tools=list(body.get("tools") or []), text=body.get("text") or {"format": {"type": "text"}},
                reasoning=body.get("reasoning"))
    return chat, echo


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _MAPPED - _IGNORED - _EXTRAS)
    if unknown:
        raise ResponsesInputError(unknown[0], "is not supported for /v1/responses by shardline"
                                  + (f" (nor {unknown[1:]})" if len(unknown) > 1 else ""), "unsupported_parameter")
    for name, why in (("stream", "each line gets one whole response"), ("background", "a batch runs in the "
                                                                        "background already")):
        if body.get(name):
            raise ResponsesInputError(name, f"=true is not supported in a batch: {why}", "unsupported_parameter")
    include = body.get("include") or []
    if include:
        raise ResponsesInputError("include", f"{include!r:.80} is not supported: shardline returns no extra "
                                  "output data", "unsupported_parameter")
    if "input" not in body:
        raise ResponsesInputError("input", "is missing (a string or a list of input items)")


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ResponsesInputError(name, f"must be a list, got {value!r:.80}")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages from ``input``: a string is one user message; items in order, a run of
    function_call items one assistant message with tool_calls."""
    if isinstance(value, str):
        if not value:
            raise ResponsesInputError("input", "must not be empty")
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(_list(value, "input")):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ResponsesInputError(where, f"must be an input item (an object), got {item!r:.80}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") \
                    and not messages[-1].get("content"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise ResponsesInputError(where, f"output must be a string, got {output!r:.80}")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": output})
        else:
            raise ResponsesInputError(where, f"has type {kind!r:.40}, which shardline does not take (it takes "
                                      "message, function_call and function_call_output items)")
    if not messages:
        raise ResponsesInputError("input", "holds no items")
    return messages


def _text(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ResponsesInputError(where, f"needs {name} (a non-empty string), got {value!r:.80}")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ResponsesInputError(where, f"role must be one of {', '.join(_ROLES)}, got {role!r:.40}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": "system" if role == "developer" else role, "content": content}
    parts = []
    for number, part in enumerate(_list(content, f"{where}.content")):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ResponsesInputError(f"{where}.content[{number}]", f"must be input_text, output_text or "
                                      f"input_image (with an image_url), got {part!r:.80}")
    return {"role": "system" if role == "developer" else role, "content": parts}


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a chat response_format (None for plain text)."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or not isinstance(form, (dict, type(None))):
        raise ResponsesInputError("text", f"must be {{'format': {{'type': ...}}}}, got {text!r:.80}")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema" and isinstance(form.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": form.get("name") or "response",
                                                       "schema": form["schema"]}}
    raise ResponsesInputError("text.format", f"must be text, json_object or json_schema (with a schema), "
                              f"got {form!r:.80}")


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise ResponsesInputError("reasoning", f"must be {{'effort': ..., 'summary': ...}}, got {reasoning!r:.80}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise ResponsesInputError("reasoning.effort", f"must be none, minimal, low, medium, high or xhigh, "
                                  f"got {effort!r:.40}")
    return effort


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ResponsesInputError(f"tools[{index}]", f"must be a function tool {{'type': 'function', 'name': ..., "
                                  f"'parameters': {{...}}}}; shardline runs no hosted tools, got {kind!r:.60}")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesInputError("tool_choice", f"must be none, auto, required or {{'type': 'function', 'name': ...}}, "
                              f"got {choice!r:.80}")
