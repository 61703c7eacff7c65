"""Images of rows: where each comes from, how it is read and decoded, and the limits.

A row's image is encoded bytes (a Parquet binary column, or the ``{bytes, path}``
struct Hugging Face datasets write) or a URL: ``data:`` URLs, any fsspec URL
(``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``) read with the job's
storage options, and ``http(s)://`` only from a host in ``allowed_domains``.

Invariants:
- An image is used or its row fails with an error naming the image and the reason;
  never dropped. A URL the options refuse fails at validation, before any read.
- An encoded image over ``max_image_bytes`` is never read whole: the store's size is
  checked first, and a read is cut one byte past the limit when the size is unknown.
- An image's pixel count is checked from its header before its pixels are decoded
  (PIL's ``Image.MAX_IMAGE_PIXELS``, read, never changed); decoded images are RGB,
  as vLLM's media loader makes them.
- Reads go through the storage retries (tasks/retrying.py): a store outage is waited
  out as for shards; a missing object or a refused read fails at once.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, cast

import fsspec
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import PipelineError, redact_url
from .retrying import retry_storage
from .storage import filesystem

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_PREFETCH_BYTES = 512 * 1024 * 1024
# A chat part standing for the row's next image until it is fetched (transformers' templates' own part).
IMAGE_MARKER_TYPE = "image"
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.ASCII)
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


class ImageOptions(BaseModel):
    """How a job's rows carry images and how they are read (``BatchJob.images``)."""

    model_config = ConfigDict(extra="forbid")

    column: str | None = Field(
        default=None, description="Input column holding each row's image(s): encoded bytes, a {bytes, path} struct "
        "(Hugging Face datasets), a URL (data:, s3://, gs://, az://, file://, ...; http(s) from allowed_domains), "
        "or a list of them. Null means the row has no image.")
    allowed_domains: list[str] = Field(
        default_factory=list, description="Hosts http(s) image URLs may name (a domain admits its subdomains); "
        "empty refuses http(s) image URLs.")
    max_image_bytes: int = Field(
        default=DEFAULT_MAX_IMAGE_BYTES, ge=1, description="Largest encoded image read; a row with a larger one "
        "is an error row.")
    prefetch_bytes: int = Field(
        default=DEFAULT_PREFETCH_BYTES, ge=1, description="Most bytes of decoded images held ahead of the engine "
        "per shard.")

    @field_validator("allowed_domains")
    @classmethod
    def _bare_hosts(cls, domains: list[str]) -> list[str]:
        hosts = [domain.strip().lower().rstrip(".") for domain in domains]
        bad = [domain for domain, host in zip(domains, hosts, strict=True) if not _HOST.fullmatch(host)]
        if bad:
            raise ValueError(f"allowed_domains must be bare host names (example.com, cdn.example.com), got "
                             f"{', '.join(map(repr, bad))}")
        return hosts


class ImageError(ValueError):
    """One image cannot be used: its row becomes an error row with this message."""


@dataclass(frozen=True)
class ImageSource:
    """Where one image of a row comes from: encoded ``data``, or a ``url`` to read."""

    url: str | None = None
    data: bytes | None = None

    def describe(self) -> str:
        """The image as a message names it: its URL (credentials and data payloads cut)."""
        if self.url is None:
            return f"image bytes ({len(self.data or b'')} bytes)"
        if self.url.startswith("data:"):
            head = self.url.split(",", 1)[0]
            return f"{head},... ({len(self.url)} characters)"
        return redact_url(self.url)


def column_images(value: Any, options: ImageOptions) -> list[ImageSource]:
    """The images one row's image-column ``value`` holds (none for null). ImageError when
    the value is no image, or a URL the options refuse."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [source for item in value for source in _column_image(item, options)]
    return _column_image(value, options)


def _column_image(value: Any, options: ImageOptions) -> list[ImageSource]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not value:
            raise ImageError(f"image column {options.column!r} holds empty bytes")
        return [ImageSource(data=bytes(value))]
    if isinstance(value, str):
        return [url_image(value, options)]
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:  # Hugging Face datasets' Image feature
        if value.get("bytes") is not None:
            return _column_image(value["bytes"], options)
        if value.get("path") is not None:
            return [url_image(str(value["path"]), options)]
        return []
    raise ImageError(f"image column {options.column!r} must hold encoded image bytes, a URL, a {{bytes, path}} "
                     f"struct or a list of them, got {type(value).__name__} {value!r:.80}")


def url_image(url: str, options: ImageOptions) -> ImageSource:
    """An image named by ``url``, checked against ``options``; ImageError naming the URL
    when its scheme is unknown or http(s) from a host not allowed."""
    source = ImageSource(url=url)
    if url.startswith("data:"):
        if not _DATA_URL.match(url):
            raise ImageError(f"{source.describe()}: malformed data URL; expected data:<type>;base64,<data>")
        return source
    if not _SCHEME.match(url):
        raise ImageError(f"image URL {url!r:.120} has no scheme; give a data:, file://, s3://, gs://, az:// "
                         "or other fsspec URL")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in fsspec.available_protocols():
        raise ImageError(f"image URL {source.describe()}: fsspec knows no {scheme!r} protocol; give a data:, "
                         "file://, s3://, gs://, az:// or other fsspec URL")
    if scheme in ("http", "https"):
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if not any(host == domain or host.endswith("." + domain) for domain in options.allowed_domains):
            allowed = ", ".join(options.allowed_domains) or "none"
            raise ImageError(f"image URL {source.describe()}: host {host!r} is not in images.allowed_domains "
                             f"(allowed: {allowed}); http(s) images are read only from allowed domains")
    return source


def chat_images(messages: list[dict[str, Any]], column: list[ImageSource], options: ImageOptions
                ) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """``messages`` with every image part as an image marker, and the images in the order of
    their markers: an ``image_url`` part names its own image; ``{"type": "image"}`` parts
    take the ``column`` images in turn, which go before the first user message's text when
    no such part places them. ImageError for a malformed part or a count that differs."""
    if column and not any(_is_marker(part) for message in messages for part in _parts(message)):
        messages = with_leading_images(messages, len(column))
    from_column = iter(column)
    marked: list[dict[str, Any]] = []
    images: list[ImageSource] = []
    for position, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            marked.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                images.append(url_image(_part_url(part, position), options))
            elif _is_marker(part):
                source = next(from_column, None)
                if source is None:
                    raise ImageError(f"message {position}: a {{'type': 'image'}} part has no image left to take "
                                     f"(images.column {options.column!r} holds {len(column)} for this row)")
                images.append(source)
            else:
                parts.append(part)
                continue
            parts.append({"type": IMAGE_MARKER_TYPE})
        marked.append({**message, "content": parts})
    unplaced = sum(1 for _ in from_column)
    if unplaced:
        raise ImageError(f"images.column {options.column!r} holds {len(column)} image(s) for this row and its "
                         f"messages place {len(column) - unplaced}")
    return marked, images


def without_image_markers(messages: Any) -> Any:
    """``messages`` without their image markers (what a check of the text looks at); any
    other value as it is."""
    if not isinstance(messages, list):
        return messages
    return [{**message, "content": [part for part in _parts(message) if not _is_marker(part)]}
            if isinstance(message, dict) and isinstance(message.get("content"), list) else message
            for message in messages]


def _parts(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _is_marker(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_MARKER_TYPE


def _part_url(part: dict[str, Any], position: int) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ImageError(f"message {position}: an image_url part needs {{'image_url': {{'url': str}}}}, "
                         f"got {part!r:.100}")
    return url


def with_leading_images(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """``messages`` with ``count`` image markers before the first user message's text: where
    the images of an image column go in a chat."""
    for position, message in enumerate(messages):
        if message.get("role") == "user":
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            markers = [{"type": IMAGE_MARKER_TYPE} for _ in range(count)]
            return [*messages[:position], {**message, "content": markers + parts}, *messages[position + 1:]]
    raise ImageError("the row has images but its messages have no user message to carry them")


def read_image_bytes(source: ImageSource, options: ImageOptions, storage_options: dict[str, Any] | None) -> bytes:
    """The encoded bytes of ``source``; ImageError naming it when unreadable or too large."""
    limit = options.max_image_bytes
    if source.data is not None:
        data = source.data
    elif source.url is not None and source.url.startswith("data:"):
        data = _data_url_bytes(source)
    else:
        assert source.url is not None, "an ImageSource has data or a url"
        data = _read_url(source, source.url, limit, storage_options)
        if len(data) > limit:  # the store gave no size, and the read was cut one byte past the limit
            raise ImageError(f"{source.describe()} is more than {limit} bytes, over images.max_image_bytes={limit}")
    if len(data) > limit:
        raise ImageError(f"{source.describe()} is {len(data)} bytes, over images.max_image_bytes={limit}")
    return data


def _data_url_bytes(source: ImageSource) -> bytes:
    assert source.url is not None
    match = _DATA_URL.match(source.url)
    assert match is not None, "data URLs are checked when their row is read"
    payload = source.url[match.end():]
    if not match.group("b64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{source.describe()}: its base64 payload is malformed ({exc})") from None


def _read_url(source: ImageSource, url: str, limit: int, storage_options: dict[str, Any] | None) -> bytes:
    http = url.lower().startswith(("http://", "https://"))
    # Storage options hold the job's store credentials: never sent to a web host.
    options = {"allow_redirects": False} if http else storage_options
    try:
        fs, path = filesystem(url, options)
        size = None if http else retry_storage(lambda: fs.size(path), "read", url, fs)
        if size is not None and size > limit:
            raise ImageError(f"{source.describe()} is {size} bytes, over images.max_image_bytes={limit}")
        # fsspec: untyped, bytes
        data = cast(bytes, retry_storage(lambda: fs.cat_file(path, start=0, end=limit + 1), "read", url, fs))
    except PipelineError as exc:  # already retried where that helps; named and one line
        raise ImageError(f"{source.describe()} could not be read ({exc.reason})") from None
    if http and not data:
        raise ImageError(f"{source.describe()} could not be read: the host sent no data (an empty answer, or a "
                         "redirect, which is not followed: it could lead outside images.allowed_domains)")
    return data


def decoded_size(data: bytes, what: str) -> int:
    """Bytes the image in ``data`` takes decoded to RGB, from its header alone. ImageError
    naming ``what`` when it is no image PIL reads, or has more pixels than PIL allows."""
    with _open(data, what) as image:
        width, height = image.size
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise ImageError(f"{what} is {width}x{height} pixels, over PIL's Image.MAX_IMAGE_PIXELS={limit}")
    return width * height * 3


def decode_image(data: bytes, what: str) -> Image.Image:
    """The image in ``data``, decoded to RGB; ImageError naming ``what`` when it is no
    image, truncated or corrupt."""
    decoded_size(data, what)
    with _open(data, what) as image:
        try:
            image.load()
            return image.convert("RGB") if image.mode != "RGB" else image.copy()
        except Exception as exc:  # truncated data, a broken stream: PIL's decoders raise many types
            raise ImageError(f"{what} could not be decoded, truncated or corrupt ({type(exc).__name__}: {exc})") \
                from None


def _open(data: bytes, what: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:  # UnidentifiedImageError, DecompressionBombError, a plugin's own errors
        raise ImageError(f"{what} is not an image PIL can read ({type(exc).__name__}: {exc})") from None
