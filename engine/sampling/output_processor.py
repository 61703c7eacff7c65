"""Per-request bookkeeping between steps: appending sampled tokens, detokenizing,
deciding when a sequence stops, and assembling the final RequestOutput.

A request with n > 1 is tracked as one RequestState over n sample sequences (their
SequenceRecords, sequences.py); its output is produced once every sample has finished.

With a reasoning parser, each sampled token is first classified (reasoning, answer
or think tag): reasoning tokens are detokenized into ``reasoning_text``, answer
tokens into ``text``; stop strings and the structured-output grammar see the answer
only.

Text is read per step only by stop strings and the reasoning split; any other
sample keeps its tokens and is detokenized when its request finishes, by the same
incremental algorithm, so its text is what per-step detokenization gives. A "plain"
sample (no reasoning, grammar or logprobs) is appended by ``append_plain``: a list
append and its stop checks (stop token ids, EOS, max_tokens, max_model_len, and
with stop strings its text made and searched token by token).
"""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from ..core.request import Request, RequestStatus
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..params import SamplingParams
from ..tools import ToolCallOutput, ToolCallParser, read_tool_calls
from .detokenizer import IncrementalDetokenizer, TokenizerDecoding, find_stop_string
from .harmony import HarmonyParser
from .reasoning import Phase, ReasoningParser, TokenRole, answer_token_ids
from .sequences import RequestState, SequenceRecord
from .structured import StructuredOutputError


class OutputProcessor:
    """Applies sampled tokens to sequences and reports which ones stop."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int], max_model_len: int,
                 reasoning_parser: ReasoningParser | HarmonyParser | None = None,
                 tool_parser: ToolCallParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.decoding = TokenizerDecoding(tokenizer)

    def new_sample(self, state: RequestState, sequence: Request, index: int) -> SequenceRecord:
        """The record of ``state``'s sample ``index``, generated as ``sequence``."""
        params, traits = state.params, state.traits
        stop_strings, stop_token_ids = params.stop_lists()
        sample = SequenceRecord(sequence, index, state, params, traits, self._detokenizer(sequence, params),
                                text_at_finish=traits.text_at_finish, stop_token_ids=params.all_stop_token_ids,
                                stop_strings=stop_strings, requested_stop_token_ids=stop_token_ids,
                                logprobs=[] if traits.wants_logprobs else None)
        if self.reasoning_parser is not None:
            sample.reasoning = self.reasoning_parser.tracker(sequence.prompt_token_ids, params.max_reasoning_tokens)
            sample.reasoning_detokenizer = self._detokenizer(sequence, params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        sample.max_output_tokens = min(max_tokens, self.max_model_len - sequence.num_prompt_tokens)
        return sample

    def _detokenizer(self, sequence: Request, params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, sequence.prompt_token_ids, params.skip_special_tokens,
                                      params.spaces_between_special_tokens, self.decoding)

    def bad_words_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as written and after a space (how it
        appears mid-sentence), deduplicated."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False).input_ids
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def stop_token_ids(self, params: SamplingParams) -> set[int]:
        """Token ids that end a sequence under ``params`` (EOS unless ignored)."""
        ids = set(params.stop_lists()[1])
        return ids if params.ignore_eos else ids | self.eos_token_ids

    def append_token(self, state: RequestState, sample: SequenceRecord, token_id: int,
                     logprobs: tuple[float, list[tuple[int, float, int]]] | None) -> RequestStatus | None:
        """Append one sampled token; return the finished status if the sequence stops."""
        if sample.traits.plain_output:
            return self.append_plain(sample, token_id)
        if sample.reasoning is None and sample.grammar is None and logprobs is None:
            return self._append_answer_token(state, sample, token_id)
        sequence, params = sample.sequence, state.params
        sequence.append_output_token(token_id)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
        if logprobs is not None:
            self._record_logprobs(sample, logprobs)
        role = sample.reasoning.feed(token_id) if sample.reasoning is not None else TokenRole.ANSWER
        delta_len = 0
        if role is TokenRole.ANSWER:
            self._accept_by_grammar(state, sample, token_id)
            if sample.detokenizer is not None and not sample.text_at_finish:
                delta_len = len(sample.detokenizer.add_token(token_id))
                sample.text = sample.detokenizer.text
        elif role is TokenRole.REASONING and sample.reasoning_detokenizer is not None:
            sample.reasoning_detokenizer.add_token(token_id)
            sample.reasoning_text = sample.reasoning_detokenizer.text
        status = self._check_stop(sample, params, token_id, delta_len)
        if status is not None or (role is TokenRole.TAG and sample.reasoning is not None
                                  and sample.reasoning.phase is Phase.ANSWER):
            self._flush_reasoning(sample)
        # A stop string already cut the text; otherwise emit any held-back tail.
        if (status is not None and sample.detokenizer is not None and not sample.text_at_finish
                and not isinstance(sample.stop_reason, str)):
            sample.detokenizer.flush()
            sample.text = sample.detokenizer.text
        return status

    def append_plain(self, sample: SequenceRecord, token_id: int) -> RequestStatus | None:
        """append_token for a plain sample (``traits.plain_output``), the common case: the
        stop checks of ``_check_stop`` that apply to it, the text left to the finish.
        Reads the sample, its sequence and the request only where a check needs it."""
        sequence = sample.sequence
        sequence.append_output_token(token_id)
        num_output = sequence.num_output_tokens
        if num_output == 1 and sample.owner.metrics.first_token_time is None:
            sample.owner.metrics.first_token_time = time.monotonic()
        if not sample.text_at_finish:
            return self._append_plain_text(sample, token_id, num_output)
        if token_id in sample.stop_token_ids and num_output >= sample.owner.params.min_tokens:
            if sample.owner.params.ignore_eos or token_id not in self.eos_token_ids:
                sample.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= sample.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _append_plain_text(self, sample: SequenceRecord, token_id: int, num_output: int) -> RequestStatus | None:
        """append_plain for a sample with stop strings: its text made token by token and
        searched for them, in ``_check_stop``'s order."""
        detokenizer = sample.detokenizer
        # A plain sample whose text is made per step detokenizes (SamplingTraits.of).
        assert detokenizer is not None, "a sample with stop strings has a detokenizer"
        delta = detokenizer.add_token(token_id)
        sample.text = detokenizer.text
        params = sample.owner.params
        status = None
        if num_output >= params.min_tokens:
            if token_id in sample.stop_token_ids:
                if params.ignore_eos or token_id not in self.eos_token_ids:
                    sample.stop_reason = token_id
                status = RequestStatus.FINISHED_STOPPED
            elif delta:
                match = find_stop_string(sample.text, len(delta), sample.stop_strings)
                if match is not None:
                    stop_str, index = match
                    end = index + len(stop_str) if params.include_stop_str_in_output else index
                    sample.text = sample.text[:end]
                    sample.stop_reason = stop_str
                    return RequestStatus.FINISHED_STOPPED
        if status is None and num_output >= sample.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:  # no stop string cut the text: emit any held-back tail
            detokenizer.flush()
            sample.text = detokenizer.text
        return status

    def _append_answer_token(self, state: RequestState, sample: SequenceRecord, token_id: int) -> RequestStatus | None:
        """append_token for a sample that is not plain but has no reasoning, grammar
        (not yet) or logprobs for this token: every token is answer text and nothing
        else is recorded."""
        sample.sequence.append_output_token(token_id)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
        detokenizer = sample.detokenizer
        if detokenizer is None or sample.text_at_finish:
            return self._check_stop(sample, state.params, token_id, 0)
        delta_len = len(detokenizer.add_token(token_id))
        sample.text = detokenizer.text
        status = self._check_stop(sample, state.params, token_id, delta_len)
        if status is not None and not isinstance(sample.stop_reason, str):
            detokenizer.flush()
            sample.text = detokenizer.text
        return status

    def _accept_by_grammar(self, state: RequestState, sample: SequenceRecord, token_id: int) -> None:
        grammar = sample.grammar
        if grammar is None or grammar.is_terminated:
            return
        if not grammar.accept(token_id):
            raise StructuredOutputError(
                f"request {state.request_id!r}: sampled token {token_id} "
                f"({self.tokenizer.convert_ids_to_tokens(token_id)!r}) does not continue its {grammar.kind} "
                "constraint")

    @staticmethod
    def _flush_reasoning(sample: SequenceRecord) -> None:
        if sample.reasoning_detokenizer is not None:
            sample.reasoning_detokenizer.flush()
            sample.reasoning_text = sample.reasoning_detokenizer.text

    def _check_stop(self, sample: SequenceRecord, params: SamplingParams, token_id: int,
                    delta_len: int) -> RequestStatus | None:
        sequence = sample.sequence
        num_output = sequence.num_output_tokens
        if sample.grammar is not None and sample.grammar.is_terminated:
            # The grammar is complete and took its stop token: nothing can follow,
            # even under ignore_eos or before min_tokens.
            if token_id in sample.requested_stop_token_ids:
                sample.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sample.requested_stop_token_ids:
                sample.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if sample.stop_strings and delta_len:
                match = find_stop_string(sample.text, delta_len, sample.stop_strings)
                if match is not None:
                    stop_str, index = match
                    end = index + len(stop_str) if params.include_stop_str_in_output else index
                    sample.text = sample.text[:end]
                    sample.stop_reason = stop_str
                    return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if num_output >= max_tokens or sequence.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _record_logprobs(self, sample: SequenceRecord, logprobs: tuple[float, list[tuple[int, float, int]]]) -> None:
        sampled_logprob, entries = logprobs
        sample.cumulative_logprob += sampled_logprob
        if sample.logprobs is not None:
            position = {}
            for token_id, value, rank in entries:
                position[token_id] = Logprob(value, rank, self._token_text(token_id))
            sample.logprobs.append(position)

    def record_prompt_logprobs(self, state: RequestState, first_position: int,
                               entries: list[tuple[float, list[tuple[int, float, int]]]]) -> None:
        """Record the logprobs of prompt tokens first_position+1, ... (computed chunk
        by chunk; positions recomputed after a preemption are not recorded twice)."""
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]
        for offset, (_, position_entries) in enumerate(entries):
            if first_position + 1 + offset != len(state.prompt_logprobs):
                continue
            state.prompt_logprobs.append({
                token_id: Logprob(value, rank, self._token_text(token_id))
                for token_id, value, rank in position_entries
            })

    def _token_text(self, token_id: int) -> str:
        """One token's text, as logprob entries show it."""
        text = self.tokenizer.decode([token_id])
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    @staticmethod
    def _reasoning_of(sample: SequenceRecord, params: SamplingParams) -> str | None:
        """The reasoning text; None without a parser, without detokenization, or when
        the sample never reasoned."""
        tracker = sample.reasoning
        if tracker is None or not params.detokenize:
            return None
        return sample.reasoning_text if tracker.reasoned else None

    def _final_text(self, sample: SequenceRecord) -> str:
        """The sample's text; one made at the finish is detokenized now, over all its
        tokens, then its held-back tail emitted (no stop string cut it)."""
        detokenizer = sample.detokenizer
        if sample.text_at_finish and detokenizer is not None:
            detokenizer.add_tokens(sample.sequence.output_token_ids)
            detokenizer.flush()
            sample.text = detokenizer.text
            sample.text_at_finish = False  # made: a second output reads it as it is
        return sample.text

    def _tool_calls_of(self, state: RequestState, sample: SequenceRecord, text: str) -> ToolCallOutput | None:
        """The sample's answer read for tool calls, when its request set a tool_choice. The
        model's own format is read on the answer's tokens (harmony's parser reads every
        channel itself); forced calls on the answer text."""
        choice = state.params.tool_choice
        if choice is None:
            return None
        token_ids = list(sample.sequence.output_token_ids)
        if self.reasoning_parser is not None and not (self.tool_parser and self.tool_parser.name == "openai"):
            token_ids = answer_token_ids(self.reasoning_parser, state.prompt_token_ids, token_ids)
        return read_tool_calls(self.tool_parser, choice, token_ids, text)

    def make_output(self, state: RequestState, num_cached_tokens: int) -> RequestOutput:
        """The final RequestOutput of a request whose samples have all finished."""
        completions = []
        for sample in sorted(state.samples, key=lambda s: s.index):
            status = sample.sequence.status
            text = self._final_text(sample)
            completions.append(CompletionOutput(
                index=sample.index,
                text=text,
                token_ids=list(sample.sequence.output_token_ids),
                cumulative_logprob=sample.cumulative_logprob if state.params.logprobs is not None else None,
                logprobs=sample.logprobs,
                finish_reason=status.value if status.is_finished else None,
                stop_reason=sample.stop_reason,
                reasoning=self._reasoning_of(sample, state.params),
                num_reasoning_tokens=0 if sample.reasoning is None else sample.reasoning.num_reasoning_tokens,
                tool_calls=self._tool_calls_of(state, sample, text),
            ))
        state.metrics.finished_time = time.monotonic()
        state.metrics.num_preemptions = sum(s.sequence.num_preemptions for s in state.samples)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=num_cached_tokens,
            metrics=state.metrics,
            lora_request=state.lora_request,
        )
