"""The pipeline's error taxonomy: transient, permanent and engine failures, one line each.

Every failure the pipeline reports is a ``PipelineError``: it names the operation
(read, write, list, load, run, check), the object (a shard key, a URL with any
``user:password@`` removed, a model) and the reason, and carries its ``kind``:

- transient: the store or the network may recover (connection refused or reset,
  timeouts, throttling, 5xx). Retried where it happens, with backoff and jitter,
  for a configurable total time (tasks/retrying.py).
- permanent: a retry cannot help (permission denied, no such bucket or key,
  invalid credentials, corrupt input, a bad job). Never retried.
- engine: the engine could not load the model or run a batch (out of memory, a
  driver that died). A shard task may be retried once for these.

``classify`` sorts any exception (Python's, botocore's, aiohttp's, s3fs's
translations) into these kinds; it never imports botocore or aiohttp itself: an
exception of a library that was never imported cannot have been raised.
"""

from __future__ import annotations

import enum
import errno
import gzip
import re
import sys
import zlib
from collections.abc import Iterable
from typing import Any

_URL_USERINFO = re.compile(r"([a-zA-Z][\w+.-]*://)[^/@\s]*@")
# S3 error codes that a retry may fix (throttling, the server's own trouble).
_TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "SlowDown", "RequestTimeout", "RequestTimeoutException",
    "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException", "InternalError",
    "ServiceUnavailable", "OperationAborted", "ProvisionedThroughputExceededException",
})
# errno values whose failure is in the request, not in the moment.
_PERMANENT_ERRNOS = frozenset({
    errno.EINVAL, errno.ENOSYS, errno.EMSGSIZE, errno.ENAMETOOLONG, errno.EPERM, errno.EACCES,
    errno.ENOTEMPTY, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR,
})
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# Storage option names whose values are credentials (s3fs, gcsfs, adlfs, ...).
_SECRET_OPTION = re.compile(r"key|secret|token|password|credential|sas|signature", re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_KEY",
               "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING")


class ErrorKind(str, enum.Enum):
    """How a failure is handled: retried in place, never retried, or an engine failure."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"
    ENGINE = "engine"


class PipelineError(Exception):
    """One failure, as one line: ``<operation> <object> failed: <reason>``.

    ``task_retry`` says whether the shard task may be run again for it: only an
    engine that failed (never a write: the engine's results would be recomputed;
    never a permanent error)."""

    kind: ErrorKind = ErrorKind.PERMANENT
    task_retry: bool = False
    # The longest reason kept (one_line cuts the rest).
    reason_limit: int = 400

    def __init__(self, operation: str, target: str, reason: str, kind: ErrorKind | None = None) -> None:
        self.operation = operation
        self.target = redact_url(target)
        self.reason = one_line(reason, self.reason_limit)
        if kind is not None:
            self.kind = ErrorKind(kind)
        super().__init__(f"{operation} {self.target} failed: {self.reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # Prefect and Ray pickle task exceptions
        return (_rebuild, (type(self), self.operation, self.target, self.reason, self.kind))


def _rebuild(cls: type, operation: str, target: str, reason: str, kind: ErrorKind) -> PipelineError:
    return cls(operation, target, reason, kind)


class JobError(PipelineError):
    """The job itself is invalid (a field, an option): permanent, reported before any shard."""


class EngineError(PipelineError):
    """The engine could not load or run; the shard task may be retried once."""

    kind = ErrorKind.ENGINE
    task_retry = True


class ModelUnusable(EngineError):
    """The model cannot be loaded at all (no config, no tokenizer, an unsupported
    architecture): an engine error that no retry fixes."""

    task_retry = False
    # The engine's refusal of a model explains it in a few sentences, ending with what
    # would run: kept whole.
    reason_limit = 2000


def redact_url(url: str) -> str:
    """``url`` without any ``user:password@`` part (anywhere in the text)."""
    return _URL_USERINFO.sub(r"\1", url)


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def secret_values(storage_options: dict[str, Any] | None, environ: dict[str, str] | None = None) -> list[str]:
    """Every credential string in ``storage_options`` (by option name, nested too) and in
    the standard credential environment variables: what no message may contain."""
    found: list[str] = []

    def walk(options: Any, name: str = "") -> None:
        if isinstance(options, dict):
            for key, value in options.items():
                walk(value, str(key))
        elif isinstance(options, str) and _SECRET_OPTION.search(name) and len(options) >= 4:
            found.append(options)

    walk(storage_options or {})
    if environ is not None:
        found += [environ[name] for name in _SECRET_ENV if len(environ.get(name) or "") >= 4]
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced by ``***`` and URLs' user info removed."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return redact_url(text)


def describe(exc: BaseException) -> str:
    """A short reason for ``exc``: its type and the first line of its message."""
    message = one_line(str(exc), limit=300) or "(no message)"
    return f"{type(exc).__name__}: {message}"


def classify(exc: BaseException) -> ErrorKind:
    """Which kind of failure ``exc`` is (see the module docstring)."""
    if isinstance(exc, PipelineError):
        return exc.kind
    library = _library_kind(exc)
    if library is not None:
        return library
    if isinstance(exc, (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError)):
        return ErrorKind.PERMANENT  # a corrupt or truncated object stays so
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return ErrorKind.ENGINE
    if isinstance(exc, _PERMANENT_TYPES):
        return ErrorKind.PERMANENT
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return ErrorKind.TRANSIENT
    if isinstance(exc, OSError):
        cause = exc.__cause__
        if cause is not None and cause is not exc:
            cause_kind = _library_kind(cause)
            if cause_kind is not None:
                return cause_kind
        return ErrorKind.PERMANENT if exc.errno in _PERMANENT_ERRNOS else ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


def _library_kind(exc: BaseException) -> ErrorKind | None:
    """The kind of a botocore, aiohttp, Ray or fsspec exception; None for anything else.

    The libraries are looked up among the loaded modules (an exception of one that is
    not loaded cannot occur), so their classes are untyped here and the attributes of
    their exceptions are read with getattr."""
    fsspec_exceptions = sys.modules.get("fsspec.exceptions")
    if fsspec_exceptions is not None and isinstance(exc, fsspec_exceptions.FSTimeoutError):
        return ErrorKind.TRANSIENT
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        if isinstance(exc, botocore.ClientError):
            return _client_error_kind(getattr(exc, "response", None))
        if isinstance(exc, (botocore.NoCredentialsError, botocore.PartialCredentialsError,
                            botocore.NoRegionError, botocore.ParamValidationError)):
            return ErrorKind.PERMANENT
        if isinstance(exc, (botocore.HTTPClientError, botocore.ConnectionError, botocore.IncompleteReadError,
                            botocore.ResponseStreamingError)):
            return ErrorKind.TRANSIENT  # EndpointConnectionError, ConnectionClosedError, timeouts
    ray = sys.modules.get("ray.exceptions")
    if ray is not None and isinstance(exc, ray.RayError):
        cause = getattr(exc, "cause", None)
        if isinstance(exc, ray.RayTaskError) and isinstance(cause, BaseException) and cause is not exc:
            return classify(cause)  # the task's own exception, carried across
        return ErrorKind.ENGINE  # a worker, node or object lost: the shard may run again elsewhere
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        if isinstance(exc, aiohttp.ClientResponseError):
            status: int = getattr(exc, "status", 0)
            return ErrorKind.TRANSIENT if status >= 500 or status == 429 else ErrorKind.PERMANENT
        return ErrorKind.TRANSIENT  # connection refused or reset, server disconnected, payload cut
    return None


def _client_error_kind(response: dict[str, Any] | None) -> ErrorKind:
    response = response or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in _TRANSIENT_CODES or status >= 500 or status == 429:
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


class StorageError(PipelineError):
    """A storage operation (list, read, write, delete) failed; transient or permanent."""


class StorageNotFound(StorageError, FileNotFoundError):
    """The object or bucket does not exist (permanent); still a FileNotFoundError."""


class StorageDenied(StorageError, PermissionError):
    """Access denied or invalid credentials (permanent); still a PermissionError."""


class NoShardsFound(StorageError):
    """The input prefix or glob holds no shard (permanent)."""


def storage_error(operation: str, target: str, exc: BaseException, secrets: Iterable[str] = (),
                  note: str = "") -> StorageError:
    """The StorageError for ``exc`` raised while doing ``operation`` on ``target``."""
    kind = classify(exc)
    reason = redact(describe(exc), secrets) + (f" ({note})" if note else "")
    if isinstance(exc, FileNotFoundError):
        return StorageNotFound(operation, target, reason, kind)
    if isinstance(exc, PermissionError):
        return StorageDenied(operation, target, reason, kind)
    return StorageError(operation, target, reason, kind)
