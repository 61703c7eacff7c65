"""One batch job, described by one pydantic model.

The ``batch_inference`` flow takes a ``BatchJob`` as its only parameter, so the
Prefect UI renders it as a form (descriptions, enums, defaults); an Airflow operator
builds the same object. Nothing here imports Prefect.

``storage_options`` is a pydantic ``Secret``: Prefect stores flow-run parameters
masked ("**********"), and ``public_fields()`` (what manifests, fingerprints and
logs see) never includes it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, Secret, field_validator, model_validator

from shardline.engine.config import QUANTIZATIONS, EngineConfig
from shardline.engine.sampling.reasoning import REASONING_PARSERS
from shardline.engine.tools import TOOL_CALL_PARSERS

from .media import ImageOptions
from .structured_job import StructuredOutputs

# Columns every output shard may carry; pass-through columns must not shadow them.
OUTPUT_COLUMNS = (
    "id", "text", "texts", "finish_reason", "prompt_tokens", "completion_tokens", "error", "embedding",
    "parsed", "reasoning", "reasoning_tokens", "tool_calls",
)


class JobTask(str, enum.Enum):
    """What the engine does with each row."""

    GENERATE = "generate"
    CHAT = "chat"
    EMBED = "embed"


class InputFormat(str, enum.Enum):
    """How input shards are parsed; ``auto`` goes by file extension, and reads JSON Lines
    whose lines are OpenAI Batch requests as ``openai`` (tasks/openai_requests.py)."""

    AUTO = "auto"
    PARQUET = "parquet"
    JSONL = "jsonl"
    OPENAI = "openai"


class OutputFormat(str, enum.Enum):
    """What each shard's output is: ``<stem>.parquet`` rows, or OpenAI Batch output lines
    in ``<stem>.jsonl`` plus ``<stem>.errors.jsonl`` (tasks/openai_responses.py)."""

    PARQUET = "parquet"
    OPENAI = "openai"


class SamplingDefaults(BaseModel):
    """Job-wide sampling parameters (vLLM's names); rows may override max_tokens,
    temperature, top_p and seed."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=1, description="Most tokens generated per completion.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep this probability mass.")
    top_k: int = Field(default=0, ge=0, description="Keep only the k most likely tokens; 0 keeps all.")
    seed: int | None = Field(default=None, description="Per-request sampling seed; none means the engine's generator.")
    n: int = Field(default=1, ge=1, description="Completions per row; more than one writes a `texts` list column.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="Above 1 discourages repeated tokens.")
    max_reasoning_tokens: int | None = Field(
        default=None, ge=0,
        description="Most thinking tokens before the answer is forced to begin; needs reasoning_parser.")


class PoolingDefaults(BaseModel):
    """Embedding options for ``task=embed`` (vLLM's PoolingParams)."""

    model_config = ConfigDict(extra="forbid")

    normalize: bool | None = Field(default=None, description="L2-normalise embeddings; none uses the model's default.")
    dimensions: int | None = Field(default=None, ge=1, description="Truncate embeddings to this many dimensions.")


class BatchJob(BaseModel):
    """Run a model over every shard under ``input``; write one ordered output shard each."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    input: str = Field(
        ...,
        description="Prefix or glob of Parquet / JSON Lines shards on any fsspec URL "
        "(local path, file://, s3://, gs://, az://, memory://).",
    )
    output: str = Field(..., description="Prefix that receives <shard>.parquet and _manifests/<shard>.json.")
    model: str = Field(..., description="Hugging Face hub id or local model directory.")
    revision: str | None = Field(
        default=None, description="Model revision (branch, tag or commit); part of the fingerprint.")
    task: JobTask = Field(default=JobTask.GENERATE, description="generate: complete `prompt`; chat: answer "
                          "`messages`; embed: embed `prompt` (OpenAI Batch requests: their url picks chat or "
                          "completion; embed serves /v1/embeddings).")
    input_format: InputFormat = Field(default=InputFormat.AUTO, description="Shard format; auto goes by extension "
                                      "(JSON Lines of OpenAI Batch requests are read as openai).")
    output_format: OutputFormat = Field(default=OutputFormat.PARQUET, description="parquet: <shard>.parquet rows; "
                                        "openai: OpenAI Batch output lines in <shard>.jsonl.")
    served_model_name: str | None = Field(
        default=None,
        description="The model name OpenAI Batch requests may give (besides `model`) and responses carry.")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults, description="Sampling defaults.")
    pooling: PoolingDefaults = Field(default_factory=PoolingDefaults, description="Embedding options.")
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine options (vLLM names): dtype, max_model_len, max_num_seqs, "
        "max_num_batched_tokens, enable_prefix_caching, kv_cache_memory_bytes, ...",
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters rows may name in their `lora` column: name -> directory."
    )
    pass_through: list[str] = Field(default_factory=list, description="Input columns copied to the output.")
    storage_options: Secret[dict[str, Any]] = Field(
        default_factory=lambda: Secret({}),
        description="fsspec storage options (credentials, endpoint); never logged or written. "
        "Prefer environment variables or the platform's own credentials.",
    )
    shards_in_flight: int = Field(
        default=4, ge=1, le=256, description="Shards fed to the engine at once; 2 or more keep its batch full "
        "across shard boundaries.",
    )
    data_parallel_size: int = Field(
        default=1, ge=1, le=64, description="Engine replicas on the worker, each in its own process on its own "
        "device(s) (on CPU, a share of the cores), fed from one queue of rows; no Ray needed. Outputs are the same.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="GPUs one engine's model is split over (vLLM's name), one process per "
        "rank started by the engine: for a model larger than one GPU. Outputs are the same.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="Constrain every output to a JSON schema, regex, choice list or grammar (rows may "
        "override it with a `response_format` or `json_schema` column); JSON outputs are validated into `parsed`.",
    )
    reasoning_parser: str | None = Field(
        default=None, description=f"Split a reasoning model's thinking into a `reasoning` column: "
        f"{', '.join(REASONING_PARSERS)}.",
    )
    quantization: str | None = Field(
        default=None, description="Quantize a 16/32-bit checkpoint's linears at load (fp8 or int8, per output "
        "channel), or name a quantized checkpoint's own format (fp8, int8, compressed-tensors, gptq, awq, mxfp4).",
    )
    images: ImageOptions = Field(
        default_factory=ImageOptions, description="Images in rows: the image column, the hosts http(s) image URLs "
        "may name, size limits.",
    )

    tool_call_parser: str | None = Field(
        default=None, description=f"Read the tool calls of requests that offer tools (tool_choice auto) in this "
        f"model's format: {', '.join(TOOL_CALL_PARSERS)}; none takes the one the chat template implies.",
    )

    @field_validator("engine_options")
    @classmethod
    def _known_engine_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "revision"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(known))}"
            )
        return options

    @field_validator("pass_through")
    @classmethod
    def _no_shadowed_columns(cls, columns: list[str]) -> list[str]:
        shadowed = sorted(set(columns) & set(OUTPUT_COLUMNS))
        if shadowed:
            raise ValueError(
                f"pass_through column(s) {', '.join(map(repr, shadowed))} would overwrite output columns "
                f"({', '.join(OUTPUT_COLUMNS)}); rename them in the input"
            )
        return columns

    @model_validator(mode="after")
    def _output_outside_input(self) -> BatchJob:
        if self.input.rstrip("/") == self.output.rstrip("/"):
            raise ValueError(f"output {self.output!r} must differ from input {self.input!r}")
        return self

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        return name

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
        return name

    @model_validator(mode="after")
    def _structured_and_reasoning(self) -> BatchJob:
        if self.task == JobTask.EMBED and self.structured_outputs is not None:
            raise ValueError("structured_outputs applies to generate and chat jobs, not task=embed")
        if self.input_format == InputFormat.OPENAI and self.structured_outputs is not None:
            raise ValueError("structured_outputs does not apply to input_format openai: each request's body "
                             "sets its own response_format")
        for name in ("reasoning_parser", "tool_call_parser"):
            if name in self.engine_options:
                raise ValueError(f"set {name} as the job's own field, not in engine_options")
        if self.sampling.max_reasoning_tokens is not None and self.reasoning_parser is None:
            raise ValueError(f"sampling.max_reasoning_tokens={self.sampling.max_reasoning_tokens} needs a "
                             "reasoning_parser")
        return self

    @model_validator(mode="after")
    def _one_tensor_parallel_size(self) -> BatchJob:
        if self.tensor_parallel_size > 1 and "tensor_parallel_size" in self.engine_options:
            raise ValueError("set tensor_parallel_size once: as the job's own field or in engine_options, not both")
        return self

    @model_validator(mode="after")
    def _known_quantization(self) -> BatchJob:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if "quantization" in self.engine_options:
            raise ValueError("set quantization as the job's own field, not in engine_options")
        return self

    @model_validator(mode="after")
    def _images_need_generation(self) -> BatchJob:
        if self.task == JobTask.EMBED and self.images.column is not None:
            raise ValueError(f"images.column={self.images.column!r} applies to generate and chat jobs; task=embed "
                             "embeds text only")
        return self

    def storage(self) -> dict[str, Any]:
        """The fsspec storage options, credentials included: pass on, never print."""
        return dict(self.storage_options.get_secret_value())

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword options for ``LLM(model, **engine_kwargs())``."""
        kwargs = dict(self.engine_options)
        if self.revision is not None:
            kwargs["revision"] = self.revision
        if self.lora_adapters:
            kwargs["enable_lora"] = True
        if self.quantization is not None:
            kwargs["quantization"] = self.quantization
        if self.reasoning_parser is not None:
            kwargs["reasoning_parser"] = self.reasoning_parser
        if self.tool_call_parser is not None:
            kwargs["tool_call_parser"] = self.tool_call_parser
        if self.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        return kwargs

    def public_fields(self) -> dict[str, Any]:
        """The job without storage options: safe for manifests, fingerprints and logs."""
        return self.model_dump(mode="json", exclude={"storage_options"})
