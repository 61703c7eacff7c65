"""The Airflow provider's example DAG run with ``dag.test()`` over two days of prompt
partitions on local files: a small backfill, one DAG run per day, each mapping the
operator over that day's shards.

    pip install -e ".[airflow]"     # Airflow 3, in an environment without Prefect
    python examples/airflow_dag.py [--model Qwen/Qwen3-0.6B]

The DAG is providers/airflow/example_dags/shardline_batch.py (installed as
``shardline.providers.airflow.example_dags.shardline_batch``). The script copies it
into a DAGs folder of its own under ``--workdir``, with Airflow's home and a SQLite
metadata database beside it, so it touches no other Airflow set-up. The operator's
shared engine service retires after SHARDLINE_ENGINE_IDLE_TIMEOUT idle seconds (60
here unless set).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from _tiny import model_argument, resolve_model

from shardline.tasks.sample_data import write_sample_dataset

DAG_ID = "shardline_batch"
DAYS = [dt.date(2025, 1, 1), dt.date(2025, 1, 2)]


def use_airflow_home(home: Path) -> Path:
    """Point Airflow at ``home`` (configuration, SQLite database, DAGs folder); the DAGs folder."""
    dags = home / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    os.environ.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                       "AIRFLOW__CORE__LOAD_EXAMPLES": "False"})
    os.environ.setdefault("SHARDLINE_ENGINE_IDLE_TIMEOUT", "60")
    return dags


def run_days(dags: Path, conf: dict[str, Any]) -> list[Any]:
    """Install the example DAG in ``dags``, make a fresh metadata database, and ``dag.test()``
    the DAG once per day of DAYS; the DAG runs."""
    # Airflow reads its configuration when first imported, so it is imported here, after
    # use_airflow_home() has pointed it at this example's own home.
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    module = f"shardline.providers.airflow.example_dags.{DAG_ID}"
    example = find_spec(module)
    if example is None or example.origin is None:
        raise ModuleNotFoundError(f"{module} is not installed: pip install -e '.[airflow]'")
    shutil.copy(example.origin, dags / f"{DAG_ID}.py")
    db.resetdb()
    bag = DagBag(dag_folder=str(dags))
    if bag.import_errors:
        raise RuntimeError(f"the DAG did not import: {bag.import_errors}")
    dag = bag.get_dag(DAG_ID)
    return [dag.test(logical_date=dt.datetime.combine(day, dt.time(), dt.timezone.utc), run_conf=conf)
            for day in DAYS]


def report(dag_run: Any, output: Path) -> None:
    """The run's state, its task instances' states, and the day's committed outputs and usage."""
    states = sorted((ti.task_id, ti.map_index, str(ti.state)) for ti in dag_run.get_task_instances())
    print(f"DAG run for {dag_run.logical_date:%Y-%m-%d} ({dag_run.run_id}): {dag_run.state}")
    print("  tasks:", ", ".join(f"{task}[{index}] {state}" if index >= 0 else f"{task} {state}"
                               for task, index, state in states))
    print("  outputs:", sorted(path.name for path in output.glob("*.parquet")))
    print("  request counts:", json.loads((output / "_batch.json").read_text())["request_counts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_argument(parser)
    args = parser.parse_args()
    root = Path(args.workdir).resolve() / "airflow-example"
    for day in DAYS:
        write_sample_dataset(str(root / "prompts" / f"date={day}"), num_shards=2, rows_per_shard=4,
                             with_bad_rows=False)
    conf = {"input": str(root / "prompts"), "output": str(root / "completions"), "model": resolve_model(args),
            "sampling": {"max_tokens": 8, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
            "storage_conn_id": None}  # local files: no storage connection
    dags = use_airflow_home(root / "airflow-home")
    for dag_run, day in zip(run_days(dags, conf), DAYS):
        report(dag_run, root / "completions" / f"date={day}")


if __name__ == "__main__":
    main()
