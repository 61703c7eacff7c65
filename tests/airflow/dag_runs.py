"""Running the test DAGs with ``dag.test()`` and reading back what Airflow recorded."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

LOGICAL_DATE = datetime(2025, 1, 2, tzinfo=timezone.utc)  # {{ ds }} = 2025-01-02


def load_dag(dag_id: str) -> Any:
    """The DAG ``dag_id`` as Airflow parses it from the DAGs folder."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag()
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag(dag_id)


def run_dag(dag_id: str, conf: dict[str, Any], logical_date: datetime = LOGICAL_DATE) -> Any:
    """One ``dag.test()`` run; returns the DagRun."""
    return load_dag(dag_id).test(logical_date=logical_date, run_conf=conf)


def task_states(dag_run: Any) -> dict[tuple[str, int], str]:
    """(task id, map index) -> final state of every task instance of ``dag_run``."""
    return {(ti.task_id, ti.map_index): str(ti.state) for ti in dag_run.get_task_instances()}


def xcom_values(dag_run: Any, task_id: str) -> dict[int, Any]:
    """Map index -> the ``return_value`` XCom of ``task_id`` in ``dag_run``."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id,
                                                  task_ids=task_id, key="return_value")).all()
        return {row.map_index: XComModel.deserialize_value(row) for row in rows}


def xcom_bytes(value: Any) -> int:
    return len(json.dumps(value))
