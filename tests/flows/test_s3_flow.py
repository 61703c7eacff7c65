"""The flow over a real S3 server; credentials given in storage_options never appear
in logs, manifests, artifacts or the stored flow parameters."""

from __future__ import annotations

import logging

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.sample_data import write_rows, write_sample_dataset
from shardline.tasks.storage import filesystem

from .helpers import everything_as_text, flow_run_record


def test_credentials_in_storage_options_never_leak(s3_server, make_job, caplog, capfd):
    # Everything at INFO, shardline's own loggers at DEBUG. (botocore's DEBUG log shows the
    # access key id in request headers: that is the library's debug trace, off by default.)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="shardline")
    prefix = s3_server.new_prefix()
    options = s3_server.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=3, rows_per_shard=3, storage_options=options)
    write_rows(f"s3://{prefix}/in/zz-bad.jsonl", [{"no_prompt": 1}], options)  # a failing shard logs an error too
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options)
    state = batch_inference(job, return_state=True)
    assert state.is_failed()
    summary = state.result(raise_on_failure=False).summary
    assert summary["totals"]["done"] == 3 and summary["totals"]["failed"] == 1

    fs, _ = filesystem(job.output, options)
    fs.invalidate_cache()
    manifests = [fs.cat_file(path).decode() for path in fs.find(f"{prefix}/out/_manifests")]
    assert len(manifests) == 3
    record = flow_run_record(state.state_details.flow_run_id)
    assert set(record["artifacts"]) >= {"batch-inference-shards", "batch-inference-summary",
                                        "batch-inference-progress"}
    assert any("zz-bad" in line for line in record["logs"])
    captured = capfd.readouterr()
    haystacks = {
        "prefect logs, artifacts and parameters": everything_as_text(record),
        "manifests": "\n".join(manifests),
        "python logging": caplog.text,
        "stdout/stderr": captured.out + captured.err,
        "summary": repr(summary),
    }
    for where, text in haystacks.items():
        assert s3_server.secret_key not in text, f"the secret key leaked into {where}"
        assert s3_server.access_key not in text, f"the access key leaked into {where}"
    assert record["parameters"]["job"]["storage_options"] == "**********"
