"""The offline API, mirroring vLLM's ``LLM`` class.

Prompts are rendered one at a time and added to the engine as soon as each is
ready (render one, add one); once a full batch is waiting, the engine starts
stepping while the rest are still being rendered. If adding any request fails,
every request this call already added is aborted before the error propagates, so
the engine is left clean for the next call. Outputs come back sorted by request
id, which is input order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from .config import EngineConfig
from .inputs.call_args import (
    ProgressBar,
    keep_special_tokens,
    offer_tools,
    per_item_values,
    prompt_list,
)
from .inputs.chat import ChatOptions, ChatRenderError, is_conversation, keeps_special_tokens, render_chat
from .inputs.prompts import PromptType
from .llm_engine import LLMEngine
from .lora.request import LoRARequest, resolve_lora_request
from .multimodal.inputs import ProcessedPrompt
from .multimodal.loading import chat_part_image
from .multimodal.processor import MultimodalProcessor
from .outputs import EmbeddingRequestOutput, EngineStats, PoolingRequestOutput, RequestOutput
from .params import PoolingParams, PoolingTask, SamplingParams
from .pooling.engine import (
    PoolingEngine,
    TaskMismatchError,
    as_pooling_output,
    pooling_params_for,
    wants_pooling_engine,
)

# Image prompts are prepared (decoded, preprocessed) on this many worker threads, at
# most this many ahead of the engine.
PREPROCESS_WORKERS = 2
PREPROCESS_WINDOW = 16


class Engine(Protocol):
    """What LLM asks of an engine: the interface both the generation and the pooling
    engine implement, so LLM drives either without reaching into its internals (and the
    pipeline's shard runner steps it the same way). Requests are identified by the
    caller's ids."""

    # "generate" or "embed": what LLM may ask of this engine.
    task: str
    tokenizer: Any

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None,
                    priority: int = 0) -> None:
        """Queue a request; raises ValueError naming it if it can never run."""

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; unknown ids are ignored."""

    def abort_all(self) -> None:
        """Drop every unfinished request."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def has_capacity(self) -> bool:
        """Whether adding more requests before the next step still pays (the engine
        holds less than two steps' worth of sequences)."""
        ...

    def step(self) -> Sequence[RequestOutput | EmbeddingRequestOutput | PoolingRequestOutput]:
        """Run one iteration; return the outputs of requests that finished in it."""
        ...

    def stats(self) -> EngineStats:
        """Its load now: requests running and waiting, cache use, preemptions (health lines)."""
        ...

    def close(self) -> None:
        """Abort everything and release what the engine holds besides memory (threads)."""


class LLM:
    """An offline LLM over shardline's engine: ``LLM(model, **engine_options)``.

    ``engine_options`` are the fields of ``EngineConfig`` (vLLM's names: dtype,
    device, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    enable_prefix_caching, kv_cache_memory_bytes, gpu_memory_utilization, seed,
    trust_remote_code, tokenizer, revision, ...).
    """

    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine_config = EngineConfig.from_kwargs(model, **engine_options)
        engine_class = PoolingEngine if wants_pooling_engine(self.engine_config) else LLMEngine
        self.llm_engine: Engine = engine_class(self.engine_config)
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def close(self) -> None:
        """Abort anything in flight and drop the model and its KV cache."""
        engine = self.__dict__.pop("llm_engine", None)
        if engine is not None:
            engine.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache``: later
        prompts compute them again (benchmarks that repeat a workload call it between
        runs). Blocks of running requests keep their contents."""
        self._require_generation("LLM.reset_prefix_cache").reset_prefix_cache()
        return True

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Iterable[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; one RequestOutput per prompt, in input order."""
        self._require_generation("LLM.generate")
        return self._run(prompt_list(prompts), lambda prompt: prompt, sampling_params, use_tqdm, lora_request,
                         priority)

    def _require_generation(self, method: str) -> LLMEngine:
        """The generation engine; TaskMismatchError naming ``method`` on an embedding one."""
        engine = self.llm_engine
        if engine.task != "generate":
            raise TaskMismatchError(
                f"{method} needs a generative model, but {self.engine_config.model!r} was loaded as an "
                f"embedding model (task={self.engine_config.task!r}); use LLM.embed or LLM.encode"
            )
        assert isinstance(engine, LLMEngine), f"a {type(engine).__name__} has task 'generate'"
        return engine

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any] | Callable[..., Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the
        tokenizer's chat template (or ``chat_template``)."""
        engine = self._require_generation("LLM.chat")
        options = ChatOptions(chat_template, chat_template_content_format, add_generation_prompt,
                              continue_final_message, tools, chat_template_kwargs or {})
        conversations = [messages] if is_conversation(messages) else list(messages)
        if keeps_special_tokens(self.get_tokenizer(), options):
            sampling_params = keep_special_tokens(sampling_params)
        if tools and engine.tool_parser is not None:
            sampling_params = offer_tools(sampling_params, tools)
        render = lambda item: self._render_indexed(item, options)  # noqa: E731
        return self._run(list(enumerate(conversations)), render, sampling_params, use_tqdm, lora_request, None)

    def render_chat(self, conversation: list[dict], **chat_options: Any) -> list[int]:
        """Token ids of one conversation rendered as ``chat`` would render it."""
        return render_chat(self.get_tokenizer(), conversation, ChatOptions(**chat_options))

    def render_chat_prompt(self, conversation: list[dict], **chat_options: Any) -> PromptType:
        """One conversation as the prompt ``chat`` would add: {"prompt_token_ids": ...}, with
        its images decoded in "multi_modal_data" on a vision-language model (the pipeline
        adds it as a generate prompt)."""
        return self._render_indexed((0, conversation), ChatOptions(**chat_options))

    def _render_indexed(self, item: tuple[int, list[dict]], options: ChatOptions) -> PromptType:
        index, conversation = item
        multimodal = self._multimodal()
        media: list[dict] | None = [] if multimodal is not None else None
        try:
            token_ids = render_chat(self.get_tokenizer(), conversation, options, media)
        except ChatRenderError as exc:
            raise ChatRenderError(f"conversation {index}: {exc}") from exc
        if not media:
            return {"prompt_token_ids": token_ids}
        assert multimodal is not None, "media parts are collected for a model that takes images only"
        where = f"conversation {index}"
        images = [chat_part_image(where, part, multimodal.media_options) for part in media]
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}}

    def _multimodal(self) -> MultimodalProcessor | None:
        engine = self.llm_engine
        return engine.multimodal if isinstance(engine, LLMEngine) else None

    def _run(self, items: Iterable[Any], render: Callable[[Any], PromptType], params: Any,
             use_tqdm: Any, lora_request: Any, priority: Any) -> list:
        """Render, add and run ``items``; return their final outputs in order."""
        items = list(items) if not isinstance(items, (Sequence, Iterator)) else items
        num_items = len(items) if isinstance(items, Sequence) else None
        per_item = per_item_values(num_items, params=params, lora_request=lora_request, priority=priority)
        if params is None:
            per_item["params"] = itertools.repeat(SamplingParams())
        added: list[str] = []
        outputs: dict[str, Any] = {}
        progress = ProgressBar(use_tqdm, num_items)
        prepared = self._prepared(items, render)
        try:
            for (request_id, prompt, ready), item_params, item_lora, item_priority in zip(
                prepared, per_item["params"], per_item["lora_request"], per_item["priority"]
            ):
                if self.engine_config.default_mm_loras:
                    item_lora = resolve_lora_request(prompt, item_lora, self.engine_config.default_mm_loras)
                self.llm_engine.add_request(request_id, ready, item_params, item_lora, item_priority or 0)
                added.append(request_id)
                if self._batch_is_full():
                    self._step_into(outputs, progress)
        except BaseException:
            prepared.close()  # cancels prompts still being prepared
            self.llm_engine.abort_request(added)
            progress.close()
            raise
        progress.set_total(len(added))
        try:
            wanted = set(added)
            while not wanted.issubset(outputs) and self.llm_engine.has_unfinished_requests():
                self._step_into(outputs, progress)
        except BaseException:
            self.llm_engine.abort_request([r for r in added if r not in outputs])
            raise
        finally:
            progress.close()
        missing = [request_id for request_id in added if request_id not in outputs]
        if missing:  # the engine lost requests: an engine bug, never a silently shorter result
            raise RuntimeError(f"the engine finished without an output for requests {missing[:10]} "
                               f"({len(missing)} of {len(added)})")
        return [outputs[request_id] for request_id in sorted(added, key=int)]

    def _prepared(self, items: Iterable[Any], render: Callable[[Any], PromptType]) \
            -> Generator[tuple[str, PromptType, PromptType | ProcessedPrompt]]:
        """(request id, rendered prompt, prompt ready for add_request) per item, in order.
        A vision-language model's items are rendered and run through its processor
        (image decoding and preprocessing) on a small worker pool, up to
        PREPROCESS_WINDOW items ahead of the engine, so the step loop is not held up by
        them; a text model's are rendered here, one at a time."""
        engine = self.llm_engine
        if not isinstance(engine, LLMEngine) or engine.multimodal is None:
            for item in items:
                request_id = str(next(self.request_counter))
                prompt = render(item)
                yield request_id, prompt, prompt
            return

        def prepare(request_id: str, item: Any) -> tuple[PromptType, PromptType | ProcessedPrompt]:
            prompt = render(item)
            return prompt, engine.preprocess(request_id, prompt)

        window: deque[tuple[str, Future]] = deque()
        with ThreadPoolExecutor(PREPROCESS_WORKERS, thread_name_prefix="shardline-preprocess") as pool:
            try:
                for item in items:
                    request_id = str(next(self.request_counter))
                    window.append((request_id, pool.submit(prepare, request_id, item)))
                    if len(window) >= PREPROCESS_WINDOW:
                        request_id, future = window.popleft()
                        yield request_id, *future.result()
                while window:
                    request_id, future = window.popleft()
                    yield request_id, *future.result()
            finally:
                for _, future in window:
                    future.cancel()

    def _batch_is_full(self) -> bool:
        return not self.llm_engine.has_capacity()

    def _step_into(self, outputs: dict[str, Any], progress: ProgressBar) -> None:
        for output in self.llm_engine.step():
            outputs[output.request_id] = output
            progress.update(output)

    # --------------------------------------------------------------- embeddings
    def embed(
        self,
        prompts: PromptType | Iterable[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed each prompt with the model's pooling; one EmbeddingRequestOutput per
        prompt, in input order. Needs an embedding engine (see ``task``)."""
        return self._pool("LLM.embed", prompts, pooling_params, PoolingTask.EMBED, use_tqdm, lora_request,
                          truncate_prompt_tokens, priority)

    def encode(
        self,
        prompts: PromptType | Iterable[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str = "encode",
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt; ``outputs.data`` is a float32 tensor: for pooling_task
        "encode" the last hidden state of every prompt token [num_tokens, hidden]
        (raw unless normalize=True), for "embed" the pooled embedding [hidden]."""
        try:
            task = PoolingTask(pooling_task)
        except ValueError:
            raise ValueError(f"pooling_task must be one of {', '.join(t.value for t in PoolingTask)}; "
                             f"got {pooling_task!r}") from None
        outputs = self._pool("LLM.encode", prompts, pooling_params, task, use_tqdm, lora_request,
                             truncate_prompt_tokens, priority)
        return [as_pooling_output(output) for output in outputs]

    def _pool(self, method: str, prompts: Any, pooling_params: Any, task: PoolingTask, use_tqdm: Any,
              lora_request: Any, truncate_prompt_tokens: int | None, priority: Any) -> list:
        if self.llm_engine.task != "embed":
            raise TaskMismatchError(
                f"{method} needs an embedding model, but {self.engine_config.model!r} was loaded for "
                f"generation (task={self.engine_config.task!r}); load it with task='embed'"
            )
        params = pooling_params_for(pooling_params, task, truncate_prompt_tokens)
        return self._run(prompt_list(prompts), lambda prompt: prompt, params, use_tqdm, lora_request, priority)
