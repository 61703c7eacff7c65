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
import time
from collections.abc import Iterable
from typing import Any

import torch

from .config import EngineConfig
from .core.duplicates import DuplicateRequests
from .core.request import Request, RequestStatus
from .core.scheduler import SchedulerOutput
from .inputs.prompts import PromptType, tokenize_prompt
from .lora.request import lora_cache_salt
from .model.loader import LoadedModel
from .model.runner import ModelOutput
from .model.step_io import LaunchedStep, take_rows
from .multimodal.inputs import ImageInput, ProcessedPrompt
from .multimodal.media import check_prompt_keys, prompt_media, refuse_media
from .outputs import EngineStats, RequestMetrics, RequestOutput
from .params import SamplingParams, SamplingTraits, SamplingType
from .parts.build import EngineParts, build_engine_parts
from .sampling.sampler import gather_logprobs
from .sampling.sequences import RequestState, SequenceRecord, Sequences
from .sampling.structured import StructuredOutputError, forbidden_picks
from .tools import TOOL_CALL_PARSERS


class LLMEngine:
    """Continuous-batching engine over one model; driven by ``step()`` (an
    llm.Engine)."""

    task = "generate"

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 parts: EngineParts | None = None) -> None:
        """An engine over ``parts`` (by default built from ``config`` and ``loaded``
        by parts/build.py's build_engine_parts)."""
        parts = parts or build_engine_parts(config, loaded)
        self.config = parts.config
        self.model = parts.loaded.model
        self.tokenizer = parts.loaded.tokenizer
        self.hf_config = parts.loaded.hf_config
        self.device = parts.loaded.device
        self.vocab_size = parts.vocab_size
        self.max_model_len = parts.max_model_len
        self.lora_manager = parts.prepared.lora_manager
        self.multimodal = parts.multimodal  # a vision-language model's processor step, else None
        self.cpu_paths = parts.prepared.cpu_paths  # the CPU fast paths taken on this host (engine/cpu/paths.py)
        self.cpu_rewrites = parts.prepared.cpu_rewrites  # and the modules they replaced
        self.attention = parts.prepared.attention
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.reasoning_parser = parts.reasoning_parser
        self.tool_parser = parts.tool_parser
        self.output_processor = parts.output_processor
        self.structured = parts.structured
        # Every unfinished request and one record per sequence (sampling/sequences.py).
        self.sequences = Sequences(self.output_processor.new_sample, self._copy_forked, self.structured.forget)
        # Outputs finished in a step that then raised; returned by the next step.
        self._finished_outputs: list[RequestOutput] = []
        self._arrivals = itertools.count()
        # Identical deterministic requests run once, their output copied to each (core/duplicates.py).
        self.duplicates = DuplicateRequests(self.config.collapse_duplicate_requests)
        self.async_scheduling = (self.config.async_scheduling if self.config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None  # a step whose outputs are not processed yet
        self.num_steps = 0  # forward passes run, for benchmarks and diagnostics
        self.num_deferred_steps = 0  # of which left in flight (async scheduling)

    # ----------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a str, {"prompt": str} or {"prompt_token_ids": [...]}."""
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def preprocess(self, request_id: str, prompt: PromptType | ProcessedPrompt) -> PromptType | ProcessedPrompt:
        """The prompt with its images through the model's processor (a ProcessedPrompt); a
        prompt without media as it is. ValueError naming the request for media the model
        cannot take or cannot use. Reads only the processor: llm.py runs it on worker
        threads ahead of add_request, so image decoding does not hold up the steps."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        check_prompt_keys(request_id, prompt)
        media = prompt_media(request_id, prompt)
        if not media or not isinstance(prompt, dict):
            return prompt
        if self.multimodal is None:
            refuse_media(request_id, media, self.config.model)
        assert self.multimodal is not None, "refuse_media raised for a text-only model"
        return self.multimodal.process(request_id, prompt, media)

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    lora_request: Any = None, priority: int = 0) -> None:
        """Tokenize ``prompt`` and queue it. Raises ValueError (naming the request)
        if it can never run; nothing is queued then."""
        if request_id in self.sequences or request_id in self.duplicates:
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
        if params.tool_choice is not None and params.tool_choice.mode == "auto" and self.tool_parser is None:
            raise ValueError(f"request {request_id!r} lets the model call tools (tool_choice 'auto'), but this "
                             f"engine has no tool_call_parser and the chat template of {self.config.model!r} "
                             f"implies none; set tool_call_parser ({', '.join(TOOL_CALL_PARSERS)})")
        prompt = self.preprocess(request_id, prompt)
        images: tuple[ImageInput, ...] = ()
        if isinstance(prompt, ProcessedPrompt):
            text, token_ids, images = prompt.prompt, prompt.prompt_token_ids, prompt.images
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        key = self.duplicates.key(params.sampling_type is not SamplingType.RANDOM, text, tuple(token_ids),
                                  tuple((image.image_hash, image.positions) for image in images),
                                  lora_cache_salt(lora_request), priority, repr(params))
        if self.duplicates.join(request_id, key, time.monotonic()):
            return  # an identical request is running: its output is copied to this one
        # A constraint that cannot compile fails here, before anything is queued.
        grammar = self.structured.submit(request_id, params.structured_outputs)
        params = params.clone()
        params.all_stop_token_ids = self.output_processor.stop_token_ids(params)
        state = RequestState(request_id, text, token_ids, params,
                             SamplingTraits.of(params, reasoning=self.reasoning_parser is not None),
                             lora_request, RequestMetrics(time.monotonic()), grammar=grammar,
                             bad_words_ids=self.output_processor.bad_words_ids(params.bad_words or []))
        arrival = next(self._arrivals)
        sequences = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=token_ids,
                # Request.max_tokens is resolved: no limit of the request's own means max_model_len's.
                max_tokens=params.max_tokens if params.max_tokens is not None else self.max_model_len,
                priority=priority,
                arrival_index=arrival,
                params=params,
                prompt=text,
                images=images,
                lora_request=lora_request,
                # Prompt logprobs need logits at every prompt position: no prefix hits.
                cache_salt=(lora_cache_salt(lora_request) if params.prompt_logprobs is None
                            else ("prompt_logprobs", request_id)),
            )
            for index in range(params.n)
        ]
        self.scheduler.add_request(sequences[0])  # the others fork from it (Sequences.add)
        self.sequences.add(state, sequences)
        self.duplicates.lead(request_id, key)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are (waiting or running); unknown ids are ignored.
        A request whose computation other rows share leaves it running for them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for row_id in request_ids:
            request_id = self.duplicates.release(row_id)
            if request_id is None:
                continue
            state = self.sequences.remove(request_id)
            if state is not None:
                self.scheduler.finish_requests([s.sequence.request_id for s in state.samples],
                                               RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> None:
        self.duplicates.clear()
        self.abort_request(self.sequences.request_ids())

    def has_unfinished_requests(self) -> bool:
        return len(self.sequences) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.sequences) + self.duplicates.num_extra_rows

    def has_capacity(self) -> bool:
        """Whether to add more requests before the next step (see llm.Engine).
        Requests waiting for their grammar to compile count: they are added work."""
        return len(self.sequences) < 2 * self.config.max_num_seqs

    def stats(self) -> EngineStats:
        """The engine's load now (see llm.Engine): the scheduler's counts and the steps run."""
        return self.scheduler.stats(num_steps=self.num_steps)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks of running requests keep their contents."""
        self.scheduler.kv_cache.reset_prefix_cache()

    def close(self) -> None:
        self.abort_all()
        self._in_flight = None
        self.structured.close()
        if self.runner.followers is not None:  # a tensor-parallel engine's other ranks
            self.runner.followers.close()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return the outputs of requests that finished in it.

        Async scheduling: a step whose every sampled sequence allows it (see
        ``SamplingTraits.pipelinable``) stays in flight, and its outputs are processed
        in the next step, after that step's forward and sampling are queued. Each of its sequences
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
        """A failed forward wrote no trustworthy KV: the scheduled tokens (and those a
        partial prefix hit copied) count as not computed again, so they are recomputed
        (and never prefix-cached). Layers that ran before the failure may have advanced
        a request's recurrent state past ``start``, so with recurrent layers the request
        restarts from token 0."""
        restart = self.runner.num_state_slots > 0
        for item in scheduler_output.scheduled:
            copied = item.block_copy.num_tokens if item.block_copy is not None else 0
            item.request.num_computed_tokens = 0 if restart else item.start - copied
        self.scheduler.drop_unsaved_snapshots(scheduler_output)

    def _launch(self, scheduler_output: SchedulerOutput, in_flight: LaunchedStep | None) -> LaunchedStep:
        """Queue the step's forward and sampling; ``in_flight``: the step before it, whose
        sampled tokens are the inputs of its sequences' pending positions."""
        pending = in_flight.pending_tokens() if in_flight is not None else None
        # Prefix hits of hybrid models continue from a saved recurrent state, and shared
        # block boundaries save theirs (core/scheduler.py).
        items = scheduler_output.scheduled
        self.runner.copy_states([(item.restore_slot, item.state_slot) for item in items if item.restore_slot >= 0])
        model_output = self.runner.execute(scheduler_output, pending)
        self.runner.copy_states([(item.state_slot, item.save_slot) for item in items if item.save_slot >= 0])
        self._record_prompt_logprobs(model_output)
        rows, deferrable = self.sequences.sample_rows(scheduler_output.scheduled, model_output.sample_rows)
        logits = take_rows(model_output.logits, [row.logits_row for row in rows]) if rows else None
        return self._sample_on_device(rows, logits, deferrable and not model_output.prompt_rows)

    def _sample_on_device(self, rows: list[SequenceRecord], logits: torch.Tensor | None, deferrable: bool,
                          wait: bool = False) -> LaunchedStep:
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
            state_of = self.sequences.state_of
            rows, logits = self.structured.hold(rows, logits, state_of, failures)
            rows, logits = self.structured.release(rows, logits, state_of, self.sequences.held_row, failures, wait)
        if not rows:
            return LaunchedStep([], None, None, set(), failures, deferred=False)
        assert logits is not None, "rows to sample come with their logits"
        bitmask, restricted = None, set()
        if not plain:
            bitmask, restricted = self.structured.bitmask(rows, rows)
        sampled = self.sampler(logits, rows, bitmask)
        deferred = (self.async_scheduling and deferrable and len(rows) == num_rows and not failures
                    and bitmask is None)
        if deferred:
            for row in rows:
                row.sequence.num_pending_tokens += 1
        return LaunchedStep(rows, sampled, bitmask, restricted, failures, deferred)

    def _process(self, launched: LaunchedStep) -> None:
        """Append each row's sampled token (waiting for the device to have sampled
        them), decide which sequences stop, and queue the outputs of finished requests.
        A request whose grammar fails to compile, or whose sampled token its grammar
        rejects, is aborted and a StructuredOutputError raised after the others' tokens
        are appended (their finished outputs come from the next step)."""
        failures = launched.failures
        finished_states = []
        sampled = launched.sampled
        if launched.rows:
            assert sampled is not None, "a step with rows has sampled them"
            token_ids = sampled.host_token_ids()
            forbidden = forbidden_picks(launched.bitmask, launched.restricted, token_ids)
            deferred = launched.deferred
            append_plain, append_token = self.output_processor.append_plain, self.output_processor.append_token
            rows = zip(launched.rows, token_ids, sampled.logprobs)
            for i, (sample, token_id, logprobs) in enumerate(rows):
                sequence = sample.sequence
                if deferred:
                    sequence.num_pending_tokens -= 1
                if sequence.status.is_finished:
                    continue  # stopped or aborted before this token: it is discarded
                try:
                    if i in forbidden:
                        raise StructuredOutputError(
                            f"request {sample.owner.request_id!r}: no token satisfies both its structured output "
                            "(or reasoning budget) and its other sampling constraints (allowed_token_ids, "
                            "bad_words, logit_bias, min_tokens)")
                    status = (append_plain(sample, token_id) if sample.traits.plain_output
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
            for request_id in failures:
                self.duplicates.drop(request_id)  # its duplicates fail with it
            self.abort_request(list(failures))
            raise next(iter(failures.values()))

    def _take_finished_outputs(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        return self.duplicates.fan_out(outputs)

    def _copy_forked(self, parent: Request, children: list[Request]) -> None:
        """Schedule forked samples beside ``parent``, sharing its computed prompt: its KV
        blocks (copied where a child will write into a shared one) and its recurrent
        state."""
        copies = [self.scheduler.fork_request(parent, child) for child in children]
        self.runner.copy_blocks([pair for pair in copies if pair is not None], self.scheduler.take_group_copies())
        parent_slot = self.scheduler.state_slot(parent.request_id)
        if parent_slot is not None:
            child_slots = [self.scheduler.state_slot(child.request_id) for child in children]
            self.runner.copy_states([(parent_slot, slot) for slot in child_slots if slot is not None])

    def _record_prompt_logprobs(self, model_output: ModelOutput) -> None:
        for request_id, (first_row, num_rows, position) in model_output.prompt_rows.items():
            state = self.sequences.state_of(request_id)
            prompt = state.prompt_token_ids
            logprobs = torch.log_softmax(model_output.logits[first_row : first_row + num_rows].double(), dim=-1)
            targets = torch.tensor(prompt[position + 1 : position + 1 + num_rows], device=logprobs.device)
            num_top = state.params.prompt_logprobs
            assert num_top is not None, f"prompt rows of {request_id!r}, which asks for no prompt logprobs"
            # Every row asks (num_top is set), so no entry is None.
            entries = [entry for entry in gather_logprobs(logprobs, targets, [num_top] * num_rows)
                       if entry is not None]
            self.output_processor.record_prompt_logprobs(state, position, entries)

    def _finish(self, state: RequestState) -> RequestOutput:
        self.sequences.remove(state.request_id)
        num_cached = max(state.samples[0].sequence.num_cached_tokens, 0)
        return self.output_processor.make_output(state, num_cached)
