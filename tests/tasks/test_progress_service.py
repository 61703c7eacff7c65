"""Progress through the host's engine service: rows reported across the socket as they
finish, and the service's engine load read back."""

from __future__ import annotations

import os
import signal
import tempfile

from shardline import SamplingParams
from shardline.tasks import engine_cache
from shardline.tasks.engine_cache import EngineHost
from shardline.tasks.engine_client import ServiceClient, _is_engine_service
from shardline.tasks.executor import RowDone, RowRequest

from ..waiting import wait_for


def test_the_service_reports_each_row_and_its_engine_load(monkeypatch, tiny_model):
    monkeypatch.setenv("SHARDLINE_RUNTIME_DIR", tempfile.mkdtemp(prefix="sl-run-"))  # short: socket paths
    client = engine_cache.get_executor(tiny_model, EngineHost.SERVICE, max_num_seqs=4)
    assert isinstance(client, ServiceClient)
    pid = client.service_info()["pid"]
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        rows = [RowRequest(index, f"Row {index} says" if index != 5 else "x" * 5000, None, params)
                for index in range(9)]  # row 5 is longer than the model takes: an error row
        seen: list[RowDone] = []
        results = client.run_shard("shard-a", rows, on_row=seen.append)
        assert sorted(done.index for done in seen) == list(range(9))  # each row once, all before the return
        by_index = {done.index: done for done in seen}
        assert [by_index[r.index].failed for r in results] == [r.error is not None for r in results]
        assert by_index[5].failed and by_index[5].completion_tokens == 0
        assert [by_index[r.index].completion_tokens for r in results if r.output is not None] == \
            [len(r.output.outputs[0].token_ids) for r in results if r.output is not None]
        reading = client.engine_reading()
        assert reading is not None and reading.stats.num_running == reading.stats.num_waiting == 0
        assert reading.stats.num_steps >= 4 and reading.stats.kv_cache_usage == 0.0 and reading.idle_seconds >= 0
    finally:
        engine_cache.close_engines()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not _is_engine_service(pid), "the service to retire")
