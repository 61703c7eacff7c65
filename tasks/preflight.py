"""Pre-flight checks: before any shard starts, fail in seconds with one line per problem.

- the job's fields: pydantic validates a BatchJob; ``field_errors`` turns its
  ValidationError into one line per invalid field, named as the caller names them
  (``--max-tokens must be >= 1, got -5`` on the command line);
- the model: its config and tokenizer resolve (a local directory, or a hub id),
  the tokenizer has the tokens the job's reasoning and tool-call parsers need, a job with an image
  column names a model whose images the engine runs, and the engine's
  one verdict on whether it can run the model for the job's task says yes
  (engine/model/support.py: the config and the model built on the meta device; no
  weights are loaded, no engine is built), so a model the engine would refuse fails
  here with the engine's reason;
- the input: listable, with at least one shard;
- the output: writable (a probe object is written under ``_tmp/`` and deleted).

Every check runs, so one report names every problem at once (PreflightFailed).
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import JobError, ModelUnusable, PipelineError, describe
from .job import BatchJob, JobTask
from .replicas import plan_placements
from .retrying import retry_storage
from .storage import Shard, filesystem, join, list_shards, make_directory

if TYPE_CHECKING:
    from shardline.engine.model.support import Support, Task

_PATH_PREFIXES = ("/", "./", "../", "~", "file://")


class PreflightFailed(JobError):
    """One or more pre-flight checks failed; ``errors`` holds each, one line apiece."""

    def __init__(self, errors: list[PipelineError]) -> None:
        self.errors = list(errors)
        Exception.__init__(self, "\n".join(str(error) for error in self.errors))
        self.operation, self.target, self.reason = "check", "job", str(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (PreflightFailed, (self.errors,))


def preflight(job: BatchJob, check_input: bool = True, model_here: bool = True) -> list[Shard]:
    """Check the model (``model_here``: when this host has it, unlike a Ray driver whose
    workers hold the model), the output and (``check_input``) the input of ``job``;
    return the input's shards (empty when not checked). Raises PreflightFailed naming
    every problem found."""
    errors: list[PipelineError] = []
    shards: list[Shard] = []
    for check in (check_model, check_output) if model_here else (check_output,):
        try:
            check(job)
        except PipelineError as exc:
            errors.append(exc)
    if check_input:
        try:
            shards = list_shards(job.input, job.storage(), job.input_format.value, exclude=job.output)
        except PipelineError as exc:
            errors.append(exc)
    if errors:
        raise PreflightFailed(errors)
    return shards


def check_model(job: BatchJob) -> str:
    """Resolve the model's config and tokenizer and ask the engine's verdict on the
    model (``check_support``); return the class name the engine would load. Raises
    ModelUnusable."""
    import transformers  # here: a pre-flight check is the first thing that needs it

    options = job.engine_options
    trust = bool(options.get("trust_remote_code", False))
    _check_not_gguf(job.model)
    _check_local_path(job.model)
    config = _resolve(transformers.AutoConfig, "model", job.model, revision=job.revision, trust_remote_code=trust)
    tokenizer = options.get("tokenizer") or job.model
    _check_local_path(tokenizer, what="tokenizer")
    resolved_tokenizer = _resolve(transformers.AutoTokenizer, "tokenizer", tokenizer,
                                  revision=options.get("tokenizer_revision") or job.revision, trust_remote_code=trust)
    if job.reasoning_parser is not None:
        from shardline.engine.sampling.reasoning import ReasoningParserError, make_reasoning_parser

        try:
            make_reasoning_parser(job.reasoning_parser, resolved_tokenizer)
        except ReasoningParserError as exc:
            raise ModelUnusable("load", f"tokenizer {tokenizer}", str(exc)) from None
    if job.tool_call_parser is not None:
        from shardline.engine.tools import ToolParserError, make_tool_parser

        try:
            make_tool_parser(job.tool_call_parser, resolved_tokenizer)
        except ToolParserError as exc:
            raise ModelUnusable("load", f"tokenizer {tokenizer}", str(exc)) from None
    architecture = check_support(job.model, config, job.task, trust, job.quantization)
    check_tensor_parallel_split(job, config)
    if job.data_parallel_size > 1:  # the replicas' devices are this host's
        try:
            plan_placements(job.data_parallel_size, job.engine_kwargs())
        except ValueError as exc:
            raise ModelUnusable("load", f"model {job.model}", str(exc)) from None
    if job.images.column is not None:
        check_takes_images(job.model, config, job.images.column)
    for name, path in job.lora_adapters.items():
        if _looks_local(path) and not os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json")):
            raise ModelUnusable("load", f"LoRA adapter {name} at {path}", "no adapter_config.json there")
    return architecture


def _resolve(auto: Any, what: str, name: str, **kwargs: Any) -> Any:
    """``auto.from_pretrained(name)``: from a local directory or the Hugging Face cache
    first, and from the hub only when it answers (an unreachable hub would otherwise
    be retried for half a minute before failing)."""
    try:
        return auto.from_pretrained(name, local_files_only=True, **kwargs)
    except Exception as local_exc:  # OSError, ValueError, the hub's own errors: all mean "not here"
        if os.path.isdir(os.path.expanduser(name)) or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
            raise ModelUnusable("load", f"{what} {name}", describe(local_exc)) from local_exc
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        if not _reachable(endpoint):
            raise ModelUnusable("load", f"{what} {name}", f"not a local directory, not in the Hugging Face cache, "
                                f"and the hub ({endpoint}) is unreachable") from local_exc
    try:
        return auto.from_pretrained(name, **kwargs)
    except Exception as exc:
        raise ModelUnusable("load", f"{what} {name}", describe(exc)) from exc


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout`` seconds."""
    parsed = urllib.parse.urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def _looks_local(model: str) -> bool:
    return model.startswith(_PATH_PREFIXES) or os.path.exists(os.path.expanduser(model))


def _check_not_gguf(model: str) -> None:
    """A GGUF model is refused with the engine's one line (engine/quantization/methods.py)."""
    from shardline.engine.quantization.methods import gguf_refusal  # here: as the verdict's imports

    refused = gguf_refusal(model)
    if refused is not None:
        raise ModelUnusable("load", f"model {model}", refused)


def _check_local_path(model: str, what: str = "model") -> None:
    """A model named by a path must be a directory (a hub id is resolved by transformers)."""
    if model.startswith(_PATH_PREFIXES) and not os.path.isdir(os.path.expanduser(model.removeprefix("file://"))):
        raise ModelUnusable("load", f"{what} {model}", "no such local directory (and a path is not a hub id)")


def check_support(model: str, config: Any, task: JobTask, trust_remote_code: bool,
                  quantization: str | None = None) -> str:
    """Ask the engine's verdict (engine/model/support.py: the config and the model built
    on the meta device, no weights) whether it can run this model for ``task``; return
    the class it would load. Raises ModelUnusable with the verdict's message, the same
    line the engine's loader would raise."""
    from shardline.engine.model.support import model_support  # here: it imports torch and transformers

    support = model_support(config, engine_task(task), trust_remote_code=trust_remote_code, quantization=quantization)
    if not support.ok:
        raise ModelUnusable("load", f"model {model}", support.message)
    return support.architecture


def check_tensor_parallel_split(job: BatchJob, config: Any) -> None:
    """Refuse a tensor_parallel_size the engine would refuse for this model and job: the
    engine's verdict (engine/parallel/verdict.py: heads that do not split, images,
    embeddings, an unknown quantization, and the sharding step run on
    the model built on the meta device, so a projection or size it cannot split is
    refused with the load's line). Raises ModelUnusable."""
    size = int(job.engine_kwargs().get("tensor_parallel_size", 1))
    if size <= 1:
        return
    from shardline.engine.errors import UnsupportedModelError
    from shardline.engine.parallel.group import ShardingError
    from shardline.engine.parallel.verdict import tensor_parallel_verdict

    try:
        tensor_parallel_verdict(config, size, quantization=job.quantization, task=engine_task(job.task),
                                trust_remote_code=bool(job.engine_options.get("trust_remote_code", False)))
    except (ShardingError, UnsupportedModelError) as exc:
        raise ModelUnusable("load", f"model {job.model}", str(exc)) from None


def check_takes_images(model: str, config: Any, column: str) -> None:
    """ModelUnusable when the job gives rows images (``column``) and the engine runs no images
    of the model (engine/multimodal/specs.py answers, as for the loader): every row would fail."""
    from shardline.engine.multimodal.specs import VISION_SPECS, vision_spec  # here: it imports torch

    if vision_spec(config) is None:
        raise ModelUnusable("load", f"model {model}", f"images.column={column!r} gives rows images, but shardline "
                            f"runs no images of model type {config.model_type!r} (vision-language types it runs: "
                            f"{', '.join(sorted(VISION_SPECS))}); every row would fail")


def model_verdict(model: str, task: JobTask, revision: str | None = None,
                  trust_remote_code: bool = False, quantization: str | None = None) -> Support:
    """The engine's verdict on ``model`` for ``task``, from its config (a local directory,
    the Hugging Face cache or the hub) and the model built on the meta device: no
    tokenizer, no weights. Raises ModelUnusable when the config cannot be resolved."""
    import transformers  # here: as check_model, the first thing that needs it

    from shardline.engine.model.support import model_support

    _check_not_gguf(model)
    _check_local_path(model)
    config = _resolve(transformers.AutoConfig, "model", model, revision=revision, trust_remote_code=trust_remote_code)
    return model_support(config, engine_task(task), trust_remote_code=trust_remote_code, quantization=quantization)


def engine_task(task: JobTask) -> Task:
    """The engine's task for a job's: "embed" for embeddings, "generate" for prompts and chats."""
    return "embed" if task == JobTask.EMBED else "generate"


def check_output(job: BatchJob) -> None:
    """Write a probe object under ``<output>/_tmp/`` and delete it. Raises StorageError
    (``write <probe URL> failed: ...``) when the output is not writable."""
    fs, path = filesystem(job.output, job.storage())
    probe = join(path, "_tmp", f".shardline-probe-{uuid.uuid4().hex}")
    probe_url = fs.unstrip_protocol(probe)
    make_directory(fs, join(path, "_tmp"), probe_url)
    retry_storage(lambda: fs.pipe_file(probe, b"shardline write probe"), "write", probe_url, fs)
    retry_storage(lambda: fs.rm_file(probe), "delete", probe_url, fs)


def field_errors(error: Any, name_of: Callable[[tuple[Any, ...]], str] | None = None) -> list[str]:
    """One line per invalid field of a pydantic ValidationError: ``<name> <problem>, got <value>``.

    ``name_of(loc)`` names a field as the caller's user knows it (a CLI flag);
    by default the dotted field path."""
    name_of = name_of or (lambda loc: ".".join(str(part) for part in loc) or "job")
    return [_field_line(item, name_of) for item in error.errors(include_url=False)]


def _field_line(item: dict[str, Any], name_of: Callable[[tuple[Any, ...]], str]) -> str:
    context = item.get("ctx") or {}
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
              "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
    if item["type"] in bounds:
        symbol, key = bounds[item["type"]]
        problem = f"must be {symbol} {context.get(key)}"
    elif item["type"] == "value_error":
        problem = str(context.get("error") or item["msg"]).removeprefix("Value error, ")
        return f"{name_of(tuple(item['loc']))}: {problem}"
    elif item["type"] == "missing":
        return f"{name_of(tuple(item['loc']))} is required"
    else:
        problem = item["msg"][:1].lower() + item["msg"][1:]
    value = item.get("input")
    shown = f", got {value!r:.80}" if not isinstance(value, dict) else ""
    return f"{name_of(tuple(item['loc']))} {problem}{shown}"
