"""The shard functions run where Prefect cannot be imported (an Airflow environment)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_plain_shard_functions_import_and_run_without_prefect(tmp_path, tiny_model):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["prefect"] = None  # any `import prefect` now raises ImportError
        from shardline.tasks import BatchJob, list_shards, process_shard, shard_is_done
        from shardline.tasks import engine_cache, fingerprint, rows, runner, sample_data, shard_reader
        from shardline.tasks import shard_writer, storage, summary
        sample_data.write_sample_dataset({str(tmp_path / 'in')!r}, num_shards=2, rows_per_shard=2)
        job = BatchJob(input={str(tmp_path / 'in')!r}, output={str(tmp_path / 'out')!r}, model={tiny_model!r},
                       sampling={{"max_tokens": 2}})
        for shard in list_shards(job.input):
            process_shard(shard, job)
            assert shard_is_done(shard, job)
        engine_cache.close_engines()
        assert not [name for name in sys.modules if name.startswith("prefect") and sys.modules[name]]
        try:  # the block works: the Prefect wrappers cannot be imported here
            import shardline.tasks.prefect_tasks
        except ImportError as error:
            assert "prefect" in str(error), error
        else:
            raise AssertionError("shardline.tasks.prefect_tasks imported with prefect blocked")
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK")
