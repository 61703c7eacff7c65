"""The backfill flow: batch_inference over several dataset partitions, one subflow each.

Each partition reads ``<input>/<partition>`` and writes ``<output>/<partition>``;
partitions already done are skipped shard by shard, through their manifests.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from shardline.tasks.job import BatchJob
from shardline.tasks.storage import join
from shardline.tasks.summary import ShardsFailed

from .batch_inference import batch_inference


@flow(name="backfill", description="Run batch inference over dataset partitions (e.g. dates), one subflow each.")
def backfill(job: BatchJob, partitions: list[str]) -> dict[str, Any]:
    """Run ``job`` once per partition; return each partition's summary (or failure).

    Args:
        job: the batch job; its input and output are the partitions' parent prefixes.
        partitions: partition paths under input and output, e.g. ["date=2025-01-01"].
    """
    logger = get_run_logger()
    results: dict[str, Any] = {}
    for partition in partitions:
        part_job = job.model_copy(update={"input": join(job.input, partition), "output": join(job.output, partition)})
        state = batch_inference.with_options(flow_run_name=f"batch-inference-{partition}")(
            part_job, return_state=True)
        outcome = state.result(raise_on_failure=False)
        if isinstance(outcome, ShardsFailed):
            results[partition] = outcome.summary
        elif isinstance(outcome, BaseException):
            logger.error("partition %s failed: %s", partition, outcome)
            results[partition] = {"error": f"{type(outcome).__name__}: {outcome}"}
        else:
            results[partition] = outcome
    failed = [p for p, r in results.items() if "error" in r or r["totals"]["failed"]]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(partitions)} partition(s) had failures: {', '.join(failed)}")
    return results
