"""Storage options come from an Airflow connection (here an AIRFLOW_CONN_* variable)."""

from __future__ import annotations

import json

import pytest

from shardline.providers.airflow.connection import StorageConnectionError, get_storage_options


def _set_connection(monkeypatch, conn_id: str, connection: dict) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))


def test_aws_connection_becomes_s3fs_options(monkeypatch):
    _set_connection(monkeypatch, "object_store", {
        "conn_type": "aws", "login": "access-key-id", "password": "secret-access-key",
        "extra": {"endpoint_url": "http://127.0.0.1:8333", "region_name": "eu-west-1",
                  "aws_session_token": "session-token"}})
    assert get_storage_options("object_store") == {
        "key": "access-key-id", "secret": "secret-access-key", "token": "session-token",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333", "region_name": "eu-west-1"}}


def test_extra_storage_options_pass_through_for_any_filesystem(monkeypatch):
    _set_connection(monkeypatch, "gcs_store", {
        "conn_type": "google_cloud_platform", "extra": {"storage_options": {"token": "/keys/sa.json"}}})
    assert get_storage_options("gcs_store") == {"token": "/keys/sa.json"}
    _set_connection(monkeypatch, "s3_anon", {"conn_type": "aws", "extra": {"storage_options": {"anon": True}}})
    assert get_storage_options("s3_anon") == {"anon": True}


def test_unusable_connections_are_refused_by_name(monkeypatch):
    _set_connection(monkeypatch, "a_database", {"conn_type": "postgres", "login": "u", "password": "p"})
    with pytest.raises(StorageConnectionError, match="'a_database' has type 'postgres'; accepted: aws or s3"):
        get_storage_options("a_database")
    _set_connection(monkeypatch, "bad_extra", {"conn_type": "aws", "extra": {"storage_options": "anon"}})
    with pytest.raises(StorageConnectionError, match="storage_options must be an object"):
        get_storage_options("bad_extra")


def test_no_connection_means_no_storage_options():
    assert get_storage_options(None) == {}
