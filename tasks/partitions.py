"""Backfills over a partitioned dataset, as plain functions: which partitions, in what
state, and which of them a backfill runs (no Prefect; an Airflow DAG can reuse them).

A partition is a sub-prefix of the job's input, e.g. ``date=2026-11-01``: its shards
are read from ``<input>/<partition>`` and written to ``<output>/<partition>``.

State comes from storage, not from an orchestrator's database:
- completed: every input shard has a manifest matching the job (shard_writer);
- failed (or incomplete): not completed, and either some shards are done or a run
  record says an earlier run for this job started, failed or was interrupted;
- never run: no shard done and no run record.
Run records live at ``<output>/_backfill/<partition>.json`` (outside every partition's
output; a leading underscore is never read as a shard) and name the job by a digest
of its fields without input/output, so a record of another job's run is ignored.

Reprocess behaviour follows Airflow 3 backfills: ``none`` runs only never-run
partitions, ``failed`` also failed or incomplete ones, ``completed`` every partition.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .job import BatchJob
from .shard_writer import completed_manifest
from .storage import NoShardsFound, filesystem, join, list_shards, retry_storage, write_atomic

RECORDS_DIR = "_backfill"


class Reprocess(str, enum.Enum):
    """Which partitions a backfill runs besides never-run ones (Airflow 3's reprocess_behavior)."""

    NONE = "none"
    FAILED = "failed"
    COMPLETED = "completed"


class PartitionStatus(str, enum.Enum):
    NEVER_RUN = "never-run"
    FAILED = "failed"
    COMPLETED = "completed"
    NO_INPUT = "no-input"


class PartitionError(ValueError):
    """A partition selection that names no partition, or names them two ways."""


@dataclass(frozen=True)
class PartitionPlan:
    """One partition of a backfill: its state before the run, whether it runs, and why."""

    partition: str
    status: PartitionStatus
    run: bool
    reason: str

    def as_row(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value, "action": "run" if self.run else "skip"}


def date_partitions(start: dt.date, end: dt.date, template: str = "date={date:%Y-%m-%d}") -> list[str]:
    """One partition name per day from ``start`` to ``end`` inclusive, oldest first."""
    if end < start:
        raise PartitionError(f"end date {end} is before start date {start}")
    try:
        names = [template.format(date=start + dt.timedelta(days=n)) for n in range((end - start).days + 1)]
    except (KeyError, IndexError, ValueError) as exc:
        raise PartitionError(f"partition template {template!r} must use only {{date}} "
                             f"(e.g. 'date={{date:%Y-%m-%d}}'): {exc}") from exc
    return names


def order_partitions(partitions: list[str], newest_first: bool) -> list[str]:
    """Partitions sorted by name (ISO dates sort by time), newest first on request; no duplicates."""
    unique = sorted(set(p.strip("/") for p in partitions))
    if not unique or not all(unique):
        raise PartitionError(f"no partition selected (got {partitions!r})")
    return unique[::-1] if newest_first else unique


def partition_job(job: BatchJob, partition: str) -> BatchJob:
    """``job`` narrowed to one partition's input and output prefixes."""
    return job.model_copy(update={"input": join(job.input, partition), "output": join(job.output, partition)})


def job_digest(job: BatchJob) -> str:
    """What a run record names: the job without its input and output prefixes."""
    fields = {k: v for k, v in job.public_fields().items() if k not in ("input", "output")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_uri(job: BatchJob, partition: str) -> str:
    return join(job.output, RECORDS_DIR, f"{partition.strip('/')}.json")


def read_run_record(job: BatchJob, partition: str) -> dict[str, Any] | None:
    """The partition's last run record for this job, or None."""
    fs, path = filesystem(record_uri(job, partition), job.storage())
    try:
        record = json.loads(retry_storage(lambda: fs.cat_file(path), "read", record_uri(job, partition), fs))
    except FileNotFoundError:
        return None
    return record if record.get("job_digest") == job_digest(job) else None


def write_run_record(job: BatchJob, partition: str, state: str, **details: Any) -> dict[str, Any]:
    """Record that a run of ``job`` over ``partition`` is ``state`` (running, completed, failed)."""
    record = {"partition": partition, "state": state, "job_digest": job_digest(job),
              "at": dt.datetime.now(dt.timezone.utc).isoformat(), **details}
    write_atomic(record_uri(job, partition), json.dumps(record, indent=2).encode(), job.storage())
    return record


def partition_status(job: BatchJob, partition: str) -> tuple[PartitionStatus, str]:
    """The partition's state for ``job`` and a one-line reason."""
    part = partition_job(job, partition)
    try:
        shards = list_shards(part.input, part.storage(), part.input_format.value, exclude=part.output)
    except NoShardsFound:
        return PartitionStatus.NO_INPUT, f"no shards under {part.input}"
    done = sum(completed_manifest(shard, part) is not None for shard in shards)
    if done == len(shards):
        return PartitionStatus.COMPLETED, f"all {done} shard(s) have manifests matching the job"
    record = read_run_record(job, partition)
    if record is not None:
        return PartitionStatus.FAILED, (f"last run {record['state']} at {record['at']}; "
                                        f"{done} of {len(shards)} shard(s) done")
    if done:
        return PartitionStatus.FAILED, f"incomplete: {done} of {len(shards)} shard(s) done"
    return PartitionStatus.NEVER_RUN, f"never run: 0 of {len(shards)} shard(s) done"


_RUNS = {
    Reprocess.NONE: {PartitionStatus.NEVER_RUN},
    Reprocess.FAILED: {PartitionStatus.NEVER_RUN, PartitionStatus.FAILED},
    Reprocess.COMPLETED: {PartitionStatus.NEVER_RUN, PartitionStatus.FAILED, PartitionStatus.COMPLETED},
}


def plan_partition(job: BatchJob, partition: str, reprocess: Reprocess) -> PartitionPlan:
    """Whether a backfill with ``reprocess`` runs ``partition``, and why."""
    status, reason = partition_status(job, partition)
    run = status in _RUNS[Reprocess(reprocess)]
    if not run and status != PartitionStatus.NO_INPUT:
        reason += f"; reprocess={Reprocess(reprocess).value} skips {status.value} partitions"
    return PartitionPlan(partition, status, run, reason)


class PartitionSelection(BaseModel):
    """Which partitions a backfill covers: a date range, or explicit partition names."""

    model_config = ConfigDict(extra="forbid")

    start: dt.date | None = Field(default=None, description="First date of the range (inclusive).")
    end: dt.date | None = Field(default=None, description="Last date of the range (inclusive); defaults to start.")
    template: str = Field(default="date={date:%Y-%m-%d}", description="Partition name of a date, a Python format "
                          "string over {date}, e.g. 'date={date:%Y-%m-%d}' or '{date:%Y/%m/%d}'.")
    names: list[str] = Field(default_factory=list, description="Explicit partitions instead of a date range, "
                             "e.g. ['region=eu', 'region=us'].")
    last_days: int | None = Field(default=None, ge=1, le=3660, description="Instead of start/end: the N days before "
                                  "the run's scheduled date (3: the three days up to yesterday), for schedules.")

    @model_validator(mode="after")
    def _one_way(self) -> PartitionSelection:
        ways = [self.start is not None, bool(self.names), self.last_days is not None]
        if sum(ways) != 1:
            raise ValueError("give exactly one of: a date range (start, end), last_days, or partition names")
        if self.end is not None and self.start is None:
            raise ValueError("end needs a start date")
        self.partitions(today=dt.date(2000, 1, 1))  # a bad template or empty range fails here, as validation
        return self

    def partitions(self, newest_first: bool = False, today: dt.date | None = None) -> list[str]:
        """The selected partition names, oldest (or newest) first; ``last_days`` counts back from ``today``."""
        if self.start is not None:
            names = date_partitions(self.start, self.end or self.start, self.template)
        elif self.last_days is not None:
            today = today or dt.datetime.now(dt.timezone.utc).date()
            names = date_partitions(today - dt.timedelta(days=self.last_days), today - dt.timedelta(days=1),
                                    self.template)
        else:
            names = list(self.names)
        return order_partitions(names, newest_first)
