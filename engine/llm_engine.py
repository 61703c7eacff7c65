"""The engine loop: add_request / abort_request / step.

A step reads in three lines: the scheduler picks the tokens to compute under the
token budget, the runner computes them (writing their KV into the paged cache) and
returns logits where a sequence reaches its end, and the sampler plus the output
processor append one token to each such sequence and decide which ones stop.

With async scheduling (EngineConfig.async_scheduling; on by default on CUDA) the
last part of step N, the output processing, runs in step N+1 after that step's
forward and sampling are queued, so a GPU computes N+1 while the host detokenizes
and checks N. Invariant: a sequence has at most one pending token (sampled by the
step in flight, not yet appended); its outputs are appended in order, and one
that a token stopped never shows the tokens computed after it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig
from .model.loader import LoadedModel, load_causal_lm
from .attention.backends import AttentionBackend, choose_attention_backend
from .cpu.paths import NO_CPU_PATHS, CpuRewrites, ModelShape, choose_cpu_paths, optimize_for_cpu
from .cpu.memory import keep_freed_memory
from .model.kv_cache_spec import KVCacheSpec
from .model.load_check import check_model
from .lora.request import lora_cache_salt
from .lora.manager import LoRAManager
from .model.runner import (
    DEFAULT_CPU_KV_CACHE_BYTES, ModelOutput, ModelRunner, PendingTokens, model_max_len, plan_kv_cache,
)
from .sampling.output_processor import OutputProcessor, RequestState, SampleState
from .outputs import RequestMetrics, RequestOutput
from .params import SamplingParams
from .inputs.prompts import PromptType, tokenize_prompt
from .sampling.reasoning import make_reasoning_parser
from .core.request import Request, RequestStatus
from .sampling.sampler import SampleRow, Sampler, SamplerOutput, bad_word_bans, gather_logprobs
from .core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .model.loader import recurrent_layer_indices
from .recurrent.state import prepare_recurrent_layers
from .sampling.structured import StructuredOutputError, StructuredOutputManager, forbidden_picks

logger = logging.getLogger(__name__)



class LLMEngine:
    """Continuous-batching engine over one model; driven by ``step()`` (an
    engine_protocol.Engine)."""

    task = "generate"

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_causal_lm(config)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.device = loaded.device
        config.resolve_token_budget(self.device.type)
        self.vocab_size = int(self.hf_config.get_text_config().vocab_size)
        # Before sizing the KV cache: the adapter slots take device memory.
        self.lora_manager = (LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.device,
                                         loaded.dtype) if config.enable_lora else None)
        spec = KVCacheSpec.from_hf_config(self.hf_config, loaded.dtype)
        # Recurrent layers (gated delta-net, short convolution...) run through their kind
        # with per-request state slots (engine/recurrent/).
        state_spec = prepare_recurrent_layers(self.model, recurrent_layer_indices(self.hf_config))
        self.cpu_paths = NO_CPU_PATHS  # the CPU fast paths taken on this host (engine/cpu/paths.py)
        self.cpu_rewrites = CpuRewrites()  # and the modules they replaced
        # A model without attention layers (a pure state-space model) may name no heads.
        num_heads = getattr(self.hf_config.get_text_config(), "num_attention_heads", None) or 1
        first_attention = next((layer for layer in spec.layers if layer.num_kv_heads), None)
        if self.device.type == "cpu":
            keep_freed_memory()
        if self.device.type == "cpu" and first_attention is not None:
            shape = ModelShape.of(self.model, num_heads, first_attention.num_kv_heads, first_attention.head_dim)
            self.cpu_paths = choose_cpu_paths(loaded.dtype, shape, config.max_num_batched_tokens)
            self.cpu_rewrites = optimize_for_cpu(self.model, self.cpu_paths, config.max_num_batched_tokens)
        # One attention backend for the engine's life: the runner, the CPU layers and the
        # CUDA-graph path ask it how attention runs.
        self.attention = choose_attention_backend(
            config.attention_backend, self.device, loaded.dtype, num_heads,
            native_decode=self.cpu_paths.decode_kernel, native_prefill=self.cpu_paths.prefill_kernel,
            chunk_sizes=spec.chunk_sizes, position_bias=uses_position_bias(self.model))
        model_len = resolve_max_model_len(config, self.hf_config)
        budget = kv_cache_budget(config, self.device, self.model, self.attention, spec, model_len)
        num_blocks, num_state_slots = plan_kv_cache(config, spec, model_len, budget, state_spec)
        self.max_model_len = min(model_len, num_blocks * config.block_size)
        self.runner = ModelRunner(self.model, spec, num_blocks, config.block_size, self.device, self.attention,
                                  state_spec, num_state_slots)
        self.runner.lora_manager = self.lora_manager
        if (self.device.type == "cuda" and not config.enforce_eager and self.lora_manager is None
                and self.attention.replays_decode_graphs and not num_state_slots):
            self.runner.enable_decode_graphs(config.max_num_seqs, self.max_model_len, capture=True)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=num_state_slots or config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_loras=config.max_loras if config.enable_lora else None,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=prefix_caching(config, num_state_slots),
            num_state_slots=num_state_slots,
        ))
        if config.check_model:
            check_model(self.runner, self.vocab_size, self.max_model_len, type(self.model).__name__)
        self.sampler = Sampler(config.seed)
        self.reasoning_parser = (make_reasoning_parser(config.reasoning_parser, self.tokenizer)
                                 if config.reasoning_parser is not None else None)
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids(loaded), self.max_model_len,
                                                self.reasoning_parser)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                  self.output_processor.eos_token_ids)
        # Outputs finished in a step that then raised; returned by the next step.
        self._finished_outputs: list[RequestOutput] = []
        self._states: dict[str, RequestState] = {}
        self._sequence_owner: dict[str, tuple[RequestState, int]] = {}
        self._samples: dict[str, SampleState] = {}  # each sequence's, for the step's output processing
        self._generators: dict[str, torch.Generator] = {}
        self._rows: dict[str, SampleRow] = {}  # each sampling sequence's row, kept while it runs
        self._steady_step: SteadyStep | None = None  # see _sample_rows
        self._arrivals = itertools.count()
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None  # a step whose outputs are not processed yet
        self.num_steps = 0  # forward passes run, for benchmarks and diagnostics
        self.num_deferred_steps = 0  # of which left in flight (async scheduling)

    # ----------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a str, {"prompt": str} or {"prompt_token_ids": [...]}."""
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: Any = None, priority: int = 0) -> None:
        """Tokenize ``prompt`` and queue it. Raises ValueError (naming the request)
        if it can never run; nothing is queued then."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if lora_request is not None and self.lora_manager is not None:
            self.lora_manager.check(lora_request)  # LoRAError naming the path, rank or modules
        elif lora_request is not None:
            raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request!r}, "
                             "but this engine was built without enable_lora=True")
        if params.max_reasoning_tokens is not None and self.reasoning_parser is None:
            raise ValueError(f"request {request_id!r} sets max_reasoning_tokens={params.max_reasoning_tokens}, "
                             "but this engine was built without a reasoning_parser")
        # A constraint that cannot compile fails here, before anything is queued.
        grammar = self.structured.submit(request_id, params.structured_outputs)
        text, token_ids = self.tokenize_prompt(prompt)
        params = self._resolve_params(params)
        state = RequestState(request_id, text, token_ids, params, lora_request, RequestMetrics(time.monotonic()))
        state.grammar = grammar
        state.bad_words_ids = self._bad_words_ids(params.bad_words or [])
        state.pipelinable = self._pipelinable(params)
        arrival = next(self._arrivals)
        sequences = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=token_ids,
                max_tokens=params.max_tokens,
                priority=priority,
                arrival_index=arrival,
                params=params,
                prompt=text,
                lora_request=lora_request,
                cache_salt=lora_cache_salt(lora_request),
            )
            for index in range(params.n)
        ]
        if params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position: no prefix hits.
            for sequence in sequences:
                sequence.cache_salt = ("prompt_logprobs", request_id)
        # The other samples fork from the first once its prompt is computed, so the
        # prompt is computed once and its KV blocks are shared.
        self.scheduler.add_request(sequences[0])
        state.pending_forks = sequences[1:]
        for index, sequence in enumerate(sequences):
            sample = self.output_processor.new_sample(state, sequence, index)
            state.samples.append(sample)
            self._sequence_owner[sequence.request_id] = (state, index)
            self._samples[sequence.request_id] = sample
            if params.seed is not None:
                self._generators[sequence.request_id] = torch.Generator().manual_seed(params.seed + index)
        self._states[request_id] = state

    def _bad_words_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as written and after a space (how it
        appears mid-sentence), deduplicated."""
        sequences = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False).input_ids
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _pipelinable(self, params: SamplingParams) -> bool:
        """Whether a sequence may leave a sampled token pending while the next step is
        prepared (async scheduling): nothing that samples its next token may depend on
        the pending one on the host (its grammar, reasoning phase, penalties, bad words,
        min_tokens), and it reads no logprobs (they would wait for the device). Stop
        strings and stop tokens do not matter: a token past the stop is discarded."""
        return (params.logprobs is None and params.prompt_logprobs is None and params.structured_outputs is None
                and not params.bad_words and not params.min_tokens and self.reasoning_parser is None
                and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                and params.repetition_penalty == 1.0)

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        params = params.clone()
        params.all_stop_token_ids = self.output_processor.stop_token_ids(params)
        return params

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are (waiting or running); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            sequence_ids = [s.sequence.request_id for s in state.samples]
            self.scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
            self._forget_sequences(sequence_ids)

    def _forget_sequences(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self._sequence_owner.pop(sequence_id, None)
            self._samples.pop(sequence_id, None)
            self._generators.pop(sequence_id, None)
            self._rows.pop(sequence_id, None)
            self.structured.forget(sequence_id)
        self._steady_step = None

    def abort_all(self) -> None:
        self.abort_request(list(self._states))

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def has_capacity(self) -> bool:
        """Whether to add more requests before the next step (see engine_protocol.Engine).
        Requests waiting for their grammar to compile count: they are added work."""
        return len(self._states) < 2 * self.config.max_num_seqs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks of running requests keep their contents."""
        self.scheduler.kv_cache.reset_prefix_cache()

    def close(self) -> None:
        self.abort_all()
        self._in_flight = None
        self.structured.close()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return the outputs of requests that finished in it.

        Async scheduling: a step whose every sampled sequence allows it (see
        ``_pipelinable``) stays in flight, and its outputs are processed in the next
        step, after that step's forward and sampling are queued. Each of its sequences
        then has one pending token, which the next step computes on the device before
        the host knows it; a sequence its token finished has that next token discarded.
        """
        scheduler_output = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, None
        if scheduler_output.is_empty:
            if in_flight is not None:
                self._process(in_flight)
            elif self.structured.has_held():
                # Nothing to compute: wait for a held sequence's grammar, then sample it.
                self._process(self._sample_on_device([], None, deferrable=False, wait=True))
            return self._take_finished_outputs()
        self.num_steps += 1
        try:
            launched = self._launch(scheduler_output, in_flight)
        except BaseException:
            self._roll_back(scheduler_output)
            if in_flight is not None:
                self._process(in_flight)
            raise
        if in_flight is not None:
            self._process(in_flight)  # on a GPU, while the launched step runs
        if launched.deferred:
            self._in_flight = launched
            self.num_deferred_steps += 1
        else:
            self._process(launched)
        return self._take_finished_outputs()

    def _roll_back(self, scheduler_output: SchedulerOutput) -> None:
        """A failed forward wrote no trustworthy KV: the scheduled tokens count as
        not computed again, so they are recomputed (and never prefix-cached). Layers
        that ran before the failure may have advanced a request's recurrent state
        past ``start``, so with recurrent layers the request restarts from token 0."""
        restart = self.runner.num_state_slots > 0
        for item in scheduler_output.scheduled:
            item.request.num_computed_tokens = 0 if restart else item.start

    def _launch(self, scheduler_output: SchedulerOutput, in_flight: "LaunchedStep | None") -> "LaunchedStep":
        """Queue the step's forward and sampling; ``in_flight``: the step before it, whose
        sampled tokens are the inputs of its sequences' pending positions."""
        pending = in_flight.pending_tokens() if in_flight is not None else None
        model_output = self.runner.execute(scheduler_output, pending)
        self._record_prompt_logprobs(model_output)
        rows, deferrable = self._sample_rows(scheduler_output, model_output)
        logits = take_rows(model_output.logits, [row.logits_row for row in rows]) if rows else None
        return self._sample_on_device(rows, logits, deferrable and not model_output.prompt_rows)

    def _sample_on_device(self, rows: list[SampleRow], logits: torch.Tensor | None, deferrable: bool,
                          wait: bool = False) -> "LaunchedStep":
        """Queue the sampling of one token for each row (logits: [len(rows), V]) and for
        each held sequence whose grammar has compiled since (``wait``: wait for one
        first); hold the rows whose grammar has not. ``deferrable``: every row's
        sequence may leave its token pending (async scheduling)."""
        failures: dict[str, StructuredOutputError] = {}
        num_rows = len(rows)
        # Deferrable rows have no grammar and no reasoning tracker: holding them and
        # their bitmask would be no-ops, so only a held sequence brings the calls back.
        plain = deferrable and not self.structured.has_held()
        if not plain:
            rows, logits = self.structured.hold(rows, logits, self._state_of, failures)
            rows, logits = self.structured.release(rows, logits, self._state_of, self._held_row, failures, wait)
        if not rows:
            return LaunchedStep([], None, None, set(), failures, deferred=False)
        bitmask, restricted = None, set()
        if not plain:
            bitmask, restricted = self.structured.bitmask(rows, [self._sample_state(row.request) for row in rows])
        sampled = self.sampler(logits, rows, bitmask)
        deferred = (self.async_scheduling and deferrable and len(rows) == num_rows and not failures
                    and bitmask is None)
        if deferred:
            for row in rows:
                row.request.num_pending_tokens += 1
        return LaunchedStep(rows, sampled, bitmask, restricted, failures, deferred)

    def _process(self, launched: "LaunchedStep") -> None:
        """Append each row's sampled token (waiting for the device to have sampled
        them), decide which sequences stop, and queue the outputs of finished requests.
        A request whose grammar fails to compile, or whose sampled token its grammar
        rejects, is aborted and a StructuredOutputError raised after the others' tokens
        are appended (their finished outputs come from the next step)."""
        failures = launched.failures
        finished_states = []
        if launched.rows:
            token_ids = launched.sampled.host_token_ids()
            forbidden = forbidden_picks(launched.bitmask, launched.restricted, token_ids)
            samples, deferred = self._samples, launched.deferred
            append_plain, append_token = self.output_processor.append_plain, self.output_processor.append_token
            for i, (row, token_id, logprobs) in enumerate(zip(launched.rows, token_ids, launched.sampled.logprobs)):
                sequence = row.request
                if deferred:
                    sequence.num_pending_tokens -= 1
                if sequence.status.is_finished:
                    continue  # stopped or aborted before this token: it is discarded
                sample = samples[sequence.request_id]
                try:
                    if i in forbidden:
                        raise StructuredOutputError(
                            f"request {sample.owner.request_id!r}: no token satisfies both its structured output "
                            "(or reasoning budget) and its other sampling constraints (allowed_token_ids, "
                            "bad_words, logit_bias, min_tokens)")
                    status = (append_plain(sample, token_id) if sample.plain
                              else append_token(sample.owner, sample, token_id, logprobs))
                except StructuredOutputError as exc:
                    failures.setdefault(sample.owner.request_id, exc)
                    continue
                if status is not None:
                    state = sample.owner
                    self.scheduler.finish_requests(sequence.request_id, status)
                    if state.finished and not state.pending_forks:
                        finished_states.append(state)
        self._finished_outputs += [self._finish(s) for s in finished_states if s.request_id not in failures]
        if failures:
            self.abort_request(list(failures))
            raise next(iter(failures.values()))

    def _take_finished_outputs(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def _sample_state(self, sequence: Request) -> SampleState:
        state, index = self._sequence_owner[sequence.request_id]
        return state.samples[index]

    def _state_of(self, sequence_id: str) -> RequestState:
        return self._sequence_owner[sequence_id][0]

    def _held_row(self, sequence_id: str) -> SampleRow:
        """The sample row of a sequence held for its grammar (its logits come separately)."""
        return self._sample_row(self.scheduler.get_request(sequence_id), self._state_of(sequence_id), 0)

    def _sample_rows(self, scheduler_output: SchedulerOutput,
                     model_output: ModelOutput) -> tuple[list[SampleRow], bool]:
        """One row per sequence that samples this step (forked samples join their
        parent's first sampling, on the same logits row), and whether every one of
        them may leave its token pending (async scheduling)."""
        scheduled = scheduler_output.scheduled
        sample_rows = model_output.sample_rows
        steady = self._steady_step
        if steady is not None and len(sample_rows) == len(scheduled) and sample_rows == steady.sample_rows:
            return list(steady.rows), True
        rows = []
        deferrable = reusable = True
        known_rows = self._rows
        for item in scheduled:
            sequence_id = item.request.request_id
            logits_row = sample_rows.get(sequence_id)
            row = known_rows.get(sequence_id)
            if row is not None and row.steady:
                # Sampled before (so scheduled before), nothing to recompute, forked.
                if logits_row is not None:
                    row.logits_row = logits_row
                    rows.append(row)
                    deferrable = deferrable and row.pipelinable
                continue
            sequence = item.request
            state, _ = self._sequence_owner[sequence_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = time.monotonic()
            if logits_row is None:
                continue
            row = self._sample_row(sequence, state, logits_row)
            rows.append(row)
            reusable = reusable and row.steady
            if state.pending_forks:
                deferrable = False
                rows += [self._sample_row(child, state, logits_row) for child in self._fork(sequence, state)]
            elif not state.pipelinable:
                deferrable = False
        reusable = reusable and deferrable and len(rows) == len(sample_rows) == len(scheduled)
        self._steady_step = SteadyStep(sample_rows, list(rows)) if reusable else None
        return rows, deferrable

    def _sample_row(self, sequence: Request, state: RequestState, logits_row: int) -> SampleRow:
        """The sequence's sample row, made once and kept while it runs; only what
        changes from token to token (min_tokens, bad words) is recomputed."""
        row = self._rows.get(sequence.request_id)
        params = state.params
        if row is None:
            row = SampleRow(sequence, params, self._generators.get(sequence.request_id),
                            steady=not params.min_tokens and not state.bad_words_ids,
                            pipelinable=state.pipelinable)
            self._rows[sequence.request_id] = row
        row.logits_row = logits_row
        if params.min_tokens:
            num_output = sequence.num_output_tokens
            row.blocked_token_ids = tuple(params.all_stop_token_ids) if num_output < params.min_tokens else ()
        if state.bad_words_ids:
            row.banned_token_ids = bad_word_bans(sequence.output_token_ids, state.bad_words_ids)
        return row

    def _fork(self, parent: Request, state: RequestState) -> list[Request]:
        children, state.pending_forks = state.pending_forks, []
        copies = [self.scheduler.fork_request(parent, child) for child in children]
        self.runner.copy_blocks([pair for pair in copies if pair is not None])
        parent_slot = self.scheduler.state_slot(parent.request_id)
        if parent_slot is not None:
            child_slots = [self.scheduler.state_slot(child.request_id) for child in children]
            self.runner.copy_states([(parent_slot, slot) for slot in child_slots if slot is not None])
        return children

    def _record_prompt_logprobs(self, model_output: ModelOutput) -> None:
        for request_id, (first_row, num_rows, position) in model_output.prompt_rows.items():
            state, _ = self._sequence_owner[request_id]
            prompt = state.prompt_token_ids
            logprobs = torch.log_softmax(model_output.logits[first_row : first_row + num_rows].double(), dim=-1)
            targets = torch.tensor(prompt[position + 1 : position + 1 + num_rows], device=logprobs.device)
            entries = gather_logprobs(logprobs, targets, [state.params.prompt_logprobs] * num_rows)
            self.output_processor.record_prompt_logprobs(state, position, entries)

    def _finish(self, state: RequestState) -> RequestOutput:
        self._states.pop(state.request_id, None)
        self._forget_sequences([s.sequence.request_id for s in state.samples])
        num_cached = max(state.samples[0].sequence.num_cached_tokens, 0)
        return self.output_processor.make_output(state, num_cached)


@dataclass
class SteadyStep:
    """The sample rows of a step in which every scheduled sequence sampled, with a
    steady row (SampleRow.steady), and may leave its token pending. A later step that
    samples the same sequences from the same logits rows (``sample_rows``, sequence id
    -> row) samples with these rows as they are; any finished or aborted sequence
    drops it (a sequence id may then be taken by another request)."""

    sample_rows: dict[str, int]
    rows: list[SampleRow]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued: its sample rows, the sampler's
    output (token ids still on the device), the structured-output bitmask and the
    rows it restricts, the failures found so far, and whether its outputs wait for
    the next step (``deferred``: each row's sequence then has one pending token)."""

    rows: list[SampleRow]
    sampled: SamplerOutput | None
    bitmask: torch.Tensor | None
    restricted: set[int]
    failures: dict[str, StructuredOutputError]
    deferred: bool

    def pending_tokens(self) -> PendingTokens | None:
        """The runner's view of the sampled ids the next step reads, if deferred."""
        if not self.deferred:
            return None
        return PendingTokens(self.sampled.token_ids, {row.request.request_id: i for i, row in enumerate(self.rows)})


def uses_position_bias(model: torch.nn.Module) -> bool:
    """Whether some attention layer attends with a bias table by key position (an
    adapter's ``uses_position_bias``), which only the torch attention path takes."""
    return any(getattr(module, "uses_position_bias", False) for module in model.modules())


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]; the common case (every row once, in order) without a copy, and
    otherwise without a blocking host-to-device copy of the index."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))


def prefix_caching(config: EngineConfig, num_state_slots: int) -> bool:
    """Whether the engine caches prefixes. Not with recurrent layers: a cached prefix
    restores KV blocks but not the recurrent state after it, which is kept for running
    requests only (not at block boundaries), so a hit could not be continued from."""
    if config.enable_prefix_caching and num_state_slots:
        logger.info("prefix caching is off: the model has recurrent layers, whose state is not kept at "
                    "block boundaries")
        return False
    return config.enable_prefix_caching


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_len = model_max_len(hf_config)
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's maximum length {model_len}"
        )
    return config.max_model_len


def kv_cache_budget(config: EngineConfig, device: torch.device, model: torch.nn.Module,
                    attention: AttentionBackend, spec: KVCacheSpec, model_len: int) -> int:
    """Bytes for the KV cache: kv_cache_memory_bytes if set; on CPU a default; on
    CUDA gpu_memory_utilization of the device, less what the model uses at peak."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    from .model.profiling import profile_peak_bytes

    _, total = torch.cuda.mem_get_info(device)
    peak = profile_peak_bytes(model, attention, spec, config.max_num_batched_tokens, config.block_size, device,
                              model_len)
    return int(total * config.gpu_memory_utilization) - peak


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """EOS ids from the tokenizer and the model's generation_config."""
    ids: set[int] = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen_eos = getattr(loaded.generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(t) for t in gen_eos)
    return ids

