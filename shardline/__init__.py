"""shardline: offline batch LLM inference over datasets, with its own engine.

The public engine API mirrors vLLM's offline ``LLM`` class.
"""

from shardline.engine.llm import LLM
from shardline.engine.lora import LoRARequest
from shardline.engine.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from shardline.engine.params import PoolingParams, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
]
__version__ = "0.1.0"
