"""What became of each shard, decided by its manifest: the summary's source of truth.

A shard task can fail after its output was committed: the reply to the manifest's
commit was lost in a store outage, or a later attempt failed where an earlier one
had succeeded. The manifest is the commit marker (tasks/shard_writer.py), so a
shard whose manifest matches the job is reported done, whatever its task said; and a
job's summary can be rebuilt from its manifests alone (``summary_from_manifests``).
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import PipelineError, redact_url
from .job import BatchJob
from .manifest import ShardManifest
from .shard_writer import completed_manifest
from .storage import Shard
from .summary import job_summary, shard_entry

logger = logging.getLogger("shardline.tasks.outcomes")


def settle_failed(entries: list[dict[str, Any]], shards: list[Shard], job: BatchJob) -> list[dict[str, Any]]:
    """``entries`` with every failed shard that has a committed manifest reported done
    (from that manifest, its task's error kept as a note); the others unchanged."""
    by_key = {shard.key: shard for shard in shards}
    settled = []
    for entry in entries:
        shard = by_key.get(entry["shard"])
        manifest = _committed(shard, job) if entry["status"] == "failed" and shard is not None else None
        if manifest is None:
            settled.append(entry)
            continue
        logger.warning("shard %s: its task failed (%s) but its output was committed; reported done",
                       entry["shard"], entry["message"])
        settled.append(shard_entry(entry["shard"], "done", manifest,
                                   message=f"committed; a later step failed: {entry['message']}"))
    return settled


def summary_from_manifests(shards: list[Shard], job: BatchJob) -> dict[str, Any]:
    """The job summary as the shards' committed manifests tell it, for an orchestrator whose
    shard tasks report one by one (Airflow): a shard without a manifest matching the job is
    failed. Raises PipelineError when the store cannot be read."""
    entries = []
    for shard in shards:
        manifest = completed_manifest(shard, job)
        entries.append(shard_entry(shard.key, "done", manifest) if manifest is not None else
                       shard_entry(shard.key, "failed", message="no output committed for this job"))
    return job_summary(entries, 0.0, redact_url(job.output))


def _committed(shard: Shard, job: BatchJob) -> ShardManifest | None:
    try:
        return completed_manifest(shard, job)
    except PipelineError:
        return None  # the store is still failing: the shard stays failed, a rerun settles it
