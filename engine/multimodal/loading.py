"""Decoding the images a prompt or a chat part carries: PIL images as they are,
encoded bytes, data URLs, local files and (when allowed) http(s) links.

Every refusal is a ValueError naming the request and the bad item: a wrong type, an
image that cannot be decoded, one larger than ``MAX_IMAGE_PIXELS``, a local file
outside ``allowed_local_media_path``, a link to a domain outside
``allowed_media_domains`` (vLLM's option names), or a URL scheme the engine does not
read (object-store URLs are the pipeline's: it fetches them with the job's storage
options and hands the engine decoded images).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

# Larger images are refused: decoding one takes 3 bytes a pixel before any resizing.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# Encoded bytes read from a file or a link at most.
MAX_IMAGE_BYTES = 64 * 1024 * 1024
HTTP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MediaOptions:
    """Where image URLs may be read from: local files under ``allowed_local_media_path``
    (None: no local files), http(s) links to ``allowed_media_domains`` (None: none)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None


def as_image(request_id: str, item: Any, what: str = "image") -> Image.Image:
    """``item`` (a PIL image or encoded image bytes) as a checked RGB PIL image."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        item = decode_image_bytes(request_id, bytes(item), what)
    if not isinstance(item, Image.Image):
        raise ValueError(f"request {request_id!r}: {what} must be a PIL.Image.Image or encoded image bytes, "
                         f"got {type(item).__name__}")
    width, height = item.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"request {request_id!r}: {what} is {width}x{height} pixels; images of 1 to "
                         f"{MAX_IMAGE_PIXELS} pixels are taken")
    try:
        return item if item.mode == "RGB" else item.convert("RGB")
    except OSError as exc:  # a truncated file fails when its pixels are first read
        raise ValueError(f"request {request_id!r}: {what} cannot be decoded: {exc}") from exc


def decode_image_bytes(request_id: str, data: bytes, what: str) -> Image.Image:
    """Encoded bytes (PNG, JPEG, WebP, ...) as a PIL image, its pixels read now."""
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"request {request_id!r}: {what} is {width}x{height} pixels; images of up to "
                             f"{MAX_IMAGE_PIXELS} pixels are taken")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"request {request_id!r}: {what} cannot be decoded as an image: {exc}") from exc
    return image


def load_image_url(request_id: str, url: Any, options: MediaOptions) -> Image.Image:
    """The image at ``url``: a data URL, a local path or file:// URL under
    ``allowed_local_media_path``, or an http(s) link to an allowed domain."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"request {request_id!r}: an image URL must be a non-empty string, got {url!r:.100}")
    what = f"image {url[:80]!r}"
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return as_image(request_id, _data_url_bytes(request_id, url), what)
    if scheme in ("", "file") or len(scheme) == 1:  # a path (a Windows drive letter parses as a scheme)
        return as_image(request_id, _local_bytes(request_id, url, scheme, options), what)
    if scheme in ("http", "https"):
        return as_image(request_id, _http_bytes(request_id, url, options), what)
    raise ValueError(f"request {request_id!r}: image URL {url[:200]!r} has scheme {scheme!r}, which the engine "
                     "does not read (it reads data:, file: and, where allowed, http(s) URLs); object-store URLs "
                     "are read by the pipeline with the job's storage options")


def _data_url_bytes(request_id: str, url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError(f"request {request_id!r}: data URL {url[:60]!r} is not base64-encoded "
                         "(data:<mime type>;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"request {request_id!r}: data URL {url[:60]!r} holds invalid base64: {exc}") from exc


def _local_bytes(request_id: str, url: str, scheme: str, options: MediaOptions) -> bytes:
    path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path) if scheme == "file" else url)
    allowed = options.allowed_local_media_path
    if allowed is None:
        raise ValueError(f"request {request_id!r}: image {url[:200]!r} is a local file, and the engine reads "
                         "local files only under allowed_local_media_path, which is not set")
    resolved, root = path.resolve(), Path(allowed).resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"request {request_id!r}: image {url[:200]!r} is outside allowed_local_media_path "
                         f"{allowed!r}")
    try:
        with open(resolved, "rb") as file:
            data = file.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"request {request_id!r}: image {url[:200]!r} cannot be read: {exc}") from exc
    return _within_limit(request_id, url, data)


def _http_bytes(request_id: str, url: str, options: MediaOptions) -> bytes:
    domain = (urllib.parse.urlsplit(url).hostname or "").lower()
    allowed = options.allowed_media_domains
    if allowed is None or domain not in allowed:
        listed = "none is allowed" if allowed is None else f"allowed: {', '.join(allowed)}"
        raise ValueError(f"request {request_id!r}: image link {url[:200]!r} is on domain {domain!r}, and the "
                         f"engine fetches links only from allowed_media_domains ({listed})")
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 - http(s) checked
            data = response.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"request {request_id!r}: image link {url[:200]!r} cannot be fetched: {exc}") from exc
    return _within_limit(request_id, url, data)


def _within_limit(request_id: str, url: str, data: bytes) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"request {request_id!r}: image {url[:200]!r} is larger than {MAX_IMAGE_BYTES} bytes")
    return data


def chat_part_image(request_id: str, part: dict[str, Any], options: MediaOptions) -> Image.Image:
    """The image of one chat content part: ``image_url`` ({"url": ...} or a str),
    ``image_pil`` (vLLM's), ``input_image`` (the Responses API's) or transformers'
    ``image`` (a PIL image or a URL)."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        return load_image_url(request_id, url, options)
    if kind == "input_image":
        return load_image_url(request_id, part.get("image_url"), options)
    if kind in ("image_pil", "image"):
        value = part.get(kind)
        if isinstance(value, str):
            return load_image_url(request_id, value, options)
        return as_image(request_id, value, f"the {kind!r} part's image")
    raise ValueError(f"request {request_id!r}: a {kind!r} chat part is not taken (precomputed image embeddings "
                     "are not); send the image itself (image_url, image_pil)")
