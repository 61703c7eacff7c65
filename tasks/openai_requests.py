"""OpenAI Batch API input: request lines mapped onto engine requests.

A shard of request lines ``{"custom_id", "method": "POST", "url", "body"}`` (the OpenAI
Batch API's input file, which ``vllm run-batch`` reads too) becomes one OpenAIRow per
line, in order. The url picks what the row is: /v1/chat/completions a chat,
/v1/completions a text completion, /v1/embeddings an embedding, /v1/responses a
Responses API request (run as the chat it maps onto: tasks/responses_requests.py). The body's fields map
onto SamplingParams (or PoolingParams); what the job's ``sampling`` sets fills what the
body leaves out (``max_tokens`` included, so a job bounds every request's length).

Invariants:
- Every line becomes exactly one row, and one output line; a list ``prompt`` (completions)
  or ``input`` (embeddings) asks one engine request per text, all answered in that line.
  A line that cannot run (not JSON, no custom_id,
  an unknown url, a field out of range or not supported, another model, an endpoint
  the job's model cannot serve) carries an error code and a message naming the field,
  and the other lines run. Body fields are checked against OpenAI's ranges.
- Duplicate custom_id values fail the whole shard (ShardError naming them), as the
  OpenAI Batch API refuses such a file.
- A row's structured output comes from ``response_format`` or from a named or
  ``required`` ``tool_choice`` (the tool's parameters schema), never both. A row with
  tools and a tool_choice other than "none" has its calls read by the engine
  (SamplingParams.tool_choice; "auto" needs the engine's tool-call parser).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shardline import PoolingParams, SamplingParams, StructuredOutputsParams
from shardline.engine.inputs.chat import ChatRenderError, normalize_messages
from shardline.engine.tools import ToolChoice

from .executor import RowRequest
from .job import BatchJob, InputFormat, JobTask, OutputFormat
from .media import ImageError, ImageSource, chat_images, without_image_markers
from .openai_tools import ToolFieldError, tool_request
from .responses_requests import ResponsesInputError, chat_body_of_response
from .rows import PreparedRow, PreparedShard
from .shard_reader import RawShard, RecordProblem, ShardError

CHAT, COMPLETION, EMBEDDING, RESPONSE = "chat.completion", "text_completion", "embedding", "response"
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/embeddings": EMBEDDING,
             "/v1/responses": RESPONSE}
REQUEST_KEYS = ("custom_id", "method", "url", "body")

# Body fields each endpoint maps (vLLM's sampling extras included, so vllm run-batch
# files run unchanged); IGNORED fields change nothing in the output.
_SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
)
_CHAT_FIELDS = {*_SAMPLING_FIELDS, "model", "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                "response_format", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message", "parallel_tool_calls"}
_COMPLETION_FIELDS = {*_SAMPLING_FIELDS, "model", "prompt", "logprobs", "response_format", "echo", "best_of",
                      "suffix"}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions"}
_IGNORED = {"user", "metadata", "store", "service_tier", "stream", "stream_options"}
MAX_TEXTS_PER_LINE = 2048  # OpenAI's limit on an embeddings input list
_ALLOWED = {CHAT: _CHAT_FIELDS, COMPLETION: _COMPLETION_FIELDS, EMBEDDING: _EMBEDDING_FIELDS, RESPONSE: _CHAT_FIELDS}
# The job's sampling defaults a body may leave out.
_JOB_DEFAULTS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "ignore_eos",
                 "repetition_penalty", "max_reasoning_tokens")


class RequestError(ValueError):
    """Why one request line cannot run: an OpenAI error ``code``, the body ``param`` at
    fault, and whether the line was a request at all (``status`` 400) or not (None)."""

    def __init__(self, code: str, message: str, param: str | None = None, status: int | None = 400) -> None:
        super().__init__(message)
        self.code, self.param, self.status = code, param, status


@dataclass
class OpenAIRow(PreparedRow):
    """A request line: the PreparedRow plus what its response needs."""

    custom_id: str | None = None
    kind: str = CHAT  # CHAT, COMPLETION, EMBEDDING or RESPONSE: the response object it gets
    model_name: str = ""  # the model its response names
    logprobs: int | None = None  # top logprobs per position when the body asked for logprobs
    tool_mode: str | None = None  # "named" or "required": the output is tool calls
    tool_name: str | None = None
    encoding_format: str = "float"
    error_code: str | None = None
    status_code: int | None = None
    param: str | None = None
    # A /v1/responses line's fields its Response object repeats (instructions, tools, ...).
    echo: dict[str, Any] = field(default_factory=dict)
    # The line's further prompts when its prompt or input is a list: engine requests whose
    # indexes follow the shard's last row, so every request of the shard has its own.
    more: list[RowRequest] = field(default_factory=list)

    def engine_requests(self) -> list[RowRequest]:
        return [] if self.request is None else [self.request, *self.more]


def is_openai_batch(raw: RawShard, job: BatchJob) -> bool:
    """Whether ``raw`` holds OpenAI Batch requests: the job says so, or (input format auto) it
    is JSON Lines whose lines have custom_id, method, url and body and none a prompt or messages."""
    if raw.shard.format == "openai":
        return True
    if raw.shard.format != "jsonl" or job.input_format != InputFormat.AUTO:
        return False
    records = [record for record in raw.records if isinstance(record, dict)]
    return any(all(key in record for key in REQUEST_KEYS) for record in records) and \
        not any("prompt" in record or "messages" in record for record in records)


def prepare_openai_shard(raw: RawShard, job: BatchJob) -> PreparedShard:
    """A PreparedShard of one OpenAIRow per line of ``raw``, in order; ShardError on duplicate
    custom_ids."""
    _check_unique_ids(raw)
    extra_indexes = itertools.count(len(raw.records))
    rows = []
    for index, record in enumerate(raw.records):
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        custom_id = custom_id if isinstance(custom_id, str) else None
        row = OpenAIRow(index, custom_id or f"{raw.shard.key}:{index}", None, custom_id=custom_id,
                        model_name=job.served_model_name or job.model)
        try:
            if isinstance(record, RecordProblem):
                raise RequestError("invalid_json", record.message, status=None)
            _fill(row, record, job, extra_indexes)
        except RequestError as exc:
            row.request, row.more, row.error = None, [], str(exc)
            row.error_code, row.status_code, row.param = exc.code, exc.status, exc.param
        except ValueError as exc:  # SamplingParams / StructuredOutputsParams naming the field
            row.request, row.more, row.error = None, [], str(exc)
            row.error_code, row.status_code = "invalid_request", 400
        rows.append(row)
    return PreparedShard(raw, rows)


def _check_unique_ids(raw: RawShard) -> None:
    counts = Counter(custom_id for record in raw.records
                     if isinstance(record, dict) and isinstance(custom_id := record.get("custom_id"), str))
    repeated = sorted(custom_id for custom_id, count in counts.items() if count > 1)
    if repeated:
        shown = ", ".join(map(repr, repeated[:5])) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
        raise ShardError(raw.shard.uri, f"duplicate custom_id value(s) {shown}: each request line needs a "
                                        "custom_id of its own (as the OpenAI Batch API requires)")


def _fill(row: OpenAIRow, record: dict[str, Any], job: BatchJob, extra_indexes: Iterator[int]) -> None:
    """Check one request line and set ``row``'s request and response fields."""
    if not isinstance(record.get("custom_id"), str) or not record["custom_id"]:
        raise RequestError("missing_custom_id", f"line {row.index + 1} has no custom_id (a non-empty string), "
                           f"got {record.get('custom_id')!r:.80}", "custom_id", status=None)
    if record.get("method") != "POST":
        raise RequestError("invalid_method", f"method must be 'POST', got {record.get('method')!r:.40}", "method")
    url = record.get("url")
    if url not in ENDPOINTS:
        raise RequestError("invalid_url", f"url {url!r:.80} is not supported; expected one of "
                           f"{', '.join(ENDPOINTS)}", "url")
    body = record.get("body")
    if not isinstance(body, dict):
        raise RequestError("invalid_body", f"body must be a JSON object, got {body!r:.80}", "body")
    row.kind = ENDPOINTS[url]
    if row.kind == RESPONSE:
        try:
            body, row.echo = chat_body_of_response(body)
        except ResponsesInputError as exc:
            raise RequestError(exc.code, str(exc), exc.param) from None
    _check_fields(body, row.kind, url)
    _check_model(body, job)
    _check_endpoint(url, row.kind, job)
    if row.kind == EMBEDDING:
        requests = _embedding_requests(row, body, job)
    elif row.kind in (CHAT, RESPONSE):
        requests = [_chat_request(row, body, job)]
    else:
        requests = _completion_requests(row, body, job)
    if row.kind == RESPONSE and isinstance(params := requests[0].params, SamplingParams) and params.n != 1:
        raise _invalid("n", f"is {params.n} for this job, but a Response holds one answer; run /v1/responses "
                       "lines with n=1")
    row.request = requests[0]
    row.more = [dataclasses.replace(request, index=next(extra_indexes)) for request in requests[1:]]
    if job.output_format == OutputFormat.PARQUET:
        _check_parquet_can_hold(row, job)


def _check_parquet_can_hold(row: OpenAIRow, job: BatchJob) -> None:
    """Parquet rows have the job's ``n`` texts and no logprobs: a request asking for other
    fails rather than lose part of its answer."""
    if row.more:
        name = "input" if row.kind == EMBEDDING else "prompt"
        raise _invalid(name, f"holds {len(row.more) + 1} texts, and a Parquet output row holds one; use "
                       "--output-format openai")
    assert row.request is not None, f"row {row.index}: its requests are built before this check"
    params = row.request.params
    if isinstance(params, SamplingParams) and params.n != job.sampling.n:
        raise _invalid("n", f"={params.n} differs from the job's n ({job.sampling.n}), which a Parquet output "
                       "holds per row; use --output-format openai")
    if row.logprobs is not None:
        raise _invalid("logprobs", "are not written to a Parquet output; use --output-format openai")


def _check_fields(body: dict[str, Any], kind: str, url: str) -> None:
    unknown = sorted(set(body) - _ALLOWED[kind] - _IGNORED)
    if unknown:
        raise RequestError("unsupported_parameter", f"body field {unknown[0]!r} is not supported for {url} by "
                           f"shardline{f' (nor {unknown[1:]})' if len(unknown) > 1 else ''}", unknown[0])
    if body.get("stream"):
        raise RequestError("unsupported_parameter", "stream=true is not supported in a batch: each line gets "
                           "one whole response", "stream")


def _check_model(body: dict[str, Any], job: BatchJob) -> None:
    model = body.get("model")
    served = {job.model, job.served_model_name} - {None}
    if model is not None and model not in served:
        raise RequestError("model_not_found", f"model {model!r:.80} is not this job's model (it serves "
                           f"{' or '.join(map(repr, sorted(served)))}); run it in a job of its own", "model")


def _check_endpoint(url: str, kind: str, job: BatchJob) -> None:
    if kind == EMBEDDING and job.task != JobTask.EMBED:
        raise RequestError("unsupported_endpoint", f"{url} needs an embedding model, but this job's model "
                           f"{job.model} generates (task={job.task.value}); run embedding requests in a job "
                           "with --task embed and an embedding model", "url")
    if kind != EMBEDDING and job.task == JobTask.EMBED:
        raise RequestError("unsupported_endpoint", f"{url} needs a generative model, but this job embeds "
                           f"(task=embed, model {job.model})", "url")


# ----------------------------------------------------------------- embeddings
def _embedding_requests(row: OpenAIRow, body: dict[str, Any], job: BatchJob) -> list[RowRequest]:
    texts = _texts(body.get("input"), "input")
    row.encoding_format = body.get("encoding_format") or "float"
    if row.encoding_format not in ("float", "base64"):
        raise _invalid("encoding_format", f"must be 'float' or 'base64', got {row.encoding_format!r:.40}")
    dimensions = _integer(body, "dimensions", minimum=1)
    params = PoolingParams(normalize=job.pooling.normalize,
                           dimensions=dimensions if dimensions is not None else job.pooling.dimensions)
    return [RowRequest(index=row.index, prompt=text, messages=None, params=params) for text in texts]


def _texts(value: Any, name: str) -> list[str]:
    """The prompts of a line: a string, or a list of strings (token id arrays are refused)."""
    texts = value if isinstance(value, list) else [value]
    if not texts or len(texts) > MAX_TEXTS_PER_LINE:
        raise _invalid(name, f"must hold 1 to {MAX_TEXTS_PER_LINE} texts, got {len(texts)}")
    for text in texts:
        if isinstance(text, int) or (isinstance(text, list) and text and isinstance(text[0], int)):
            raise _invalid(name, "holds token ids, which shardline does not take; send the text")
        if not isinstance(text, str) or not text:
            raise _invalid(name, f"must be a non-empty string or a list of them, got {text!r:.80}")
    return texts


# ----------------------------------------------------------- chat, completion
def _chat_request(row: OpenAIRow, body: dict[str, Any], job: BatchJob) -> RowRequest:
    messages, images = _chat_images(body.get("messages"), job)
    try:
        normalize_messages(without_image_markers(messages), "openai")  # roles and text; the template renders them later
    except ChatRenderError as exc:
        raise _invalid("messages", f"are malformed: {exc}") from None
    assert messages is not None, "normalize_messages refuses a missing conversation"
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise _invalid("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    if body.get("logprobs"):
        row.logprobs = _integer(body, "top_logprobs", minimum=0, maximum=20) or 0
    elif body.get("top_logprobs") is not None:
        raise _invalid("top_logprobs", "needs logprobs=true")
    try:
        structured, tool_choice = tool_request(body)  # tasks/openai_tools.py
    except ToolFieldError as exc:
        raise _invalid(exc.param, str(exc)) from None
    if tool_choice is not None and tool_choice.mode != "auto":
        row.tool_mode, row.tool_name = tool_choice.mode, tool_choice.name
    structured = _response_format(body.get("response_format"), structured)
    chat_options = {name: body[name] for name in ("chat_template_kwargs", "add_generation_prompt",
                                                  "continue_final_message") if body.get(name) is not None}
    if body.get("tools"):
        chat_options["tools"] = body["tools"]
    return RowRequest(index=row.index, prompt=None, messages=[dict(m) for m in messages],
                      params=_sampling(body, job, row.logprobs, structured, tool_choice),
                      chat_options=chat_options or None, images=images or None)


def _chat_images(messages: Any, job: BatchJob) -> tuple[Any, list[ImageSource]]:
    """The messages with their image_url parts as image markers, and the images those name
    (read later, ahead of the engine: tasks/image_feed.py)."""
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        return messages, []  # normalize_messages names what is wrong
    try:
        return chat_images(messages, [], job.images)
    except ImageError as exc:
        raise RequestError("invalid_image_url", str(exc), "messages") from None



def _completion_requests(row: OpenAIRow, body: dict[str, Any], job: BatchJob) -> list[RowRequest]:
    prompts = _texts(body.get("prompt"), "prompt")
    for name, neutral in (("echo", False), ("suffix", None)):
        if body.get(name) not in (neutral, None):
            raise RequestError("unsupported_parameter", f"{name}={body[name]!r:.40} is not supported by "
                               "shardline", name)
    if body.get("best_of") not in (None, 1):
        raise RequestError("unsupported_parameter", f"best_of={body['best_of']!r:.40} is not supported by "
                           "shardline (use n)", "best_of")
    row.logprobs = _integer(body, "logprobs", minimum=0, maximum=5)
    params = _sampling(body, job, row.logprobs, _response_format(body.get("response_format"), None))
    return [RowRequest(index=row.index, prompt=prompt, messages=None, params=params.clone()) for prompt in prompts]


def _sampling(body: dict[str, Any], job: BatchJob, logprobs: int | None,
              structured: StructuredOutputsParams | None, tool_choice: ToolChoice | None = None) -> SamplingParams:
    """The body's sampling fields over the job's defaults, OpenAI's ranges checked."""
    values = {name: value for name, value in job.sampling.model_dump().items() if name in _JOB_DEFAULTS}
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _integer(body, "max_tokens", minimum=1)
    _integer(body, "n", minimum=1, maximum=128)
    _integer(body, "seed")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > 4:
        raise _invalid("stop", f"holds {len(stop)} strings; at most 4")
    values.update({name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None})
    values["logit_bias"] = _logit_bias(body.get("logit_bias"))
    return SamplingParams(**values, logprobs=logprobs, structured_outputs=structured, tool_choice=tool_choice)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("logit_bias", f"must be an object of token id -> bias, got {value!r:.80}")
    bias = {}
    for token, weight in value.items():
        if not str(token).isdigit():
            raise _invalid("logit_bias", f"keys must be token ids, got {token!r:.40}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not -100 <= weight <= 100:
            raise _invalid("logit_bias", f"biases must be numbers in [-100, 100], got {weight!r:.40} for {token}")
        bias[int(token)] = float(weight)
    return bias


def _response_format(value: Any, structured: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a structured-output constraint (None for text)."""
    if value is None or (isinstance(value, dict) and value.get("type") == "text"):
        return structured
    if structured is not None:
        raise _invalid("response_format", "cannot be combined with a tool_choice that forces a tool call")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise _invalid("response_format", "json_schema needs {'name': ..., 'schema': {...}}, got "
                           f"{schema!r:.80}")
        return StructuredOutputsParams(json=schema["schema"])
    raise _invalid("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {value!r:.80}")


# ----------------------------------------------------------------- checks
def _invalid(name: str, problem: str) -> RequestError:
    return RequestError("invalid_request", f"{name} {problem}", name)


def _number(body: dict[str, Any], name: str, minimum: float, maximum: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= maximum:
        raise _invalid(name, f"must be a number in [{minimum:g}, {maximum:g}], got {value!r:.40}")
    return value


def _integer(body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum) \
            or (maximum is not None and value > maximum):
        bounds = f" in [{minimum}, {maximum}]" if maximum is not None else f" >= {minimum}" if minimum is not None \
            else ""
        raise _invalid(name, f"must be an integer{bounds}, got {value!r:.40}")
    return value
