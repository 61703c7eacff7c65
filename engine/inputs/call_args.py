"""An ``LLM`` call's arguments made uniform: one prompt or many as a list, values given
once or per prompt, sampling parameters copied for chat's options (special tokens kept,
tools offered), and the progress bar vLLM's offline API shows."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

from tqdm.auto import tqdm

from ..params import SamplingParams
from ..tools import ToolChoice
from .prompts import PromptType


def is_one_prompt(value: object) -> TypeGuard[PromptType]:
    """Whether ``value`` is one prompt (its text, or a dict of its fields), not an
    iterable of prompts: a dict is always one prompt, never its keys."""
    return isinstance(value, (str, dict))


def prompt_list(prompts: PromptType | Iterable[PromptType]) -> Iterable[PromptType]:
    """A single prompt as a one-item list; an iterable of prompts as it is."""
    if is_one_prompt(prompts):
        return [prompts]
    return prompts


def keep_special_tokens(params: Any) -> Any:
    """Copies of ``params`` that keep special tokens in the output text."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = params.clone()
        params.skip_special_tokens = False
        return params
    return [keep_special_tokens(p) for p in params]


def offer_tools(params: Any, tools: list[Any]) -> Any:
    """Copies of ``params`` whose completions' tool calls the engine reads (tool_choice
    "auto" over ``tools``' function names), unless a copy already sets its tool_choice."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        if params.tool_choice is not None:
            return params
        names = tuple(tool_name(tool) for tool in tools)
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in tools
                   if isinstance(tool, dict)}
        params = params.clone()
        params.tool_choice = ToolChoice("auto", names, parameters=schemas)
        return params
    return [offer_tools(p, tools) for p in params]


def tool_name(tool: Any) -> str:
    """A tool's function name: an OpenAI function tool's, or a Python function's (which
    transformers turns into a tool of that name)."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"),
                                                                                          str):
        return tool["function"]["name"]
    if callable(tool) and isinstance(getattr(tool, "__name__", None), str):
        return tool.__name__
    raise ValueError(f"tools must be OpenAI function tools ({{'type': 'function', 'function': {{'name': ...}}}}) or "
                     f"Python functions, got {tool!r:.80}")


def per_item_values(num_items: int | None, **values: Any) -> dict[str, Iterable[Any]]:
    """Broadcast single values; check that sequences match the number of prompts."""
    result = {}
    for name, value in values.items():
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if num_items is not None and len(value) != num_items:
                raise ValueError(
                    f"the number of prompts ({num_items}) and the length of {name} ({len(value)}) differ"
                )
            result[name] = value
        else:
            result[name] = itertools.repeat(value)
    return result


class ProgressBar:
    """tqdm "Processed prompts" with estimated input and output tokens/s (all n samples)."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int | None) -> None:
        self.bar = None
        if use_tqdm:
            factory = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True,
                               postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.input_tokens = 0
        self.output_tokens = 0

    def set_total(self, total: int) -> None:
        if self.bar is not None and getattr(self.bar, "total", None) != total:
            self.bar.total = total
            if hasattr(self.bar, "refresh"):
                self.bar.refresh()

    def update(self, output: Any) -> None:
        if self.bar is None:
            return
        self.input_tokens += len(output.prompt_token_ids)
        completions = output.outputs if isinstance(output.outputs, list) else []
        self.output_tokens += sum(len(c.token_ids) for c in completions)
        elapsed = self.bar.format_dict.get("elapsed", 0) if hasattr(self.bar, "format_dict") else 0
        if elapsed:
            self.bar.postfix = (
                f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                f"output: {self.output_tokens / elapsed:.2f} toks/s"
            )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
