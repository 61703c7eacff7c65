"""default_mm_loras on image prompts, as vLLM's offline API: an image prompt runs with
the image modality's adapter (on the text model), a text prompt without it; an adapter
with weights for the vision encoder is refused."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.lora.request import LoRAError

from .conftest import images

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
TEXT_ATTENTION = r".*language_model.*\.(q_proj|v_proj|down_proj)"


def _adapter(base_dir: str, out_dir, target_modules) -> str:
    model = transformers.AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def text_adapter(tiny_llava_dir, tmp_path_factory):
    return _adapter(tiny_llava_dir, tmp_path_factory.mktemp("lora-text"), TEXT_ATTENTION)


def _reference(base_dir: str, adapter: str | None, text: str, pictures) -> list[int]:
    processor = transformers.AutoProcessor.from_pretrained(base_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    inputs = processor(text=text, images=pictures or None, return_tensors="pt")
    with torch.no_grad():
        output = model.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return output[0, inputs["input_ids"].shape[1]:].tolist()


def test_image_prompts_take_the_image_adapter(tiny_llava_dir, text_adapter):
    llm = LLM(tiny_llava_dir, dtype="float32", enable_lora=True, max_lora_rank=4,
              default_mm_loras={"image": text_adapter})
    [picture] = images(1)
    text = "<image> what is in it?"
    image_prompt = {"prompt": text, "multi_modal_data": {"image": picture}}
    [with_image, text_only] = llm.generate([image_prompt, "plain text prompt"], GREEDY, use_tqdm=False)
    expected = _reference(tiny_llava_dir, text_adapter, text, [picture])
    assert list(with_image.outputs[0].token_ids) == expected
    assert expected != _reference(tiny_llava_dir, None, text, [picture])  # the adapter changes the tokens
    assert list(text_only.outputs[0].token_ids) == _reference(tiny_llava_dir, None, "plain text prompt", [])


def test_an_adapter_on_the_vision_encoder_is_refused(tiny_llava_dir, tmp_path):
    adapter = _adapter(tiny_llava_dir, tmp_path / "lora-all", ["q_proj", "v_proj"])
    llm = LLM(tiny_llava_dir, dtype="float32", enable_lora=True, max_lora_rank=4, default_mm_loras={"image": adapter})
    with pytest.raises(LoRAError, match="vision_tower"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": images(1)[0]}}, GREEDY, use_tqdm=False)
