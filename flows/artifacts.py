"""The flow's Prefect artifacts: a progress bar, a per-shard table, a markdown summary.

The progress artifact follows rows, not shards: it is a sink of the run's JobProgress
(tasks/progress.py), updated as rows finish but at most once per ARTIFACT_SECONDS, a
rate the Prefect API takes easily however fast rows finish. Artifact contents come
from tasks/summary.py and tasks/progress_report.py, which hold no credentials.
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

from shardline.tasks.progress import JobProgress, ProgressSnapshot
from shardline.tasks.progress_report import progress_line
from shardline.tasks.summary import SHARD_COLUMNS, summary_markdown

ARTIFACT_PREFIX = "batch-inference"
ARTIFACT_SECONDS = 10.0  # the least time between two updates of the progress artifact


class ProgressArtifact:
    """The run's progress artifact: percent of rows done (of shards finished until rows
    are known), with the progress line as its description. A JobProgress sink."""

    def __init__(self, progress: JobProgress, every_seconds: float = ARTIFACT_SECONDS) -> None:
        first = progress.snapshot()
        artifact_id = create_progress_artifact(progress=percent(first), key=f"{ARTIFACT_PREFIX}-progress",
                                               description=progress_line(first))
        # Prefect dispatches on the caller: from a sync flow it runs the call and returns the id.
        assert isinstance(artifact_id, UUID), f"create_progress_artifact returned {artifact_id!r}, not an id"
        self.artifact_id = artifact_id
        progress.add_sink(self, every_seconds)

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        update_progress_artifact(self.artifact_id, percent(snapshot), description=progress_line(snapshot))


def percent(snapshot: ProgressSnapshot) -> float:
    """0 to 100: rows done of rows expected, else shards finished of shards."""
    fraction = snapshot.fraction
    if fraction is None:
        fraction = snapshot.shards_finished / snapshot.shards_total if snapshot.shards_total else 1.0
    return round(100.0 * fraction, 2)


def publish_summary(summary: dict[str, Any]) -> None:
    """Publish the per-shard table and the markdown totals."""
    table = [{name: entry[name] for name in (*SHARD_COLUMNS, "message")} for entry in summary["shards"]]
    create_table_artifact(table=table, key=f"{ARTIFACT_PREFIX}-shards",
                          description=f"Per-shard results for {summary['output']}")
    create_markdown_artifact(markdown=summary_markdown(summary), key=f"{ARTIFACT_PREFIX}-summary",
                             description="Totals and tokens/s")
