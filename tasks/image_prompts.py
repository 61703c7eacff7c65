"""Engine prompts of rows with images, prepared off the engine's driver thread.

A row's decoded images (tasks/image_feed.py) make its prompt what ``LLM.generate`` and
``LLM.chat`` would build: a prompt row ``{"prompt", "multi_modal_data"}``, a chat row
``LLM.render_chat_prompt``'s (its chat template's token ids with each ``image_pil``
part as the model's image placeholder, and the images in order). A vision-language
model's processor then runs on it (``LLMEngine.preprocess``) on the thread that hands
the shard to the runner, so preprocessing images never holds up the engine's steps;
the driver only adds the prepared prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .executor import RowRequest

if TYPE_CHECKING:
    from shardline import LLM
    from shardline.engine.inputs.prompts import PromptType
    from shardline.engine.multimodal.inputs import ProcessedPrompt

    Prepared = PromptType | ProcessedPrompt | ValueError


def has_images(row: RowRequest) -> bool:
    """Whether ``row`` carries decoded images (its prompt's or its chat's)."""
    return row.multi_modal_data is not None or any(
        isinstance(part, dict) and part.get("type") == "image_pil"
        for message in row.messages or [] for part in _parts(message))


def image_prompt(llm: LLM, row: RowRequest) -> PromptType:
    """The engine prompt of a row with images (``has_images``)."""
    if row.messages is None:
        assert row.prompt is not None, f"row {row.index} has neither a prompt nor messages"
        return {"prompt": row.prompt, "multi_modal_data": row.multi_modal_data or {}}
    # LLM.chat's own rendering: a model that takes no images refuses the image parts by name.
    return llm.render_chat_prompt(row.messages, **(row.chat_options or {}))


def prepare_image_rows(llm: LLM, rows: list[RowRequest], request_prefix: str) -> dict[int, Prepared]:
    """Each image row's prompt (by position in ``rows``), through the model's processor when
    it takes images; a row that cannot be used keeps its ValueError, raised when it is added
    (an error row). Runs on the caller's thread: the processor is only read."""
    # Here, not at the top: the engine's modules (torch, transformers) load in the engine's
    # process only, never in a process that only hands shards to an engine service.
    from shardline.engine.llm_engine import LLMEngine

    engine = llm.llm_engine
    prepared: dict[int, Prepared] = {}
    for position, row in enumerate(rows):
        if not has_images(row):
            continue
        request_id = f"{request_prefix}:{row.index}"
        try:
            prompt = image_prompt(llm, row)
            prepared[position] = engine.preprocess(request_id, prompt) if isinstance(engine, LLMEngine) else prompt
        except ValueError as exc:  # the template, the processor or the verdict on the images refused it
            prepared[position] = exc
    return prepared


def _parts(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []
