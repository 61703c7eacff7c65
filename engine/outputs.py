"""What the offline API returns: vLLM's RequestOutput, CompletionOutput and
EmbeddingRequestOutput, with the same fields and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tools.calls import ToolCallOutput

# One position's logprobs: token id -> Logprob (the sampled token is always present).
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    """Log probability of one token at one position, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds of time.monotonic()."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``finish_reason`` is "stop" (EOS, a stop token, a stop string, or a structured
    output's grammar complete), "length" (max_tokens or max_model_len, also when
    that cut a structured output short, so it will not parse) or "abort";
    ``stop_reason`` is the stop string or stop token id that ended it, None for EOS
    or length.

    ``reasoning`` (shardline's field; vLLM's offline CompletionOutput has none) is
    the thinking of a reasoning model when the engine has a ``reasoning_parser``:
    the text between the think tags, tags excluded, while ``text`` is the answer
    after them. It is None when the engine has no parser or the sample did not
    reason. ``token_ids`` and ``logprobs`` cover every generated token, both parts
    and the tags. ``num_reasoning_tokens`` counts the generated tokens the parser put
    in the reasoning (tags excluded; 0 without a parser).

    ``tool_calls`` (shardline's) is the answer read for tool calls when the request
    set a ``tool_choice`` (engine/tools/): the calls, the content beside them, or
    why a call could not be read (``text`` stays the whole answer). None when the
    request set no tool_choice.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning: str | None = None
    num_reasoning_tokens: int = 0
    tool_calls: ToolCallOutput | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The final state of one prompt: its tokens and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    lora_request: object | None = None
    # shardline's: the request whose computation this output copies, when the engine
    # ran an identical deterministic request once for both (engine/core/duplicates.py).
    duplicate_of: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    data: object


@dataclass
class EmbeddingRequestOutput:
    """The embedding of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None


@dataclass
class PoolingRequestOutput:
    """A pooled output of one prompt (``LLM.encode``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    prompt: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """An engine's load at one moment, for health lines: requests running (holding
    cache) and waiting, the share of KV-cache blocks held, the prefix cache's hit rate
    over every admission so far, and preemptions and steps so far. Fields an engine
    has no such part for (the pooling engine's cache) are None."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float | None = None
    prefix_cache_hit_rate: float | None = None  # None: prefix caching is off
    num_preemptions: int = 0
    num_steps: int = 0
