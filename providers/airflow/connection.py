"""fsspec storage options from an Airflow connection.

Credentials live where Airflow keeps them (its connections, a secrets backend, an
``AIRFLOW_CONN_<ID>`` variable), never in DAG code. An AWS-style connection (type
``aws`` or ``s3``) maps as the Amazon provider reads it:

    login                   -> key
    password                -> secret
    extra.aws_session_token -> token
    extra.endpoint_url      -> client_kwargs.endpoint_url   (MinIO, SeaweedFS, R2, ...)
    extra.region_name       -> client_kwargs.region_name

A connection of any type may also hold ``extra.storage_options``, an object passed to
fsspec as it is (for gs://, az://, ...); it is merged last.
"""

from __future__ import annotations

from typing import Any

AWS_CONNECTION_TYPES = ("aws", "s3")
_CLIENT_KWARGS = ("endpoint_url", "region_name")


class StorageConnectionError(ValueError):
    """A connection that cannot be turned into fsspec storage options."""


def storage_options_from_connection(connection: Any) -> dict[str, Any]:
    """fsspec storage options for an Airflow ``Connection`` (see the module docstring)."""
    extra = connection.extra_dejson
    extra_options = extra.get("storage_options", {})
    if not isinstance(extra_options, dict):
        raise StorageConnectionError(
            f"connection {connection.conn_id!r}: extra.storage_options must be an object, "
            f"not {type(extra_options).__name__}")
    if connection.conn_type not in AWS_CONNECTION_TYPES:
        if "storage_options" not in extra:
            raise StorageConnectionError(
                f"connection {connection.conn_id!r} has type {connection.conn_type!r}; accepted: "
                f"{' or '.join(AWS_CONNECTION_TYPES)}, or any type whose extra holds a storage_options object")
        return dict(extra_options)
    options: dict[str, Any] = {}
    if connection.login:
        options["key"] = connection.login
    if connection.password:
        options["secret"] = connection.password
    if extra.get("aws_session_token"):
        options["token"] = extra["aws_session_token"]
    client_kwargs = {name: extra[name] for name in _CLIENT_KWARGS if extra.get(name)}
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return {**options, **extra_options}


def get_storage_options(conn_id: str | None) -> dict[str, Any]:
    """The storage options of Airflow connection ``conn_id``; none without a connection."""
    if not conn_id:
        return {}
    from airflow.sdk import BaseHook

    return storage_options_from_connection(BaseHook.get_connection(conn_id))
