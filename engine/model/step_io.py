"""What one step of the model runner takes and gives: the packed forward's keyword
arguments, the logits rows it keeps (for sampling and prompt logprobs) and its output,
a step's sampled tokens not yet processed, a launched step waiting for them (async
scheduling), and the other tensor-parallel ranks as the runner drives them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypedDict, TypeVar

import numpy as np
import torch

from ..attention.context import AttentionContext
from ..core.scheduler import ScheduledRequest
from ..multimodal.qwen_vl import DeepstackRows
from ..recurrent.state import RecurrentStep
from ..sampling.sampler import SamplerOutput
from ..sampling.sequences import SequenceRecord
from ..sampling.structured import StructuredOutputError
from .input_batch import PackedBatch


def to_device(values: np.ndarray | list[int], device: torch.device) -> torch.Tensor:
    """Host int64 values as a tensor on ``device``, without waiting for queued work."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


class _RequiredModelInputs(TypedDict):
    position_ids: torch.Tensor  # [1, T]; [3, 1, T] for M-RoPE models
    shardline_ctx: AttentionContext


class ModelInputs(_RequiredModelInputs, total=False):
    """The keyword arguments of one packed forward (besides use_cache and logits_to_keep):
    ``input_ids``, or ``inputs_embeds`` where a step fills image placeholders."""

    input_ids: torch.Tensor  # [1, T]
    inputs_embeds: torch.Tensor  # [1, T, hidden]
    shardline_state: RecurrentStep  # models with recurrent layers only
    shardline_deepstack: DeepstackRows  # Qwen3-VL steps that fill images (DEEPSTACK_KEY)


_T = TypeVar("_T")


class RankFollowers(Protocol):
    """The other ranks of a tensor-parallel engine, as rank 0's runner drives them: each
    runs every step's forward on its shard (its inputs sent once) and the same cache
    copies on its own caches."""

    def run_step(self, model_inputs: ModelInputs, keep: torch.Tensor | int, forward: Callable[[], _T]) -> _T:
        """Send the step's inputs to every other rank, then run this rank's ``forward``
        beside theirs; return its output."""
        ...

    def mirror(self, method: str, *args: Any) -> None:
        """Call the runner's ``method`` with ``args`` on every other rank."""
        ...

    def close(self) -> None:
        """Stop the other ranks."""
        ...


@dataclass
class PendingTokens:
    """The sampled token ids of a step whose outputs are not processed yet (async
    scheduling): ``token_ids`` [N] on the device, and each sequence's row in it."""

    token_ids: torch.Tensor
    rows: dict[str, int]


class PromptRows(NamedTuple):
    """One request's prompt-logprob rows among a step's kept logits: ``num_rows`` rows
    from row ``first_row``, the first of them the logits at prompt ``position``."""

    first_row: int
    num_rows: int
    position: int


@dataclass
class LogitsPlan:
    """Packed positions whose logits the step needs, in the order they are kept.

    A request reaching the end of its tokens needs its last position (to sample);
    a request asking for prompt logprobs needs every prompt position of its chunk
    except the last prompt token (whose logits are the sampling row).
    """

    keep: list[int] = field(default_factory=list)
    # request_id -> row in the kept logits to sample from.
    sample_rows: dict[str, int] = field(default_factory=dict)
    # request_id -> its prompt-logprob rows.
    prompt_rows: dict[str, PromptRows] = field(default_factory=dict)

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest], packed: PackedBatch) -> LogitsPlan:
        """The plan of a step laid out as ``packed``."""
        plan = cls()
        ends = packed.query_start_loc[1:]
        if not packed.any_prompt_logprobs:
            # Each request reaching its last token keeps its last position; the rows in
            # step order.
            last_chunks = packed.last_chunks
            if len(last_chunks) == len(scheduled):
                plan.keep = (ends - 1).tolist()
                plan.sample_rows = dict(zip(packed.request_ids, range(len(scheduled))))
            elif last_chunks:
                plan.keep = (ends[last_chunks] - 1).tolist()
                ids = packed.request_ids
                plan.sample_rows = {ids[index]: row for row, index in enumerate(last_chunks)}
            return plan
        starts = packed.query_start_loc.tolist()
        for index, item in enumerate(scheduled):
            plan.add(item, starts[index])
        return plan

    def add(self, item: ScheduledRequest, offset: int) -> None:
        request = item.request
        start, end = item.start, item.start + item.num_new_tokens
        params = request.params
        if getattr(params, "prompt_logprobs", None) is not None and start < request.num_prompt_tokens - 1:
            stop = min(end, request.num_prompt_tokens - 1)
            self.prompt_rows[request.request_id] = PromptRows(len(self.keep), stop - start, start)
            self.keep += range(offset, offset + stop - start)
        if item.is_last_chunk:
            self.sample_rows[request.request_id] = len(self.keep)
            self.keep.append(offset + item.num_new_tokens - 1)


@dataclass
class ModelOutput:
    """Logits of one step: [K, V] rows for the positions in the LogitsPlan."""

    logits: torch.Tensor
    sample_rows: dict[str, int]
    prompt_rows: dict[str, PromptRows]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued: its sample rows, the sampler's
    output (token ids still on the device), the structured-output bitmask and the
    rows it restricts, the failures found so far, and whether its outputs wait for
    the next step (``deferred``: each row's sequence then has one pending token)."""

    rows: list[SequenceRecord]
    sampled: SamplerOutput | None
    bitmask: torch.Tensor | None
    restricted: set[int]
    failures: dict[str, StructuredOutputError]
    deferred: bool

    def pending_tokens(self) -> PendingTokens | None:
        """The runner's view of the sampled ids the next step reads, if deferred."""
        if not self.deferred:
            return None
        assert self.sampled is not None, "a deferred step has sampled its rows"
        return PendingTokens(self.sampled.token_ids, {row.sequence.request_id: i for i, row in enumerate(self.rows)})


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]; the common case (every row once, in order) without a copy, and
    otherwise without a blocking host-to-device copy of the index."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))
