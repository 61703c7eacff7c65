"""A model's processor without its video processor, for hosts without torchvision.

Some processors (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's: Qwen2VLProcessor,
Qwen2_5_VLProcessor, Qwen3VLProcessor) take a video processor, and transformers'
video processors import torchvision, which has no CPU wheel on every package index.
AutoProcessor then fails to build them. Images need only the image processor (the
PIL/numpy one where the torchvision one cannot import) and the tokenizer, so the
processor class is built with those two: ``image_only_class`` gives a subclass whose
constructor takes no video processor, and every image call runs the class's own code.
Videos stay refused by the engine (it takes images only). PixtralProcessor imports
torchvision itself: its image-only stand-in is engine/multimodal/pixtral.py.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import transformers
from transformers.utils.import_utils import is_torchvision_available

from .pixtral import PixtralImageProcessor, processor_settings

logger = logging.getLogger(__name__)


@functools.cache
def image_only_class(processor_class: type) -> type:
    """``processor_class`` with a constructor that takes no video processor (its
    attributes are then the image processor and the tokenizer). The subclass keeps the
    class's name, so a processor it saves names the class a checkpoint names."""
    base: Any = processor_class

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # transformers reads a processor's attributes and the settings it saves from its
    # constructor's signature: the class's own, less the video processor.
    signature = inspect.signature(base.__init__)
    __init__.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in signature.parameters.items() if name != "video_processor"])
    return type(processor_class.__name__, (processor_class,), {"__init__": __init__, "__module__": __name__})


def build_image_only(processor_class: type, image_processor: Any, tokenizer: Any,
                     chat_template: str | None = None, **kwargs: Any) -> Any:
    """A ``processor_class`` processor of ``image_processor`` and ``tokenizer`` alone;
    ``kwargs`` are the processor's own settings (SmolVLM's ``image_seq_len``)."""
    return image_only_class(processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=chat_template, **kwargs)


def load_processor(model: str, model_type: str, **kwargs: Any) -> Any | None:
    """transformers' AutoProcessor for ``model``; where that fails for lack of torchvision
    and the model type's processor takes a video processor, the image-only one (see the
    module docstring), built from the directory's image processor and tokenizer; None
    where the directory has no image processor at all."""
    try:
        return transformers.AutoProcessor.from_pretrained(model, **kwargs)
    except (OSError, ImportError, ValueError, AttributeError, TypeError) as exc:
        if not is_torchvision_available() and _names_pixtral_processor(model, model_type, **kwargs):
            logger.info("building Pixtral's processor for %s from its PIL image processor and tokenizer (no "
                        "torchvision)", model)
            return PixtralImageProcessor.from_pretrained(model, **kwargs)
        processor_class = _video_processor_class(model_type)
        if is_torchvision_available() or processor_class is None:
            raise
        logger.info("building %s for %s from its image processor and tokenizer (no torchvision for its video "
                    "processor: %s)", processor_class.__name__, model, " ".join(str(exc).split())[:200])
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(model, **kwargs)
    except OSError:  # no image processor config in the directory
        return None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model, **kwargs)
    return build_image_only(processor_class, image_processor, tokenizer, getattr(tokenizer, "chat_template", None),
                            **_saved_settings(processor_class, model, **kwargs))


def _saved_settings(processor_class: type, model: str, **kwargs: Any) -> dict[str, Any]:
    """The processor's own settings saved in the directory's processor_config.json (such
    as SmolVLM's ``image_seq_len``, which sets every image's placeholder count): the
    constructor's parameters other than its sub-processors and chat template."""
    processor_dict, _ = processor_class.get_processor_dict(model, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]
    skip = {"self", "chat_template", "args", "kwargs", *processor_class.get_attributes()}  # pyright: ignore[reportAttributeAccessIssue]
    names = set(inspect.signature(processor_class.__init__).parameters) - skip
    return {name: value for name, value in processor_dict.items() if name in names}


def _video_processor_class(model_type: str) -> type | None:
    """The model type's processor class where its constructor takes a video processor."""
    names = transformers.models.auto.processing_auto.PROCESSOR_MAPPING_NAMES  # pyright: ignore[reportPrivateImportUsage]
    name = names.get(model_type)
    processor_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if not isinstance(processor_class, type) or "video_processor" not in processor_class.get_attributes():
        return None
    return processor_class


def _names_pixtral_processor(model: str, model_type: str, **kwargs: Any) -> bool:
    """Whether the model's processor is transformers' PixtralProcessor (by its
    processor_config.json, else by its model type), which imports torchvision."""
    settings = processor_settings(model, **kwargs)
    if settings:
        return settings.get("processor_class") == "PixtralProcessor"
    names = transformers.models.auto.processing_auto.PROCESSOR_MAPPING_NAMES  # pyright: ignore[reportPrivateImportUsage]
    return names.get(model_type) == "PixtralProcessor"
