"""What became of each shard, decided by its manifest: the summary's source of truth.

A shard task can fail after its output was committed: the reply to the manifest's
commit was lost in a store outage, or a later attempt failed where an earlier one
had succeeded. The manifest is the commit marker (tasks/shard_writer.py), so a
shard whose manifest matches the job is reported done, whatever its task said.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import PipelineError
from .job import BatchJob
from .shard_writer import completed_manifest
from .storage import Shard
from .summary import shard_entry

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


def _committed(shard: Shard, job: BatchJob) -> dict[str, Any] | None:
    try:
        return completed_manifest(shard, job)
    except PipelineError:
        return None  # the store is still failing: the shard stays failed, a rerun settles it
