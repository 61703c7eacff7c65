"""A prompt carrying media a model cannot take is refused, naming the request and the
modality; it never runs as if the media were not there."""

from __future__ import annotations

import pytest
from PIL import Image

from shardline import SamplingParams
from shardline.engine.inputs.chat import ChatRenderError

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)
IMAGE = Image.new("RGB", (8, 8), (200, 10, 10))


@pytest.mark.parametrize("prompt", [
    {"prompt": "describe <image>", "multi_modal_data": {"image": IMAGE}},
    {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": [IMAGE, IMAGE]}},
])
def test_generate_refuses_an_image_for_a_text_model(tiny_llm, prompt):
    with pytest.raises(ValueError, match=r"request '\d+' carries \d image item\(s\).*cannot take image input"):
        tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("modality", ["audio", "video"])
def test_audio_and_video_are_refused_by_name(tiny_llm, modality):
    with pytest.raises(ValueError, match=f"{modality} item"):
        tiny_llm.generate({"prompt": "x", "multi_modal_data": {modality: b"data"}}, GREEDY, use_tqdm=False)


def test_add_request_refuses_and_queues_nothing(tiny_llm):
    engine = tiny_llm.llm_engine
    with pytest.raises(ValueError, match=r"request 'r1' carries 1 image item"):
        engine.add_request("r1", {"prompt": "hi", "multi_modal_data": {"image": IMAGE}}, GREEDY)
    assert not engine.has_unfinished_requests()


def test_unknown_prompt_fields_are_refused(tiny_llm):
    with pytest.raises(ValueError, match=r"unknown prompt field\(s\) 'multimodal_data'"):
        tiny_llm.generate({"prompt": "hi", "multimodal_data": {"image": IMAGE}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="modalities are image, audio, video"):
        tiny_llm.generate({"prompt": "hi", "multi_modal_data": {"images": IMAGE}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no multi_modal_data"):
        tiny_llm.generate({"prompt": "hi", "multi_modal_uuids": {"image": "a"}}, GREEDY, use_tqdm=False)


def test_empty_media_is_a_text_prompt(tiny_llm):
    [with_empty] = tiny_llm.generate({"prompt": "hello", "multi_modal_data": {}}, GREEDY, use_tqdm=False)
    [plain] = tiny_llm.generate("hello", GREEDY, use_tqdm=False)
    assert with_empty.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("part,modality", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image"),
    ({"type": "image_pil", "image_pil": IMAGE}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "video_url", "video_url": {"url": "file:///v.mp4"}}, "video"),
])
def test_chat_refuses_media_parts_for_a_text_model(tiny_llm, part, modality):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    with pytest.raises(ChatRenderError, match=f"conversation 0: message 0: a '{part['type']}' part carries "
                                              f"{modality} input, which this model cannot take"):
        tiny_llm.chat(messages, GREEDY, use_tqdm=False)


def test_embedding_engine_refuses_images(embedding_model):
    from shardline import LLM

    llm = LLM(embedding_model, task="embed")
    with pytest.raises(ValueError, match=r"request '0' carries 1 image item"):
        llm.embed({"prompt": "hi", "multi_modal_data": {"image": IMAGE}}, use_tqdm=False)


def test_processor_options_a_model_does_not_take_are_refused(tiny_llava_dir, tiny_llama_dir, embedding_model):
    # mm_processor_kwargs is taken only with keys the model's processor takes here
    # (Gemma 3's pan-and-scan, tests/engine/multimodal/test_gemma3.py); others are
    # refused, never ignored, and the prompt field is refused.
    from shardline import LLM

    with pytest.raises(ValueError, match=r"mm_processor_kwargs key 'do_pan_and_scan' is not taken for llava"):
        LLM(tiny_llava_dir, mm_processor_kwargs={"do_pan_and_scan": True})
    with pytest.raises(ValueError, match=r"mm_processor_kwargs must be a dict"):
        LLM(tiny_llava_dir, mm_processor_kwargs=["do_pan_and_scan"])
    with pytest.raises(ValueError, match=r"mm_processor_kwargs is set, but '.*' takes no images here"):
        LLM(tiny_llama_dir, dtype="float64", mm_processor_kwargs={"do_pan_and_scan": True})
    with pytest.raises(ValueError, match=r"mm_processor_kwargs is set, but the embedding engine"):
        LLM(embedding_model, task="embed", mm_processor_kwargs={"do_pan_and_scan": True})
    # The other image options, on engines that take no images, likewise.
    for option, value in (("limit_mm_per_prompt", {"image": 2}), ("allowed_local_media_path", "/tmp"),
                          ("allowed_media_domains", ["example.com"])):
        with pytest.raises(ValueError, match=rf"{option} is set, but the embedding engine of '.*' takes no images"):
            LLM(embedding_model, task="embed", **{option: value})
        with pytest.raises(ValueError, match=rf"{option} is set, but '.*' takes no images here"):
            LLM(tiny_llama_dir, dtype="float64", **{option: value})
    llm = LLM(tiny_llava_dir, dtype="float32", check_model=False)
    with pytest.raises(ValueError, match=r"request '\d+': unknown prompt field\(s\) 'mm_processor_kwargs'"):
        llm.generate({"prompt": "<image> hi", "multi_modal_data": {"image": IMAGE},
                      "mm_processor_kwargs": {"do_pan_and_scan": True}}, GREEDY, use_tqdm=False)
