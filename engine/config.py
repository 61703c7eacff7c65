"""The engine's one validated configuration object.

``LLM(model, **overrides)`` filters its keyword arguments through these fields, so
every option is declared exactly once, here, with vLLM's name and meaning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .sampling.reasoning import REASONING_PARSERS
from .tools import TOOL_CALL_PARSERS

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
DEVICES = ("auto", "cpu", "cuda")
TASKS = ("auto", "generate", "embed")
# "fp8"/"int8": online quantization, or a checkpoint's own fp8/int8 format; the rest name
# a checkpoint's quant_method (engine/quantization/methods.py).
QUANTIZATIONS = ("fp8", "int8", "compressed-tensors", "gptq", "awq", "mxfp4")


# Tokens per step when max_num_batched_tokens is None. A GPU wants large steps to fill
# its cores; a CPU step's activations should stay in its caches: on a 2-core AVX-512
# worker with a 512-wide model, prefill ran 6.0-6.3 s at 2048 tokens a step against
# 7.4-8.4 s at 8192 (intermediates of 8192 rows are tens of MB).
DEFAULT_TOKEN_BUDGETS = {"cuda": 8192, "cpu": 2048}


class ConfigError(ValueError):
    """An engine option has a value the engine cannot use."""


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance (vLLM's names and meanings); frozen once validated.

    ``task`` "auto" generates with causal-LM checkpoints and embeds with the
    others; "embed" pools a decoder's hidden states instead. ``max_model_len`` None
    means the model's own limit (capped by what the KV cache can hold);
    ``kv_cache_memory_bytes`` None means a default budget on CPU and
    ``gpu_memory_utilization`` of the GPU on CUDA. ``enforce_eager`` turns off the
    CUDA graphs that decode steps replay on a GPU, and on CPU the recorded decode steps
    (engine/cpu/decode_programs.py). ``max_num_batched_tokens`` None
    means a per-device default (DEFAULT_TOKEN_BUDGETS), filled in by the engine once it
    knows its device (``with_token_budget``). ``reasoning_parser`` ("qwen3",
    "deepseek_r1" or "openai_gptoss", vLLM's names) splits a reasoning model's thinking
    from its answer (CompletionOutput.reasoning) and holds structured-output
    constraints back until the thinking ends. ``tool_call_parser`` (vLLM's names: "hermes",
    "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "openai", "qwen3_coder",
    "qwen3_xml") reads the tool
    calls of requests that offered tools (CompletionOutput.tool_calls); None takes the
    one the chat template implies, if any (engine/tools/).
    """

    model: str
    task: str = "auto"
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    use_safetensors: bool = True
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Batch-aware admission (shardline's; vLLM has none): waiting requests sharing the
    # longest cached prefix go first, within priority and an age bound
    # (engine/core/admission.py); and requests identical in prompt, adapter, constraint
    # and deterministic sampling run once, each keeping its own id and output
    # (engine/core/duplicates.py).
    prefix_aware_admission: bool = True
    collapse_duplicate_requests: bool = True
    # Sliding-window and chunked-attention layers beside full ones keep only the KV blocks
    # some query still reads, in pools of their own (engine/core/window_blocks.py).
    free_windowed_blocks: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Modality -> adapter path used for prompts with that modality's data (vLLM's rule).
    default_mm_loras: dict[str, str] | None = None
    # Images in prompts (vision-language models, engine/multimodal/): the most items of
    # each modality one prompt may hold (None: the model's own limit), the folder local
    # image files may be read from and the domains image links may be fetched from
    # (None: neither is read).
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    # Gigabytes of processed images (their pixel tensors) kept by image hash, so an image
    # that recurs is preprocessed once (vLLM's option; 0 keeps none; engine/multimodal/pixel_cache.py).
    mm_processor_cache_gb: float = 1.0
    # Settings passed to the model's processor on every image prompt (vLLM's option; the
    # keys each model takes: engine/multimodal/specs.py, e.g. Gemma 3's pan-and-scan).
    mm_processor_kwargs: dict[str, Any] | None = None
    enforce_eager: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # None picks by device and dtype (engine/attention/backends.py); "triton", "cpu"
    # (torch with the native CPU kernels chosen for the host) or "torch" (torch ops alone).
    attention_backend: str | None = None
    # Compare the engine's paged path with the model's own forward at load and refuse a
    # model it would run wrongly (engine/model/load_check.py).
    check_model: bool = True
    # Quantization of the weights (vLLM's option): "fp8" or "int8" quantize a 16/32-bit
    # checkpoint's linears at load (per output channel); on a quantized checkpoint it
    # must name the checkpoint's own format or be left None (engine/quantization/).
    quantization: str | None = None
    # Prepare step N+1 while step N runs on the device and process N's outputs after
    # N+1 is queued (engine/llm_engine.py). None: on for CUDA, off elsewhere (a CPU
    # runs the forward itself, so there is nothing to overlap with).
    async_scheduling: bool | None = None
    # Ranks the model is split over (vLLM's name): one process per rank, started by the
    # engine, each holding its share of the weights and KV cache (engine/parallel/).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a hub id or a local directory, got {self.model!r}")
        _check_choice("task", self.task, TASKS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        for name in ("max_num_seqs", "block_size", "max_loras", "max_lora_rank", "tensor_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ("cpu", "torch", "triton"))
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        cache_gb = self.mm_processor_cache_gb
        if isinstance(cache_gb, bool) or not isinstance(cache_gb, (int, float)) or not cache_gb >= 0:
            raise ConfigError(f"mm_processor_cache_gb must be a number >= 0, got {cache_gb!r}")
        kwargs = self.mm_processor_kwargs
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            raise ConfigError(f"mm_processor_kwargs must be a dict of str keys, got {kwargs!r}")
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            _check_positive_int(f"limit_mm_per_prompt[{modality!r}]", limit)
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains",
                               tuple(str(domain).lower() for domain in self.allowed_media_domains))
        for name in ("prefix_aware_admission", "collapse_duplicate_requests", "free_windowed_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")

    def with_token_budget(self, device_type: str) -> EngineConfig:
        """This config with ``max_num_batched_tokens`` filled in for ``device_type`` if it
        was left None (DEFAULT_TOKEN_BUDGETS; a device not listed there takes the CPU's)."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_TOKEN_BUDGETS.get(device_type, DEFAULT_TOKEN_BUDGETS["cpu"])
        return dataclasses.replace(self, max_num_batched_tokens=budget)

    @classmethod
    def from_kwargs(cls, model: str, **overrides: Any) -> EngineConfig:
        """Build a config from keyword overrides, rejecting unknown option names."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **overrides)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
