"""The provider registers with Airflow, and this environment proves the Prefect split:
Prefect is not installed, yet the shard functions and the provider import and run."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

import pytest

PREFECT_FREE_MODULES = (
    "shardline.tasks", "shardline.tasks.engine_cache", "shardline.tasks.engine_client",
    "shardline.tasks.engine_service", "shardline.tasks.executor", "shardline.tasks.fingerprint", "shardline.tasks.job",
    "shardline.tasks.rows", "shardline.tasks.runner", "shardline.tasks.sample_data",
    "shardline.tasks.shard_job", "shardline.tasks.shard_reader", "shardline.tasks.shard_writer",
    "shardline.tasks.storage", "shardline.tasks.summary", "shardline.tasks.progress",
    "shardline.tasks.progress_report", "shardline.tasks.status", "shardline.engine.llm",
    "shardline.providers.airflow", "shardline.providers.airflow.connection",
    "shardline.providers.airflow.shard_batch", "shardline.providers.airflow.operator",
    "shardline.providers.airflow.listing", "shardline.providers.airflow.example_dags.shardline_batch",
)


def test_prefect_is_not_installed_here():
    assert importlib.util.find_spec("prefect") is None
    with pytest.raises(ModuleNotFoundError, match="prefect"):
        import prefect  # noqa: F401


@pytest.mark.parametrize("module", PREFECT_FREE_MODULES)
def test_prefect_free_modules_import_without_prefect(module):
    importlib.import_module(module)


def test_the_prefect_layer_needs_prefect():
    with pytest.raises(ModuleNotFoundError, match="prefect"):
        importlib.import_module("shardline.tasks.prefect_tasks")


def test_provider_is_registered_through_the_entry_point():
    [entry_point] = [ep for ep in importlib.metadata.entry_points(group="apache_airflow_provider")
                     if ep.value.startswith("shardline.")]
    assert entry_point.value == "shardline.providers.airflow:get_provider_info"
    from airflow.providers_manager import ProvidersManager

    provider = ProvidersManager().providers["shardline"]  # validated against Airflow's schema
    assert provider.version == importlib.metadata.version("shardline")
    [operators] = provider.data["operators"]
    for module in operators["python-modules"]:
        assert hasattr(importlib.import_module(module), "ShardInferenceOperator")
