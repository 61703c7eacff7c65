"""shardline: offline batch LLM inference over datasets, with its own engine.

The public engine API mirrors vLLM's offline ``LLM`` class. Names are resolved on
first use, so importing a light submodule (the scheduler, the shard functions)
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names __getattr__ resolves, for type checkers
    from shardline.engine.llm import LLM
    from shardline.engine.lora.request import LoRARequest
    from shardline.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from shardline.engine.params import PoolingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "shardline.engine.llm",
    "SamplingParams": "shardline.engine.params",
    "PoolingParams": "shardline.engine.params",
    "StructuredOutputsParams": "shardline.engine.params",
    "LoRARequest": "shardline.engine.lora.request",
    "RequestOutput": "shardline.engine.outputs",
    "CompletionOutput": "shardline.engine.outputs",
    "EmbeddingRequestOutput": "shardline.engine.outputs",
}

# _EXPORTS' names, sorted (a literal, so type checkers read it).
__all__ = ["CompletionOutput", "EmbeddingRequestOutput", "LLM", "LoRARequest", "PoolingParams", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
