"""The flow's Prefect artifacts: a progress bar, a per-shard table, a markdown summary.

Artifact contents come from tasks/summary.py, which holds no credentials.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from shardline.tasks.summary import SHARD_COLUMNS, summary_markdown

ARTIFACT_PREFIX = "batch-inference"


class ShardProgress:
    """A progress artifact counting finished (done, skipped or failed) shards."""

    def __init__(self, total: int, finished: int = 0) -> None:
        self.total = total
        self.finished = finished
        artifact_id = create_progress_artifact(
            progress=self._percent(), key=f"{ARTIFACT_PREFIX}-progress", description=self._description()
        )
        # Prefect dispatches on the caller: from a sync flow it runs the call and returns the id.
        assert isinstance(artifact_id, UUID), f"create_progress_artifact returned {artifact_id!r}, not an id"
        self.artifact_id = artifact_id

    def advance(self) -> None:
        self.finished += 1
        update_progress_artifact(self.artifact_id, self._percent(), description=self._description())

    def _percent(self) -> float:
        return 100.0 if self.total == 0 else round(100.0 * self.finished / self.total, 2)

    def _description(self) -> str:
        return f"{self.finished} of {self.total} shard(s) finished"


def publish_summary(summary: dict[str, Any]) -> None:
    """Publish the per-shard table and the markdown totals."""
    table = [{name: entry[name] for name in (*SHARD_COLUMNS, "message")} for entry in summary["shards"]]
    create_table_artifact(table=table, key=f"{ARTIFACT_PREFIX}-shards",
                          description=f"Per-shard results for {summary['output']}")
    create_markdown_artifact(markdown=summary_markdown(summary), key=f"{ARTIFACT_PREFIX}-summary",
                             description="Totals and tokens/s")
