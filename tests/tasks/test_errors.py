"""The error taxonomy: real failures of real libraries sorted into transient, permanent
and engine errors, and messages that name the operation and the object, never a secret."""

from __future__ import annotations

import socket
import time

import pytest

from shardline.tasks.errors import ErrorKind, PipelineError, StorageError, classify, redact, secret_values
from shardline.tasks.retrying import StorageRetry
from shardline.tasks.storage import list_shards


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_store_is_transient_and_retried_for_the_budget_then_named(monkeypatch):
    """botocore's EndpointConnectionError (not an OSError) is transient: retried, then one line."""
    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "3")
    options = {"key": "AKIAEXAMPLEKEY", "secret": "an-unreachable-SECRET-value", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_closed_port()}"}}
    started = time.monotonic()
    with pytest.raises(StorageError) as raised:
        list_shards("s3://bucket/prompts", options)
    elapsed = time.monotonic() - started
    error = raised.value
    assert error.kind is ErrorKind.TRANSIENT and 3 <= elapsed < 40  # the budget plus one attempt (botocore retries too)
    assert str(error).startswith("list s3://bucket/prompts failed: EndpointConnectionError")
    assert "\n" not in str(error) and "SHARDLINE_STORAGE_RETRY_SECONDS" in str(error)
    assert "SECRET" not in str(error) and "AKIAEXAMPLEKEY" not in str(error)
    assert classify(error.__cause__) is ErrorKind.TRANSIENT


def test_library_and_python_errors_are_sorted_by_kind():
    from botocore.exceptions import ClientError, ConnectionClosedError, NoCredentialsError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert classify(client_error("SlowDown", 503)) is ErrorKind.TRANSIENT
    assert classify(client_error("InternalError", 500)) is ErrorKind.TRANSIENT
    assert classify(client_error("AccessDenied", 403)) is ErrorKind.PERMANENT
    assert classify(client_error("NoSuchBucket", 404)) is ErrorKind.PERMANENT
    assert classify(ConnectionClosedError(endpoint_url="http://x")) is ErrorKind.TRANSIENT
    assert classify(NoCredentialsError()) is ErrorKind.PERMANENT
    translated = OSError(16, "Please reduce your request rate.")  # s3fs's SlowDown, caused by the ClientError
    translated.__cause__ = client_error("SlowDown", 503)
    assert classify(translated) is ErrorKind.TRANSIENT
    assert classify(PermissionError("Access Denied.")) is ErrorKind.PERMANENT
    assert classify(EOFError("Compressed file ended")) is ErrorKind.PERMANENT
    assert classify(ConnectionResetError()) is ErrorKind.TRANSIENT and classify(TimeoutError()) is ErrorKind.TRANSIENT
    assert classify(MemoryError()) is ErrorKind.ENGINE
    assert classify(TypeError("a bug")) is ErrorKind.PERMANENT
    from ray.exceptions import WorkerCrashedError

    assert classify(WorkerCrashedError()) is ErrorKind.ENGINE  # a worker that died: the shard may run again


def test_messages_are_one_line_and_carry_no_secret():
    options = {"key": "AKIA-visible-id", "secret": "s3cr3t/value", "client_kwargs": {"endpoint_url": "http://x"}}
    secrets = secret_values(options)
    assert set(secrets) == {"AKIA-visible-id", "s3cr3t/value"}
    text = redact("signature for s3cr3t/value at s3://user:pw@bucket/key by AKIA-visible-id", secrets)
    assert text == "signature for *** at s3://bucket/key by ***"
    error = PipelineError("write", "s3://user:pw@bucket/out/a.parquet", "Access Denied.\n  (403)")
    assert str(error) == "write s3://bucket/out/a.parquet failed: Access Denied. (403)"


def test_the_retry_budget_is_minutes_by_default():
    assert StorageRetry().total_seconds >= 120
