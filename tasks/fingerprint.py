"""The job fingerprint: what a shard's output depends on, hashed.

A rerun skips a shard only when its manifest carries the same fingerprint: the same
model (hub id, revision, and for a local directory a digest of its config and weight
files), task, sampling or pooling parameters, engine options, LoRA adapters,
pass-through columns, image options, and the same input shard (schema and size). Storage options
are not part of it: credentials change, outputs do not.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .job import BatchJob, JobTask, OutputFormat
from .media import ImageOptions
from .storage import Shard

# Bumped when the output layout changes, so old outputs are redone.
OUTPUT_FORMAT_VERSION = 1
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "adapter_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def fingerprint_fields(job: BatchJob, shard: Shard, input_schema: dict[str, str]) -> dict[str, Any]:
    """Everything a shard's output depends on, as JSON-ready values."""
    fields: dict[str, Any] = {
        "format_version": OUTPUT_FORMAT_VERSION,
        "model": job.model,
        "revision": job.revision,
        "model_digest": local_model_digest(job.model),
        "task": job.task.value,
        "engine_options": job.engine_options,
        "lora_adapters": {name: local_model_digest(path) or path for name, path in job.lora_adapters.items()},
        "pass_through": job.pass_through,
        "input_schema": input_schema,
        "input_size": shard.size,
    }
    if job.task == JobTask.EMBED:
        fields["pooling"] = job.pooling.model_dump(mode="json")
    else:
        # Options left at None stay out, so jobs that do not use them keep their fingerprints.
        unset = {"max_reasoning_tokens"} if job.sampling.max_reasoning_tokens is None else set()
        fields["sampling"] = job.sampling.model_dump(mode="json", exclude=unset)
    for name in ("structured_outputs", "reasoning_parser", "tool_call_parser"):
        if getattr(job, name) is not None:
            fields[name] = job.model_dump(mode="json", include={name})[name]
    if job.quantization is not None:
        fields["quantization"] = job.quantization
    images = job.images.model_dump(mode="json", exclude={"prefetch_bytes"})  # how far ahead: not in the output
    if images != ImageOptions().model_dump(mode="json", exclude={"prefetch_bytes"}):
        fields["images"] = images
    if job.output_format != OutputFormat.PARQUET or job.served_model_name is not None:  # OpenAI Batch output
        fields["output_format"] = job.output_format.value
        fields["served_model_name"] = job.served_model_name
    return fields


def fingerprint(fields: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``fields``."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def local_model_digest(model: str) -> str | None:
    """A digest of a local model directory's config files and weight file sizes;
    None for a hub id (its revision identifies it)."""
    if not os.path.isdir(model):
        return None
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name in _MODEL_FILES:
            with open(path, "rb") as handle:
                digest.update(name.encode() + b"\0" + handle.read())
        elif name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"{name}\0{os.path.getsize(path)}".encode())
    return digest.hexdigest()[:16]
