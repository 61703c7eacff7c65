"""A shard's manifest: what its committed output holds and the job that wrote it.

``<output>/_manifests/<shard key>.json`` is the shard's commit marker
(tasks/shard_writer.py): a rerun skips a shard whose manifest carries the job's
fingerprint. Its JSON layout is fixed, since a resumed job reads the manifests earlier
runs wrote: ``to_json`` writes the keys in the order they have always had, and
``from_json`` reads any manifest those runs wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ManifestError(ValueError):
    """A manifest whose JSON lacks a field or holds one of the wrong type."""


@dataclass(frozen=True)
class ShardManifest:
    """One shard's committed output: counts (requests, failed requests, tokens), where
    it came from and went, how long each stage took, and the job's fingerprint and
    public fields. ``invalid_outputs`` (structured outputs that did not validate,
    counted among ``errors``) is None for OpenAI Batch outputs, which do not count them.
    ``reasoning_tokens`` counts the completion tokens a reasoning parser put in the
    reasoning (None, and absent from the JSON, in manifests written before it was counted);
    ``collapsed_rows`` the rows whose output the engine copied from an identical row's
    computation (engine/core/duplicates.py; None and absent likewise)."""

    shard: str
    input: str
    output: str
    rows: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    endpoints: tuple[str, ...]  # the OpenAI endpoints the shard's requests are answered as
    seconds: Mapping[str, float]  # stage (read, run, write) -> seconds
    written_at: str  # ISO 8601, UTC
    fingerprint: str
    job: Mapping[str, Any]  # the fields the fingerprint is taken over (tasks/fingerprint.py)
    invalid_outputs: int | None = None
    reasoning_tokens: int | None = None
    collapsed_rows: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest as its JSON object, keys in their on-disk order."""
        counts: dict[str, Any] = {
            "rows": self.rows, "errors": self.errors, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
            "endpoints": list(self.endpoints),
        }
        if self.invalid_outputs is not None:
            counts["invalid_outputs"] = self.invalid_outputs
        if self.reasoning_tokens is not None:
            counts["reasoning_tokens"] = self.reasoning_tokens
        if self.collapsed_rows is not None:
            counts["collapsed_rows"] = self.collapsed_rows
        return {
            "shard": self.shard, "input": self.input, "output": self.output, **counts,
            "seconds": dict(self.seconds), "written_at": self.written_at, "fingerprint": self.fingerprint,
            "job": dict(self.job),
        }

    @classmethod
    def from_json(cls, data: Any) -> ShardManifest:
        """A manifest from its JSON object; raises ManifestError naming a missing or
        mistyped field."""
        if not isinstance(data, Mapping):
            raise ManifestError(f"a manifest is a JSON object, got {type(data).__name__}")
        invalid = data.get("invalid_outputs")
        return cls(
            shard=_field(data, "shard", str), input=_field(data, "input", str), output=_field(data, "output", str),
            rows=_field(data, "rows", int), errors=_field(data, "errors", int),
            prompt_tokens=_field(data, "prompt_tokens", int),
            completion_tokens=_field(data, "completion_tokens", int),
            cached_prompt_tokens=_field(data, "cached_prompt_tokens", int, 0),
            endpoints=tuple(_field(data, "endpoints", list, [])),
            seconds=_field(data, "seconds", dict), written_at=_field(data, "written_at", str),
            fingerprint=_field(data, "fingerprint", str), job=_field(data, "job", dict),
            invalid_outputs=None if invalid is None else _field(data, "invalid_outputs", int),
            reasoning_tokens=None if data.get("reasoning_tokens") is None else _field(data, "reasoning_tokens", int),
            collapsed_rows=None if data.get("collapsed_rows") is None else _field(data, "collapsed_rows", int),
        )


_MISSING = object()


def _field(data: Mapping[str, Any], name: str, kind: type, default: Any = _MISSING) -> Any:
    """``data[name]``, checked to be a ``kind`` (``default`` where the key is absent)."""
    value = data.get(name, default)
    if value is _MISSING:
        raise ManifestError(f"manifest field {name!r} is missing")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"manifest field {name!r} must be a {kind.__name__}, got {value!r}")
    return value
