"""The ``shardline`` command line: its parser, and the BatchJob a ``run`` command
line describes (with the flag that set each field, for one-line field errors)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEMO_DIR = "shardline-demo"
DEBUG_ENV = "SHARDLINE_DEBUG"
# How ``run``'s flags name the BatchJob fields (for one-line field errors).
_FLAGS = {"input": "INPUT", "output": "OUTPUT", "model": "--model", "revision": "--revision", "task": "--task",
          "input_format": "--input-format", "output_format": "--output-format",
          "served_model_name": "--served-model-name", "engine_options": "--engine-options",
          "pass_through": "--pass-through",
          "storage_options": "--storage-options", "lora_adapters": "--lora", "shards_in_flight": "--shards-in-flight",
          "data_parallel_size": "--data-parallel-size", "tensor_parallel_size": "--tensor-parallel-size",
          "sampling.max_tokens": "--max-tokens", "sampling.temperature": "--temperature", "sampling.top_p": "--top-p",
          "sampling.top_k": "--top-k", "sampling.seed": "--seed", "sampling.n": "--n", "sampling.stop": "--stop",
          "structured_outputs": "--json-schema/--choice/--regex/--grammar", "reasoning_parser": "--reasoning-parser",
          "quantization": "--quantization", "tool_call_parser": "--tool-call-parser",
          "sampling.max_reasoning_tokens": "--max-reasoning-tokens", "images.column": "--image-column",
          "images.allowed_domains": "--allowed-media-domain", "images.max_image_bytes": "--max-image-bytes",
          "images.prefetch_bytes": "--image-prefetch-bytes"}
# The flags that set the job's structured_outputs, and the field each sets.
_CONSTRAINT_FLAGS = {"json_schema": "--json-schema", "choice": "--choice", "regex": "--regex", "grammar": "--grammar"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Offline batch LLM inference over prompt shards.")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks of errors (or set {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a model over every shard under INPUT, writing to OUTPUT")
    run.add_argument("input", help="prefix or glob of Parquet / JSON Lines shards (any fsspec URL)")
    run.add_argument("output", help="prefix for <shard>.parquet outputs and _manifests/")
    run.add_argument("--model", required=True, help="Hugging Face hub id or local model directory")
    run.add_argument("--revision", help="model revision")
    run.add_argument("--task", choices=["generate", "chat", "embed"], default="generate")
    run.add_argument("--input-format", choices=["auto", "parquet", "jsonl", "openai"], default="auto",
                     help="auto: by extension, and JSON Lines of OpenAI Batch requests as openai")
    run.add_argument("--output-format", choices=["parquet", "openai"], default="parquet",
                     help="openai: OpenAI Batch output lines in <shard>.jsonl and <shard>.errors.jsonl")
    run.add_argument("--served-model-name", help="the model name OpenAI Batch requests may give, and "
                     "responses carry (default: --model)")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int)
    run.add_argument("-n", "--n", type=int, default=1, help="completions per row")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--pass-through", action="append", default=[], metavar="COLUMN",
                     help="input column to copy to the output (repeatable)")
    run.add_argument("--engine-options", type=_json_object, default={}, metavar="JSON",
                     help='engine options as JSON, e.g. \'{"max_num_seqs": 64, "dtype": "bfloat16"}\'')
    run.add_argument("--storage-options", type=_json_object, default={}, metavar="JSON",
                     help="fsspec storage options as JSON (prefer AWS_* environment variables for credentials)")
    run.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="LoRA adapter (repeatable)")
    run.add_argument("--shards-in-flight", type=int, default=4)
    run.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="engine replicas on this worker, each in its own process on its own GPU(s) (on CPU, a "
                          "share of the cores), fed from one queue of rows")
    run.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="GPUs the model is split over (one process per rank, started by the engine), for a "
                          "model larger than one GPU")
    run.add_argument("--quantization", metavar="NAME", help="fp8 or int8: quantize a 16/32-bit checkpoint's "
                     "linears at load; or a quantized checkpoint's own format (its quant_method)")
    run.add_argument("--progress-interval", type=_positive_seconds, default=30.0, metavar="SECONDS",
                     help="seconds between progress lines (rows, tokens/s, ETA, engine health) when stderr is not "
                          "a terminal; a terminal gets a progress bar")
    structured = run.add_argument_group(
        "structured outputs and reasoning", "constrain every output to one of these (rows may override it with a "
        "response_format or json_schema column); JSON outputs are validated into the `parsed` column")
    structured.add_argument("--json-schema", metavar="FILE", help="a JSON Schema file")
    structured.add_argument("--choice", action="append", metavar="TEXT", help="an allowed output (repeatable)")
    structured.add_argument("--regex", help="a regular expression every output matches in full")
    structured.add_argument("--grammar", metavar="FILE", help="an EBNF grammar file (xgrammar's dialect, rule root)")
    structured.add_argument("--compact-json", action="store_true", help="no whitespace between JSON tokens")
    structured.add_argument("--reasoning-parser", metavar="NAME",
                            help="qwen3, deepseek_r1 or openai_gptoss: put the model's thinking in a "
                                 "`reasoning` column")
    structured.add_argument("--max-reasoning-tokens", type=int, metavar="N", help="most thinking tokens per row")
    structured.add_argument("--tool-call-parser", metavar="NAME",
                            help="hermes, llama3_json, mistral, deepseek_v3, deepseek_v31, openai, qwen3_coder or "
                                 "qwen3_xml: read the tool calls of requests and chat rows that offer tools "
                                 "(default: the one the chat template implies)")
    images = run.add_argument_group("images", "rows with images: an image column, or image_url parts in messages")
    images.add_argument("--image-column", metavar="COLUMN", help="the column of each row's image(s): encoded bytes, "
                        "a URL (data:, s3://, file://, ...) or a list of them")
    images.add_argument("--allowed-media-domain", action="append", default=[], metavar="HOST",
                        help="a host http(s) image URLs may name, with its subdomains (repeatable; none: refused)")
    images.add_argument("--max-image-bytes", type=int, metavar="N", help="largest encoded image read (default 20 MiB)")
    images.add_argument("--image-prefetch-bytes", type=int, metavar="N",
                        help="most decoded image bytes held ahead of the engine per shard (default 512 MiB)")

    check = commands.add_parser("check", help="say whether shardline can run MODEL, and if not why (reads its config "
                                "and builds it on the meta device: no weights)")
    check.add_argument("model", help="Hugging Face hub id or local model directory")
    check.add_argument("--task", choices=["generate", "embed"], default="generate")
    check.add_argument("--revision", help="model revision")
    check.add_argument("--trust-remote-code", action="store_true", help="let the config's auto_map name its classes")
    check.add_argument("--quantization", metavar="NAME", help="the engine's quantization option (fp8, int8, ...)")

    status = commands.add_parser("status", help="how far the job writing OUTPUT got: each shard done, failed or "
                                 "missing, with rows, errors, tokens and time from its manifest; totals")
    status.add_argument("output", help="the job's output prefix (any fsspec URL)")
    status.add_argument("--storage-options", type=_json_object, default={}, metavar="JSON",
                        help="fsspec storage options as JSON, as given to run")
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")

    demo = commands.add_parser("demo", help="write a sample dataset and a tiny model, then run the flow on them")
    demo.add_argument("dir", nargs="?", default=DEMO_DIR, help=f"where to put everything (default ./{DEMO_DIR})")
    demo.add_argument("--shards", type=int, default=6)
    demo.add_argument("--rows", type=int, default=8, help="rows per shard")
    demo.add_argument("--max-tokens", type=int, default=16)
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg}); expected an object like '{{\"key\": 1}}'") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds


def _lora_adapters(specs: list[str]) -> dict[str, str]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora expects NAME=PATH, got {spec!r}")
        adapters[name] = path
    return adapters


def job_from_args(args: argparse.Namespace) -> Any:
    """The BatchJob a ``shardline run`` command line describes."""
    from shardline.tasks.job import BatchJob

    # Validated from plain values, so a bad value's error names its field's path
    # (sampling.max_tokens), which flag_of turns into the flag that set it.
    return BatchJob.model_validate(dict(
        input=args.input, output=args.output, model=args.model, revision=args.revision, task=args.task,
        input_format=args.input_format, output_format=args.output_format, served_model_name=args.served_model_name,
        sampling={"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k, "seed": args.seed, "n": args.n, "stop": args.stop,
                  "max_reasoning_tokens": args.max_reasoning_tokens},
        structured_outputs=_structured_outputs(args), reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        engine_options=args.engine_options, storage_options=args.storage_options,
        pass_through=args.pass_through, lora_adapters=_lora_adapters(args.lora),
        shards_in_flight=args.shards_in_flight, quantization=args.quantization, images=_image_options(args),
        data_parallel_size=args.data_parallel_size, tensor_parallel_size=args.tensor_parallel_size,
    ))


def _image_options(args: argparse.Namespace) -> dict[str, Any]:
    """The job's images options from the --image-column group (unset flags keep the defaults)."""
    options = {"column": args.image_column, "allowed_domains": args.allowed_media_domain,
               "max_image_bytes": args.max_image_bytes, "prefetch_bytes": args.image_prefetch_bytes}
    return {name: value for name, value in options.items() if value is not None}


def _structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The job's structured_outputs from --json-schema, --choice, --regex or --grammar (at most one)."""
    given = {field: getattr(args, field) for field in _CONSTRAINT_FLAGS if getattr(args, field) is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(_CONSTRAINT_FLAGS[field] for field in given)} cannot be combined: "
                         "give one constraint")
    if not given:
        if args.compact_json:
            raise ValueError("--compact-json needs --json-schema")
        return None
    (field, value), = given.items()
    if field in ("json_schema", "grammar"):
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"{_CONSTRAINT_FLAGS[field]}: cannot read {value}: {exc.strerror or exc}") from None
    return {field: value, "disable_any_whitespace": args.compact_json}


def flag_of(loc: tuple[Any, ...]) -> str:
    """The command-line name of a BatchJob field (``sampling.max_tokens`` -> ``--max-tokens``)."""
    dotted = ".".join(str(part) for part in loc)
    if dotted in _FLAGS:
        return _FLAGS[dotted]
    top = str(loc[0]) if loc else ""
    return f"{_FLAGS[top]} ({dotted})" if top in _FLAGS else dotted or "the job"
