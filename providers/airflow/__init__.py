"""shardline's Airflow provider: the shard jobs of ``batch_inference`` as Airflow tasks.

``list_shards`` (a TaskFlow task) lists a job's input shards; ``ShardInferenceOperator``,
mapped over them with ``.expand``, runs each through this process's engine with the
same BatchJob parameters, outputs and manifests as the Prefect flow; ``batch_usage``
ends the job with its usage (``_batch.json`` and XCom). Storage credentials come from
an Airflow connection (``storage_conn_id``).

Airflow's ProvidersManager loads ``get_provider_info`` through the
``apache_airflow_provider`` entry point. Everything else is resolved on first use,
so importing this package needs neither Airflow nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names __getattr__ resolves, for type checkers
    from shardline.providers.airflow.connection import storage_options_from_connection
    from shardline.providers.airflow.listing import list_shards
    from shardline.providers.airflow.operator import ShardInferenceOperator
    from shardline.providers.airflow.shard_batch import ShardBatch
    from shardline.providers.airflow.usage import batch_usage

_EXPORTS = {
    "ShardInferenceOperator": "shardline.providers.airflow.operator",
    "list_shards": "shardline.providers.airflow.listing",
    "storage_options_from_connection": "shardline.providers.airflow.connection",
    "ShardBatch": "shardline.providers.airflow.shard_batch",
    "batch_usage": "shardline.providers.airflow.usage",
}

# _EXPORTS' names and get_provider_info, sorted (a literal, so type checkers read it).
__all__ = ["ShardBatch", "ShardInferenceOperator", "batch_usage", "get_provider_info", "list_shards",
           "storage_options_from_connection"]


def get_provider_info() -> dict[str, Any]:
    """The provider's description, in the form of Airflow's provider_info schema."""
    from shardline import __version__

    integration = "shardline"
    return {
        "package-name": "shardline",
        "name": "shardline",
        "description": "Offline batch LLM inference over prompt shards in object storage, one ordered "
                       "output shard and manifest per input shard, resumable.",
        "versions": [__version__],
        "integrations": [{"integration-name": integration, "tags": ["ai", "ml"]}],
        "operators": [{"integration-name": integration,
                       "python-modules": ["shardline.providers.airflow.operator"]}],
    }


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.providers.airflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
