"""The engine for embedding models: add_request / abort_request / step, like LLMEngine.

An embedding needs one forward over the whole prompt and no KV cache, so there is
no continuous batching here: each step packs waiting prompts (priority order, then
arrival) into one sequence of T tokens, runs the base model (no LM head) once on it
with per-sequence position ids and packed attention, pools each sequence's hidden
states and returns every request of the batch finished.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from ..config import EngineConfig
from ..inputs.prompts import PromptType, tokenize_prompt
from ..model.loader import LoadedModel, load_hf_config
from ..model.runner import model_max_len
from ..multimodal.media import check_prompt_keys, prompt_media, refuse_image_options, refuse_media
from ..outputs import EmbeddingOutput, EmbeddingRequestOutput, EngineStats, PoolingOutput, PoolingRequestOutput
from ..parallel.ranks import RankDriver
from ..params import PoolingParams, PoolingTask
from ..parts.build import resolve_for_device, resolve_max_model_len
from .pooler import (
    PoolerConfig,
    at_least_float32,
    finish_embedding,
    is_causal_config,
    pool,
    read_pooler_config,
    resolve_dimensions,
)
from .ranks import PackedBatch, load_base_model, packed_forward, start_pooling_ranks, takes_token_type_ids

logger = logging.getLogger(__name__)

# Architecture name endings of checkpoints that generate (vLLM's "generate" runner).
_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


class TaskMismatchError(ValueError):
    """A generation call on an embedding engine, or an embedding call on a generation engine."""


def wants_pooling_engine(config: EngineConfig) -> bool:
    """task "embed" pools; "generate" generates; "auto" pools unless the checkpoint's
    ``architectures`` name a causal-LM class (a config without them generates)."""
    if config.task != "auto":
        return config.task == "embed"
    architectures = getattr(load_hf_config(config), "architectures", None) or []
    return bool(architectures) and not any(a.endswith(_GENERATIVE_SUFFIXES) for a in architectures)


@dataclass(eq=False)
class PoolingRequest:
    """One prompt waiting to be embedded, its options resolved against the model."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    task: PoolingTask
    dimensions: int
    normalize: bool
    priority: int
    arrival_index: int


class PoolingScheduler:
    """Waiting prompts in (priority, arrival) order.

    Invariant: a step takes the longest prefix of that order that fits max_num_seqs
    and max_num_batched_tokens, never skipping ahead, so a lower priority never
    delays a higher one; the head always fits (a prompt longer than the token
    budget but within max_model_len runs alone).
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Heap of (priority, arrival_index, request); aborted entries are skipped
        # lazily when they reach the top (``_waiting`` no longer holds them).
        self._heap: list[tuple[int, int, PoolingRequest]] = []
        self._waiting: dict[str, PoolingRequest] = {}

    def add(self, request: PoolingRequest) -> None:
        self._waiting[request.request_id] = request
        heapq.heappush(self._heap, (request.priority, request.arrival_index, request))

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def get_num_unfinished_requests(self) -> int:
        return len(self._waiting)

    def schedule(self) -> list[PoolingRequest]:
        """Remove and return the next batch."""
        batch: list[PoolingRequest] = []
        num_tokens = 0
        while self._heap and len(batch) < self.max_num_seqs:
            request = self._heap[0][2]
            if self._waiting.get(request.request_id) is not request:
                heapq.heappop(self._heap)
                continue
            if batch and num_tokens + len(request.prompt_token_ids) > self.max_num_batched_tokens:
                break
            heapq.heappop(self._heap)
            del self._waiting[request.request_id]
            batch.append(request)
            num_tokens += len(request.prompt_token_ids)
        return batch


class PoolingEngine:
    """Embeds prompts with an encoder or decoder base model; driven by ``step()`` (an
    llm.Engine)."""

    task = "embed"

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        refuse_image_options(config, f"the embedding engine of {config.model!r} takes no images")
        # With tensor_parallel_size > 1 this process is rank 0 of the split model (ranks.py).
        self.followers: RankDriver | None = None
        if loaded is None and config.tensor_parallel_size > 1:
            self.followers, loaded = start_pooling_ranks(config)
        loaded = loaded or load_base_model(config)
        self.config = config = resolve_for_device(config, loaded.device)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.device = loaded.device
        text_config = self.hf_config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)
        self.pooler_config: PoolerConfig = read_pooler_config(
            config.model, is_causal_config(self.hf_config), config.revision
        )
        self.position_offset = _position_offset(self.model)
        self.max_model_len = resolve_pooling_max_len(config, self.hf_config, self.pooler_config, self.position_offset)
        self._takes_token_type_ids = takes_token_type_ids(self.model)
        token_budget = config.max_num_batched_tokens
        assert token_budget is not None, "resolve_for_device fills in the token budget"
        self.scheduler = PoolingScheduler(config.max_num_seqs, token_budget)
        self._states: dict[str, PoolingRequest] = {}
        self._arrivals = itertools.count()

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                    lora_request: Any = None, priority: int = 0) -> None:
        """Tokenize ``prompt`` and queue it. Raises ValueError (naming the request)
        if it can never run; nothing is queued then.

        ``params.task`` (vLLM's field; absent or None means "embed") picks a pooled
        vector ("embed") or one vector per prompt token ("encode")."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, PoolingParams):
            raise TaskMismatchError(
                f"request {request_id!r}: {self.config.model!r} runs as an embedding model, so it takes "
                f"PoolingParams (LLM.embed / LLM.encode), got {type(params).__name__}; load it with "
                "task='generate' to generate"
            )
        if lora_request is not None:
            raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request!r}, "
                             "but embedding models run without LoRA")
        task = _resolve_task(request_id, params.task)
        # The same validation as LLMEngine: both engines accept and reject the same prompts.
        check_prompt_keys(request_id, prompt)
        refuse_media(request_id, prompt_media(request_id, prompt), self.config.model)
        text, token_ids = tokenize_prompt(self.tokenizer, self.vocab_size, prompt)
        token_ids = self._truncate(request_id, token_ids, params.truncate_prompt_tokens)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}; shorten it or set truncate_prompt_tokens"
            )
        default_normalize = self.pooler_config.normalize if task is PoolingTask.EMBED else False
        request = PoolingRequest(
            request_id, text, token_ids, task,
            dimensions=resolve_dimensions(params, self.hidden_size, request_id),
            normalize=default_normalize if params.normalize is None else params.normalize,
            priority=priority, arrival_index=next(self._arrivals),
        )
        self.scheduler.add(request)
        self._states[request_id] = request

    def _truncate(self, request_id: str, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last ``keep`` tokens; -1 means max_model_len."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: truncate_prompt_tokens={keep} exceeds max_model_len={self.max_model_len}"
            )
        return token_ids[-keep:]

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop waiting requests; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            if self._states.pop(request_id, None) is not None:
                self.scheduler.abort(request_id)

    def abort_all(self) -> None:
        self.abort_request(list(self._states))

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def has_capacity(self) -> bool:
        return len(self._states) < 2 * self.config.max_num_seqs

    def stats(self) -> EngineStats:
        """Prompts waiting for a step (see llm.Engine); a pooling step holds no cache."""
        return EngineStats(num_running=0, num_waiting=len(self._states))

    def close(self) -> None:
        self.abort_all()
        if self.followers is not None:
            self.followers.close()

    # --------------------------------------------------------------------- step
    def step(self) -> list[EmbeddingRequestOutput | PoolingRequestOutput]:
        """Embed the next packed batch; return its outputs (every request in it finishes)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            hidden, cu_seqlens = self._forward(batch)
        except BaseException:
            for request in batch:  # still unfinished: a retry or an abort finds them waiting
                self.scheduler.add(request)
            raise
        return self._make_outputs(batch, hidden, cu_seqlens)

    @torch.inference_mode()
    def _forward(self, batch: list[PoolingRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the packed batch. Returns (last hidden states [T, H], cu_seqlens [B+1])."""
        seq_lens = tuple(len(r.prompt_token_ids) for r in batch)
        packed = PackedBatch(tuple(t for r in batch for t in r.prompt_token_ids),
                             tuple(self.position_offset + p for n in seq_lens for p in range(n)), seq_lens)
        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            return packed_forward(self.model, packed, self.device, self._takes_token_type_ids)

        if self.followers is None:
            return forward()
        return self.followers.run_mirrored("pool_forward", (packed,), forward)  # the ranks' shards beside this one

    @torch.inference_mode()
    def _make_outputs(self, batch: list[PoolingRequest], hidden: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> list[EmbeddingRequestOutput | PoolingRequestOutput]:
        pooled = pool(hidden, cu_seqlens, self.pooler_config.pooling_type).cpu()  # [B, H]
        offsets = cu_seqlens.tolist()
        outputs: list[EmbeddingRequestOutput | PoolingRequestOutput] = []
        for index, request in enumerate(batch):
            self._states.pop(request.request_id, None)
            if request.task is PoolingTask.EMBED:
                vector = finish_embedding(pooled[index], request.dimensions, request.normalize)
                outputs.append(EmbeddingRequestOutput(
                    request.request_id, request.prompt_token_ids, EmbeddingOutput(vector.tolist()),
                    prompt=request.prompt,
                ))
            else:
                tokens = at_least_float32(hidden[offsets[index]:offsets[index + 1]]).cpu()  # [n, H]
                data = finish_embedding(tokens, request.dimensions, request.normalize)
                outputs.append(PoolingRequestOutput(
                    request.request_id, request.prompt_token_ids, PoolingOutput(data), prompt=request.prompt,
                ))
        return outputs


def _resolve_task(request_id: str, task: Any) -> PoolingTask:
    if task is None:
        return PoolingTask.EMBED
    try:
        return PoolingTask(task)
    except ValueError:
        raise ValueError(
            f"request {request_id!r}: pooling task {task!r} is not supported; use one of "
            f"{', '.join(t.value for t in PoolingTask)}"
        ) from None


def _position_offset(model: torch.nn.Module) -> int:
    """RoBERTa-family embeddings number positions from padding_idx + 1, not 0."""
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return int(embeddings.padding_idx) + 1
    return 0


def resolve_pooling_max_len(config: EngineConfig, hf_config: transformers.PretrainedConfig,
                            pooler_config: PoolerConfig, position_offset: int) -> int:
    """The model's limit (position embeddings, capped like vLLM by sentence-transformers'
    max_seq_length), or the user's max_model_len if within it."""
    limit = model_max_len(hf_config) - position_offset
    if pooler_config.max_seq_length is not None:
        limit = min(limit, pooler_config.max_seq_length)
    return resolve_max_model_len(config, limit)


# ------------------------------------------------------------- LLM API helpers
def pooling_params_for(params: PoolingParams | Any, task: PoolingTask,
                       truncate_prompt_tokens: int | None) -> PoolingParams | list[PoolingParams]:
    """Copies of ``params`` (one, or a sequence; None means defaults) carrying the
    pooling task (vLLM's ``PoolingParams.task``) and the call's truncate_prompt_tokens."""
    if truncate_prompt_tokens is not None:
        PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)  # validates it
    if isinstance(params, (list, tuple)):
        return [_pooling_params_one(p, task, truncate_prompt_tokens) for p in params]
    return _pooling_params_one(params, task, truncate_prompt_tokens)


def _pooling_params_one(params: object, task: PoolingTask,
                        truncate_prompt_tokens: int | None) -> PoolingParams:
    """pooling_params_for of one entry: a copy of ``params`` (None: defaults)."""
    if params is None:
        params = PoolingParams()
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    params = params.clone()
    params.task = task.value
    if truncate_prompt_tokens is not None:
        params.truncate_prompt_tokens = truncate_prompt_tokens
    return params


def as_pooling_output(output: EmbeddingRequestOutput | PoolingRequestOutput) -> PoolingRequestOutput:
    """``LLM.encode`` returns PoolingRequestOutput for every task: a pooled embedding
    becomes its vector as a float32 tensor."""
    if isinstance(output, PoolingRequestOutput):
        return output
    data = torch.tensor(output.outputs.embedding, dtype=torch.float32)
    return PoolingRequestOutput(output.request_id, output.prompt_token_ids, PoolingOutput(data),
                                output.finished, output.prompt)
