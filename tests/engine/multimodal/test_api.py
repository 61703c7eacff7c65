"""The image API as vLLM's: multi_modal_data in generate, image parts in chat (data
URLs, allowed local files and links, PIL images), and a ValueError naming the request
for every image that cannot be used."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.inputs.chat import ChatRenderError
from shardline.engine.multimodal import loading
from shardline.engine.multimodal.inputs import ProcessedPrompt

from .conftest import images

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    for index, picture in enumerate(images(2)):
        picture.save(folder / f"{index}.png")
    return folder


@pytest.fixture(scope="module")
def image_server(image_dir):
    """A local http server over image_dir: (base URL)."""
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(*args, directory=str(image_dir))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_llava_dir, image_dir):
    return LLM(tiny_llava_dir, dtype="float32", allowed_local_media_path=str(image_dir),
               allowed_media_domains=["127.0.0.1"], limit_mm_per_prompt={"image": 2})


def _chat(part):
    return [{"role": "user", "content": [{"type": "text", "text": "what is"}, part, {"type": "text", "text": "?"}]}]


def test_chat_parts_match_transformers(llm, llava_reference, image_dir, image_server):
    first, second = (Image.open(image_dir / f"{i}.png").convert("RGB") for i in range(2))
    parts = [({"type": "image_url", "image_url": {"url": _data_url(first)}}, first),
             ({"type": "image_pil", "image_pil": second}, second),
             ({"type": "image_url", "image_url": {"url": (image_dir / "1.png").as_uri()}}, second),
             ({"type": "image_url", "image_url": str(image_dir / "0.png")}, first),
             ({"type": "image_url", "image_url": {"url": f"{image_server}/0.png"}}, first)]
    outputs = llm.chat([_chat(part) for part, _ in parts], GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for (part, picture), output in zip(parts, outputs):
        text = tokenizer.decode(output.prompt_token_ids)
        assert text.count("<image>") == 16 and text.startswith("<|bos|><|user|>what is")
        rendered = text.replace("<image>" * 16, "<image>")
        assert list(output.outputs[0].token_ids) == llava_reference(rendered, [picture], MAX_TOKENS), part["type"]
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids


@pytest.mark.parametrize("url,match", [
    ("s3://bucket/cat.png", "has scheme 's3'.*read by the pipeline with the job's storage options"),
    ("http://example.com/cat.png", "on domain 'example.com'.*allowed_media_domains \\(allowed: 127.0.0.1\\)"),
    ("/etc/passwd", "outside allowed_local_media_path"),
    ("data:image/png,abc", "not base64-encoded"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded as an image"),
])
def test_unusable_image_urls_are_refused_naming_the_conversation(llm, url, match):
    with pytest.raises(ValueError, match=f"request 'conversation 0': .*{match}"):
        llm.chat(_chat({"type": "image_url", "image_url": {"url": url}}), GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_links_and_local_files_need_their_options(tiny_llava_dir, image_dir):
    default = LLM(tiny_llava_dir, dtype="float32", check_model=False)
    with pytest.raises(ValueError, match="allowed_local_media_path, which is not set"):
        default.chat(_chat({"type": "image_url", "image_url": str(image_dir / "0.png")}), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="none is allowed"):
        default.chat(_chat({"type": "image_url", "image_url": "https://127.0.0.1/0.png"}), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("data,match", [
    ("a cat", "image 0 must be a PIL.Image.Image or encoded image bytes, got str"),
    (b"not an image", "image 0 cannot be decoded as an image"),
    ([images(1)[0]] * 3, "has 3 images; model .* takes at most 2 per prompt"),
])
def test_unusable_images_are_refused_naming_the_request(llm, data, match):
    with pytest.raises(ValueError, match=rf"request '\d+'.*{match}"):
        llm.generate({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": data}}, GREEDY,
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_oversized_images_are_refused(llm, monkeypatch):
    monkeypatch.setattr(loading, "MAX_IMAGE_PIXELS", 40 * 30 - 1)
    with pytest.raises(ValueError, match=r"image 0 is 40x30 pixels; images of 1 to 1199 pixels are taken"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": images(1)[0]}}, GREEDY, use_tqdm=False)


def test_placeholders_must_match_the_images(llm):
    [picture] = images(1)
    with pytest.raises(ValueError, match=r"request '\d+': the model's processor cannot take this prompt"):
        llm.generate({"prompt": "<image> and <image>", "multi_modal_data": {"image": picture}}, GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_token_ids hold 0 image placeholder token\(s\).*for 1 image"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="an image prompt needs a non-empty 'prompt'"):
        llm.generate({"prompt": "", "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)


def test_audio_and_video_are_refused_on_a_vision_model(llm):
    with pytest.raises(ValueError, match=r"carries 1 audio item.*it takes image input only"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"audio": b"x"}}, GREEDY, use_tqdm=False)
    with pytest.raises(ChatRenderError, match="'video_url' part carries video input"):
        llm.chat(_chat({"type": "video_url", "video_url": {"url": "file:///v.mp4"}}), GREEDY, use_tqdm=False)


def test_images_are_prepared_off_the_calling_thread(llm):
    engine = llm.llm_engine
    threads = []
    real = engine.preprocess

    def recording(request_id, prompt):
        if not isinstance(prompt, ProcessedPrompt):  # add_request passes the processed prompt through
            threads.append(threading.current_thread().name)
        return real(request_id, prompt)

    engine.preprocess = recording
    try:
        llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": picture}} for picture in images(3)],
                     GREEDY, use_tqdm=False)
    finally:
        del engine.preprocess
    assert len(threads) == 3 and all(name.startswith("shardline-preprocess") for name in threads)


def test_render_chat_prompt_carries_the_images(llm):
    [picture] = images(1)
    prompt = llm.render_chat_prompt(_chat({"type": "image_pil", "image_pil": picture}))
    assert isinstance(prompt, dict) and prompt["multi_modal_data"] == {"image": [picture]}
    [from_prompt] = llm.generate(prompt, GREEDY, use_tqdm=False)
    [from_chat] = llm.chat(_chat({"type": "image_pil", "image_pil": picture}), GREEDY, use_tqdm=False)
    assert from_prompt.prompt_token_ids == from_chat.prompt_token_ids
    assert from_prompt.outputs[0].token_ids == from_chat.outputs[0].token_ids
