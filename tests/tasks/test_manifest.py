"""Manifests keep their on-disk JSON: a resumed job reads what earlier runs wrote."""

from __future__ import annotations

import json

import pytest

from shardline.tasks.manifest import ManifestError, ShardManifest

# A Parquet shard's manifest as the writer has always laid it out (key order included).
PARQUET_MANIFEST = {
    "shard": "part-00000", "input": "file:///in/part-00000.parquet", "output": "file:///out/part-00000.parquet",
    "rows": 3, "errors": 1, "prompt_tokens": 12, "completion_tokens": 6, "cached_prompt_tokens": 4,
    "endpoints": ["/v1/completions"], "invalid_outputs": 0,
    "seconds": {"read": 0.01, "run": 1.5, "write": 0.02}, "written_at": "2026-01-02T03:04:05+00:00",
    "fingerprint": "abc123", "job": {"model": "m", "sampling": {"max_tokens": 4}},
}


def test_a_written_manifest_reads_back_to_the_same_json_in_the_same_order():
    manifest = ShardManifest.from_json(json.loads(json.dumps(PARQUET_MANIFEST)))
    assert (manifest.rows, manifest.errors, manifest.invalid_outputs) == (3, 1, 0)
    assert json.dumps(manifest.to_json(), indent=2) == json.dumps(PARQUET_MANIFEST, indent=2)


def test_an_openai_batch_manifest_has_no_invalid_outputs_key():
    openai = {key: value for key, value in PARQUET_MANIFEST.items() if key != "invalid_outputs"}
    manifest = ShardManifest.from_json(openai)
    assert manifest.invalid_outputs is None
    assert list(manifest.to_json()) == list(openai)


def test_a_manifest_without_usage_fields_reads_with_zero_usage():
    older = {key: value for key, value in PARQUET_MANIFEST.items()
             if key not in ("cached_prompt_tokens", "endpoints")}
    manifest = ShardManifest.from_json(older)
    assert (manifest.cached_prompt_tokens, manifest.endpoints) == (0, ())


@pytest.mark.parametrize(("key", "value", "message"), [
    ("fingerprint", None, "'fingerprint' must be a str"), ("rows", "3", "'rows' must be a int"),
    ("rows", True, "'rows' must be a int"),
])
def test_a_mistyped_field_is_named(key, value, message):
    with pytest.raises(ManifestError, match=message):
        ShardManifest.from_json({**PARQUET_MANIFEST, key: value})


def test_a_missing_field_is_named():
    with pytest.raises(ManifestError, match="'written_at' is missing"):
        ShardManifest.from_json({k: v for k, v in PARQUET_MANIFEST.items() if k != "written_at"})
    with pytest.raises(ManifestError, match="JSON object, got list"):
        ShardManifest.from_json([PARQUET_MANIFEST])
