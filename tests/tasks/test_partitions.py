"""Partition selection and state, without Prefect: names, order, run records, plans."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from shardline.tasks.partitions import (
    PartitionSelection,
    PartitionStatus,
    Reprocess,
    partition_job,
    plan_partition,
    read_run_record,
    write_run_record,
)
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards


def test_a_date_range_names_one_partition_per_day_in_either_order():
    selection = PartitionSelection(start=dt.date(2026, 10, 30), end=dt.date(2026, 11, 2))
    assert selection.partitions() == ["date=2026-10-30", "date=2026-10-31", "date=2026-11-01", "date=2026-11-02"]
    assert selection.partitions(newest_first=True)[0] == "date=2026-11-02"
    nested = PartitionSelection(start="2026-11-01", template="{date:%Y/%m/%d}")
    assert nested.partitions() == ["2026/11/01"]
    assert PartitionSelection(names=["b", "a", "a/"]).partitions() == ["a", "b"]


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"names": ["a"], "start": "2026-11-01"}, "exactly one"),
    ({"start": "2026-11-02", "end": "2026-11-01"}, "before start"),
    ({"start": "2026-11-01", "template": "day={day}"}, "only {date}"),
])
def test_bad_selections_name_what_is_wrong(fields, message):
    with pytest.raises(ValidationError, match=message):
        PartitionSelection(**fields)


def test_status_comes_from_manifests_and_run_records(tmp_path, make_job):
    for day in ("01", "02", "03"):
        write_sample_dataset(str(tmp_path / "in" / f"date=2026-11-{day}"), num_shards=2, rows_per_shard=2)
    job = make_job()
    for shard in list_shards(partition_job(job, "date=2026-11-02").input):
        process_shard(shard, partition_job(job, "date=2026-11-02"))
    first = list_shards(partition_job(job, "date=2026-11-03").input)[0]
    process_shard(first, partition_job(job, "date=2026-11-03"))

    def plan(partition, reprocess="none"):
        return plan_partition(job, partition, Reprocess(reprocess))

    assert (plan("date=2026-11-01").status, plan("date=2026-11-01").run) == (PartitionStatus.NEVER_RUN, True)
    assert (plan("date=2026-11-02").status, plan("date=2026-11-02").run) == (PartitionStatus.COMPLETED, False)
    assert (plan("date=2026-11-03").status, plan("date=2026-11-03").run) == (PartitionStatus.FAILED, False)
    assert "1 of 2" in plan("date=2026-11-03").reason and "reprocess=none skips" in plan("date=2026-11-03").reason
    assert plan("date=2026-11-03", "failed").run and not plan("date=2026-11-02", "failed").run
    assert plan("date=2026-11-02", "completed").run
    assert (plan("date=2026-11-09", "completed").status, plan("date=2026-11-09", "completed").run) == \
        (PartitionStatus.NO_INPUT, False)

    write_run_record(job, "date=2026-11-01", "failed")  # a run where no shard got through
    assert plan("date=2026-11-01").status == PartitionStatus.FAILED
    assert "last run failed" in plan("date=2026-11-01").reason
    other_model_job = make_job(sampling={"max_tokens": 3, "temperature": 0.0})
    assert read_run_record(other_model_job, "date=2026-11-01") is None  # another job's record is ignored


def test_last_days_counts_back_from_the_scheduled_date():
    selection = PartitionSelection(last_days=3)
    assert selection.partitions(today=dt.date(2026, 11, 2)) == [
        "date=2026-10-30", "date=2026-10-31", "date=2026-11-01"]
    with pytest.raises(ValidationError, match="exactly one"):
        PartitionSelection(last_days=3, names=["a"])
