"""M-RoPE ids (engine/multimodal/mrope.py) against the Qwen-VL models' own rope index,
chunk by chunk and past the prompt; and the image-only processor construction
(engine/multimodal/image_only.py) where AutoProcessor cannot build the processor."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from shardline.engine.model.tiny_qwen_vl import build_tiny_qwen_vl
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.inputs import ImageInput
from shardline.engine.multimodal.mrope import (
    check_adjacent_images,
    check_mrope_image,
    mrope_delta,
    mrope_positions,
    step_mrope_positions,
)

IMAGE_TOKEN = 9
MERGE = 2


def _prompt(layout: list[int | tuple[int, int]]) -> tuple[list[int], list[ImageInput], torch.Tensor]:
    """Token ids, ImageInputs and image_grid_thw (in patches) of a prompt laid out as text
    runs (an int: that many tokens) and images (rows, columns in tokens)."""
    ids: list[int] = []
    images: list[ImageInput] = []
    grids = []
    for part in layout:
        if isinstance(part, int):
            ids += [5] * part
            continue
        rows, columns = part
        start = len(ids)
        ids += [IMAGE_TOKEN] * (rows * columns)
        images.append(ImageInput(f"image-{len(images)}", tuple(range(start, len(ids))), {}, (1, rows, columns)))
        grids.append([1, rows * MERGE, columns * MERGE])
    return ids, images, torch.tensor(grids)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def rope_index(request):
    """The model type's own get_rope_index (a model built on the meta device)."""
    config = transformers.AutoConfig.for_model(request.param)
    config.vision_config.spatial_merge_size = MERGE
    config.image_token_id = IMAGE_TOKEN
    model_class = transformers.Qwen2VLModel if request.param == "qwen2_vl" else transformers.Qwen3VLModel
    with torch.device("meta"):
        model = model_class(config)

    def index(ids: list[int], grids: torch.Tensor) -> tuple[np.ndarray, int]:
        input_ids = torch.tensor([ids])
        positions, deltas = model.get_rope_index(input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=grids)
        return positions[:, 0].numpy(), int(deltas[0, 0])

    return index


LAYOUTS = [[3, (2, 3), 4], [(3, 2), 5], [2, (4, 4), 1, (1, 3), 3, (3, 1)], [4, (2, 5)]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ids_equal_the_models_rope_index(rope_index, layout):
    ids, images, grids = _prompt(layout)
    expected, delta = rope_index(ids, grids)
    positions = np.arange(len(ids))
    assert np.array_equal(mrope_positions(positions, images), expected)
    assert mrope_delta(images) == delta
    # any chunking gives the same ids; generated tokens continue at index + delta
    chunks = [mrope_positions(positions[start:start + 3], images) for start in range(0, len(ids), 3)]
    assert np.array_equal(np.concatenate(chunks, axis=1), expected)
    later = np.arange(len(ids), len(ids) + 4)
    assert np.array_equal(mrope_positions(later, images), np.broadcast_to(later + delta, (3, 4)))


def test_a_step_packs_each_requests_ids():
    ids, images, _ = _prompt([2, (2, 3), 2])  # prompt of 10 tokens, delta 3 - 6
    text_only = SimpleNamespace(start=7, request=SimpleNamespace(images=()))
    chunk = SimpleNamespace(start=1, request=SimpleNamespace(images=tuple(images)))
    decoding = SimpleNamespace(start=12, request=SimpleNamespace(images=tuple(images)))
    # text 7..9, a chunk 1..5 across the image's start, one decoded token at 12
    positions = np.array([7, 8, 9, 1, 2, 3, 4, 5, 12])
    step = step_mrope_positions([text_only, chunk, decoding], np.array([0, 3, 8, 9]),  # type: ignore[list-item]
                                positions)
    assert step.shape == (3, 1, 9)
    assert np.array_equal(step[:, 0, :3], np.broadcast_to([7, 8, 9], (3, 3)))
    assert np.array_equal(step[:, 0, 3:8], mrope_positions(positions[3:8], images))
    assert np.array_equal(step[:, 0, 8], [12 - 3] * 3) and mrope_delta(images) == -3


def test_placeholders_off_the_grid_are_refused():
    split = ImageInput("split", (1, 2, 4, 5), {}, (1, 2, 2))
    with pytest.raises(ValueError, match=r"request 'r1'.*do not form its 1x2x2 token grid"):
        check_mrope_image("r1", split)
    check_mrope_image("r1", ImageInput("whole", (1, 2, 3, 4), {}, (1, 2, 2)))


def test_adjacent_images_are_refused(rope_index):
    # The models read a run of image tokens as one image: their own rope index fails.
    ids, images, grids = _prompt([2, (2, 3), (3, 2), 2])
    with pytest.raises(RuntimeError):
        rope_index(ids, grids)
    with pytest.raises(ValueError, match=r"request 'r1': two images' placeholder tokens are adjacent \(prompt "
                                         r"positions 2..13\)"):
        check_adjacent_images("r1", images)
    check_adjacent_images("r1", _prompt([2, (2, 3), 1, (3, 2), 2])[1])


@pytest.mark.skipif(transformers.utils.import_utils.is_torchvision_available(),
                    reason="with torchvision, AutoProcessor builds the processor itself")
@pytest.mark.parametrize("layout", ["processor_config", "preprocessor_config"])
def test_the_processor_is_built_without_its_video_processor(tmp_path, layout):
    # processor_config.json as transformers saves it now; preprocessor_config.json (the
    # image processor's settings alone) as the hub's Qwen-VL checkpoints hold them.
    model_dir = build_tiny_qwen_vl(tmp_path / "qwen2_vl", "qwen2_vl")
    if layout == "preprocessor_config":
        saved = json.loads((model_dir / "processor_config.json").read_text())
        (model_dir / "preprocessor_config.json").write_text(json.dumps(
            {**saved["image_processor"], "processor_class": "Qwen2VLProcessor"}))
        (model_dir / "processor_config.json").unlink()
    with pytest.raises((OSError, ImportError)):  # its video processor needs torchvision
        transformers.AutoProcessor.from_pretrained(str(model_dir))
    processor = load_processor(str(model_dir), "qwen2_vl")
    assert isinstance(processor, transformers.Qwen2VLProcessor) and not hasattr(processor, "video_processor")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert processor.image_processor.patch_size == 4 and processor.image_token == "<|image_pad|>"


def test_the_load_check_catches_wrong_mrope_ids(tmp_path, monkeypatch):
    # 1-D positions for every token (the image's grid ignored): the load check's image
    # probe (3 tokens, then the image) differs from the model's own forward at the image's
    # second token, the first whose ids (3, 3, 4) are not its index, and the model is refused.
    from shardline import LLM
    from shardline.engine.model import runner
    from shardline.engine.model.load_check import ModelMismatchError

    model_dir = str(build_tiny_qwen_vl(tmp_path / "qwen2_vl", "qwen2_vl"))
    monkeypatch.setattr(runner, "step_mrope_positions",
                        lambda scheduled, query_start_loc, positions: np.broadcast_to(positions, (3, 1, len(positions)))
                        .copy())
    with pytest.raises(ModelMismatchError, match=r"differently from the model.s own forward, first at position 4 "):
        LLM(model_dir, dtype="float32")
