"""Per-request parameters: SamplingParams for generation (with its
StructuredOutputsParams and the SamplingTraits derived from it once per request),
PoolingParams for embeddings.

Names, defaults and meanings follow vLLM's offline API so jobs move over unchanged.
Every field is validated at construction; an invalid value raises ValueError naming
the field and the value. Whether a schema, regex or grammar compiles is checked when
the engine adds the request (it needs the grammar engine), not here.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

from .tools.calls import ToolChoice

_SAMPLING_EPS = 1e-5
# Field values SamplingParams.clone shares instead of copying.
_IMMUTABLE_TYPES = frozenset({type(None), bool, int, float, str})


class SamplingType(enum.Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    RANDOM_SEED = "random_seed"


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a JSON schema, a regex, a list of choices, an EBNF
    grammar or any JSON object (vLLM's ``StructuredOutputsParams``); exactly one of
    them is set.

    ``json`` is a JSON schema (a dict or its JSON text); ``grammar`` is an EBNF
    grammar in xgrammar's dialect (GBNF, rule ``root`` first); ``structural_tag`` is
    the JSON text of an xgrammar structural tag. ``disable_any_whitespace`` makes JSON
    output compact (no whitespace between tokens); ``disable_additional_properties``
    forbids object keys the schema does not list (the default already does, as
    vLLM's xgrammar backend does). ``disable_fallback`` is accepted for vLLM
    compatibility: shardline has one backend, so it never falls back.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        count = sum(value is not None for value in (
            self.json, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag))
        if count > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {self._constraints()}")
        if count < 1:
            raise ValueError("You must use one kind of structured outputs constraint but none are specified: "
                             f"{self._constraints()}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True when set, got {self.json_object!r}")
        if self.whitespace_pattern is not None:
            raise ValueError(f"whitespace_pattern={self.whitespace_pattern!r} is not supported by the xgrammar "
                             "backend; use disable_any_whitespace=True for compact JSON")

    def _constraints(self) -> dict[str, Any]:
        names = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        return {name: getattr(self, name) for name in names}

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(name for name, value in self._constraints().items() if value is not None)


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (vLLM's SamplingParams)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Most tokens a reasoning model may think for before its answer is forced to
    # begin (the end-of-reasoning token is sampled next); needs the engine's
    # reasoning_parser. shardline's own option: vLLM's offline API has none.
    max_reasoning_tokens: int | None = None
    # How the completion may call the tools its chat offered; the engine then reads its
    # calls into CompletionOutput.tool_calls (engine/tools/). shardline's own field:
    # LLM.chat sets mode "auto" when given tools and the engine has a tool-call parser.
    tool_choice: ToolChoice | None = None
    # Filled by the engine from the model's generation_config (EOS ids beyond the
    # tokenizer's own), not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        # From here on ``stop`` and ``stop_token_ids`` are lists (see ``stop_lists``).
        stop: list[str]
        if self.stop is None:
            stop = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        else:
            stop = list(self.stop)
        stop_token_ids = list(self.stop_token_ids or [])
        self.stop, self.stop_token_ids = stop, stop_token_ids
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate(stop, stop_token_ids)
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(stop_token_ids)

    def _validate(self, stop: list[str], stop_token_ids: list[int]) -> None:
        """Check every field; ``stop`` and ``stop_token_ids`` as normalized to lists."""
        _check_int("n", self.n, minimum=1)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != -1:
                _check_int(name, value, minimum=0)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        for token_id in stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, minimum=0)
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.max_reasoning_tokens is not None:
            _check_int("max_reasoning_tokens", self.max_reasoning_tokens, minimum=0)
        if self.tool_choice is not None and not isinstance(self.tool_choice, ToolChoice):
            raise ValueError(f"tool_choice must be a ToolChoice, got {type(self.tool_choice).__name__}")
        if self.tool_choice is not None and not self.detokenize:
            raise ValueError("tool_choice needs detokenize=True (calls are read from the answer)")

    def stop_lists(self) -> tuple[list[str], list[int]]:
        """``stop`` and ``stop_token_ids`` as lists (the fields take the wider forms vLLM's
        do: one string, None), also when a caller set them after construction."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stop, list(self.stop_token_ids or [])

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one (made for every request:
        fields of immutable values are shared, the rest deep-copied)."""
        clone = object.__new__(type(self))
        fields = clone.__dict__
        fields.update(self.__dict__)
        for name, value in fields.items():
            if type(value) not in _IMMUTABLE_TYPES:
                fields[name] = copy.deepcopy(value)
        return clone


@dataclass(frozen=True, slots=True)
class SamplingTraits:
    """What a request's resolved SamplingParams imply for how its sequences are
    sampled and processed, computed once when the engine adds the request (from
    the params and whether the engine has a reasoning parser) and read by the
    sampler, the output processor, the structured-output manager and the engine's
    async scheduling instead of re-deriving them from the params."""

    # The row draws at random (temperature > 0), rather than taking the argmax.
    is_random: bool
    # The request reads the sampled tokens' logprobs.
    wants_logprobs: bool
    # Presence, frequency or repetition penalty set.
    has_penalties: bool
    # Logit processors other than min_tokens and bad words: allowed_token_ids,
    # logit_bias or penalties (see sampler.apply_logit_processors).
    has_logit_processors: bool
    # Nothing in the sample row changes from token to token (no min_tokens, no bad
    # words), so a row made once serves every step.
    steady_row: bool
    # The argmax of the raw logits is all the row ever needs.
    argmax_only: bool
    # A sampled token may stay pending while the next step is prepared (async
    # scheduling): nothing that samples the next token depends on it on the host
    # (grammar, reasoning phase, penalties, bad words, min_tokens) and no logprobs
    # are read. Stop strings and stop tokens do not matter: a token past the stop
    # is discarded.
    pipelinable: bool
    # The engine splits reasoning from the answer (it has a reasoning parser).
    reasoning: bool
    # The text is made when the request finishes: nothing reads it per step (no
    # reasoning split, no stop strings).
    text_at_finish: bool
    # Appended by OutputProcessor.append_plain: no reasoning, grammar or logprobs.
    plain_output: bool

    @classmethod
    def of(cls, params: SamplingParams, reasoning: bool) -> SamplingTraits:
        """The traits of ``params`` (resolved: all_stop_token_ids filled) on an
        engine with (``reasoning``) or without a reasoning parser."""
        is_random = params.sampling_type != SamplingType.GREEDY
        wants_logprobs = params.logprobs is not None
        has_penalties = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                         or params.repetition_penalty != 1.0)
        has_logit_processors = params.allowed_token_ids is not None or bool(params.logit_bias) or has_penalties
        steady_row = not params.min_tokens and not params.bad_words
        text_at_finish = not reasoning and not params.stop
        return cls(
            is_random=is_random,
            wants_logprobs=wants_logprobs,
            has_penalties=has_penalties,
            has_logit_processors=has_logit_processors,
            steady_row=steady_row,
            argmax_only=steady_row and not (is_random or wants_logprobs or has_logit_processors),
            pipelinable=(not wants_logprobs and params.prompt_logprobs is None and params.structured_outputs is None
                         and steady_row and not reasoning and not has_penalties),
            reasoning=reasoning,
            text_at_finish=text_at_finish,
            plain_output=(not reasoning and params.structured_outputs is None and not wants_logprobs
                          and (text_at_finish or params.detokenize)),
        )


class PoolingTask(str, enum.Enum):
    EMBED = "embed"
    ENCODE = "encode"


@dataclass
class PoolingParams:
    """How to turn a prompt's hidden states into an embedding (vLLM's PoolingParams).

    ``dimensions`` truncates the embedding (Matryoshka style) and renormalises when
    ``normalize`` is set; ``truncate_prompt_tokens`` keeps the last k prompt tokens.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    # "embed" (the pooled vector, the default) or "encode" (per-token states).
    task: str | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in ("embed", "encode"):
            raise ValueError(f"task must be 'embed' or 'encode', got {self.task!r}")
        if self.dimensions is not None:
            _check_int("dimensions", self.dimensions, minimum=1)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_range(name: str, value: Any, low: float, high: float) -> None:
    _check_number(name, value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
