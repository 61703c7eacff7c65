"""Rows' images: sources, URL policy, reads (file://, memory://, data:, s3:// on SeaweedFS, http),
size and pixel limits, decoding."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image

from shardline.tasks.media import (
    ImageError,
    ImageOptions,
    ImageSource,
    chat_images,
    column_images,
    decode_image,
    read_image_bytes,
    url_image,
)


def png_bytes(seed: int = 0, size: tuple[int, int] = (12, 10), mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


OPTIONS = ImageOptions(column="image")


def test_column_values_become_sources():
    data = png_bytes()
    assert column_images(None, OPTIONS) == []
    assert column_images(data, OPTIONS) == [ImageSource(data=data)]
    assert column_images({"bytes": data, "path": "x.png"}, OPTIONS) == [ImageSource(data=data)]
    assert column_images({"bytes": None, "path": "s3://b/x.png"}, OPTIONS) == [ImageSource(url="s3://b/x.png")]
    assert column_images(["file:///a.png", data], OPTIONS) == [ImageSource(url="file:///a.png"), ImageSource(data=data)]
    with pytest.raises(ImageError, match=r"image column 'image' must hold .* got int 7"):
        column_images(7, OPTIONS)
    with pytest.raises(ImageError, match="empty bytes"):
        column_images(b"", OPTIONS)


def test_url_policy():
    with pytest.raises(ImageError, match=r"host 'example.com' is not in images.allowed_domains \(allowed: none\)"):
        url_image("https://example.com/cat.png", OPTIONS)
    allowed = ImageOptions(allowed_domains=["Example.com"])
    assert url_image("https://cdn.example.com/cat.png", allowed).url == "https://cdn.example.com/cat.png"
    with pytest.raises(ImageError, match="not in images.allowed_domains"):
        url_image("https://badexample.com/cat.png", allowed)  # a suffix is not a subdomain
    with pytest.raises(ImageError, match="has no scheme"):
        url_image("cat.png", OPTIONS)
    with pytest.raises(ImageError, match="fsspec knows no 'nosuch' protocol"):
        url_image("nosuch://bucket/cat.png", OPTIONS)
    with pytest.raises(ImageError, match="malformed data URL"):
        url_image("data:nonsense", OPTIONS)
    with pytest.raises(ValueError, match="bare host names"):
        ImageOptions(allowed_domains=["https://example.com"])


def test_chat_parts_and_column_images_take_their_places():
    data = png_bytes()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": "s3://b/a.png"}}]}]
    marked, images = chat_images(messages, [ImageSource(data=data)], OPTIONS)
    assert images == [ImageSource(data=data), ImageSource(url="s3://b/a.png")]  # the column's go first
    assert marked[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is it?"}, {"type": "image"}]
    placed = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
    assert chat_images(placed, [ImageSource(data=data)], OPTIONS)[1] == [ImageSource(data=data)]
    with pytest.raises(ImageError, match="holds 2 image"):
        chat_images(placed, [ImageSource(data=data)] * 2, OPTIONS)
    with pytest.raises(ImageError, match="message 0: an image_url part needs"):
        chat_images([{"role": "user", "content": [{"type": "image_url"}]}], [], OPTIONS)


def test_reads_data_file_and_memory_urls(tmp_path):
    import fsspec

    data = png_bytes(1)
    (tmp_path / "a.png").write_bytes(data)
    fsspec.filesystem("memory").pipe_file("/media-test/a.png", data)
    for url in (data_url(data), f"file://{tmp_path}/a.png", "memory://media-test/a.png"):
        assert read_image_bytes(url_image(url, OPTIONS), OPTIONS, {}) == data
    assert read_image_bytes(ImageSource(data=data), OPTIONS, {}) == data


def test_limits_and_missing_objects(tmp_path):
    data = png_bytes(2)
    small = ImageOptions(max_image_bytes=len(data) - 1)
    (tmp_path / "a.png").write_bytes(data)
    sources = (ImageSource(data=data), url_image(data_url(data), small), url_image(f"file://{tmp_path}/a.png", small))
    for source in sources:
        with pytest.raises(ImageError, match=rf"is {len(data)} bytes, over images.max_image_bytes={len(data) - 1}"):
            read_image_bytes(source, small, {})
    with pytest.raises(ImageError, match=r"file://.*missing.png could not be read \(FileNotFoundError"):
        read_image_bytes(url_image(f"file://{tmp_path}/missing.png", OPTIONS), OPTIONS, {})
    with pytest.raises(ImageError, match="base64 payload is malformed"):
        read_image_bytes(url_image("data:image/png;base64,@@@", OPTIONS), OPTIONS, {})


def test_decoding():
    rgba = png_bytes(3, mode="RGBA")
    image = decode_image(rgba, "row 0: image 1")
    assert image.mode == "RGB" and image.size == (12, 10)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(rgba)).convert("RGB")))
    with pytest.raises(ImageError, match="row 0: image 1 is not an image PIL can read"):
        decode_image(b"not an image at all", "row 0: image 1")
    with pytest.raises(ImageError, match="row 0: image 1 could not be decoded, truncated or corrupt"):
        decode_image(png_bytes(4, size=(64, 64))[:-200], "row 0: image 1")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's own warning, at open
def test_pixel_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match=r"is 12x10 pixels, over PIL's Image.MAX_IMAGE_PIXELS=100"):
        decode_image(png_bytes(), "the image")


def test_s3_images_with_storage_options(s3_server, monkeypatch):
    import s3fs

    prefix = s3_server.new_prefix()
    options = s3_server.storage_options()
    data = png_bytes(5)
    s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe_file(f"{prefix}/img/a.png", data)
    source = url_image(f"s3://{prefix}/img/a.png", OPTIONS)
    assert read_image_bytes(source, OPTIONS, options) == data
    with pytest.raises(ImageError, match=r"s3://.*/img/missing.png could not be read"):
        read_image_bytes(url_image(f"s3://{prefix}/img/missing.png", OPTIONS), OPTIONS, options)
    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "0")  # no store listens there: fail at once
    unreachable = {**options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                   "config_kwargs": {"retries": {"max_attempts": 1}}, "skip_instance_cache": True}
    with pytest.raises(ImageError, match=r"s3://.*/img/a.png could not be read") as caught:
        read_image_bytes(source, OPTIONS, unreachable)
    assert s3_server.secret_key not in str(caught.value)


@pytest.fixture
def http_images(tmp_path):
    """A local HTTP server over tmp_path (the web host an image URL names)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_http_images_from_allowed_hosts_only(http_images):
    root, base = http_images
    data = png_bytes(6)
    (root / "a.png").write_bytes(data)
    allowed = ImageOptions(allowed_domains=["127.0.0.1"], max_image_bytes=len(data))
    assert read_image_bytes(url_image(f"{base}/a.png", allowed), allowed, {"key": "never-sent"}) == data
    with pytest.raises(ImageError, match="over images.max_image_bytes"):
        tight = ImageOptions(allowed_domains=["127.0.0.1"], max_image_bytes=len(data) - 1)
        read_image_bytes(url_image(f"{base}/a.png", tight), tight, {})
    with pytest.raises(ImageError, match=r"missing.png could not be read \(FileNotFoundError"):
        read_image_bytes(url_image(f"{base}/missing.png", allowed), allowed, {})
    with pytest.raises(ImageError, match="not in images.allowed_domains"):
        url_image(f"{base}/a.png", OPTIONS)


def test_http_redirects_are_not_followed():
    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        allowed = ImageOptions(allowed_domains=["127.0.0.1"])
        with pytest.raises(ImageError, match="the host sent no data .* a redirect, which is not followed"):
            read_image_bytes(url_image(f"http://127.0.0.1:{server.server_address[1]}/a.png", allowed), allowed, {})
    finally:
        server.shutdown()
