"""Shards on a real S3 server (SeaweedFS): storage_options and the AWS environment variables."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest

from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_job import process_shard
from shardline.tasks.shard_writer import shard_is_done
from shardline.tasks.storage import filesystem, list_shards


def test_list_run_and_commit_with_storage_options(s3_server, make_job):
    prefix = s3_server.new_prefix()
    options = s3_server.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=2, rows_per_shard=3, storage_options=options)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options)
    shards = list_shards(job.input, options)
    assert [(s.key, s.format) for s in shards] == [("part-00000", "parquet"), ("part-00001", "jsonl")]
    for shard in shards:
        manifest = process_shard(shard, job)
        assert manifest.output == f"s3://{prefix}/out/{shard.key}.parquet"
        assert shard_is_done(shard, job)
    fs, _ = filesystem(job.output, options)
    fs.invalidate_cache()
    assert sorted(fs.find(f"{prefix}/out")) == [  # no temporary objects left behind
        f"{prefix}/out/_manifests/part-00000.json", f"{prefix}/out/_manifests/part-00001.json",
        f"{prefix}/out/part-00000.parquet", f"{prefix}/out/part-00001.parquet"]
    table = pq.read_table(io.BytesIO(fs.cat_file(f"{prefix}/out/part-00000.parquet")))
    assert table.num_rows == 4 and table.column("error").null_count == 3  # one bad row per early shard
    manifest_text = fs.cat_file(f"{prefix}/out/_manifests/part-00000.json").decode()
    assert s3_server.secret_key not in manifest_text and s3_server.access_key not in manifest_text
    assert json.loads(manifest_text)["rows"] == 4


def test_aws_environment_variables_reach_the_server(s3_server, make_job, monkeypatch):
    prefix = s3_server.new_prefix()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=1, rows_per_shard=2,
                         storage_options=s3_server.storage_options())
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out")  # no storage_options at all
    [shard] = list_shards(job.input, {"skip_instance_cache": True})
    process_shard(shard, job)
    assert shard_is_done(shard, job)


def test_wrong_credentials_fail_clearly(s3_server):
    prefix = s3_server.new_prefix()
    options = {**s3_server.storage_options(), "secret": "wrong-secret", "skip_instance_cache": True}
    with pytest.raises(PermissionError, match="signature"):
        list_shards(f"s3://{prefix}/in", options)
