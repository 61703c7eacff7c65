"""A structured extraction job over a Parquet shard: every output constrained to a JSON
schema, validated into the output's ``parsed`` column.

    python examples/structured_extraction.py [--model Qwen/Qwen3-0.6B]

With the default tiny random model the values are noise, but every complete object is
valid against the schema; a row given too few tokens gets an ``error`` saying so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from _tiny import model_argument, resolve_model, shardline_run

SCHEMA = {"type": "object",
          "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                         "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                         "issue": {"enum": ["damaged", "late", "cancel", "other"]}},
          "required": ["order_id", "quantity", "issue"]}
TICKETS = [
    {"id": "t1", "prompt": "Extract the order as JSON. Ticket: my order #4411 of 3 mugs arrived broken.",
     "max_tokens": 64},
    {"id": "t2", "prompt": "Extract the order as JSON. Ticket: where is order 9120? I bought 1 lamp.",
     "max_tokens": 64},
    {"id": "t3", "prompt": "Extract the order as JSON. Ticket: cancel #7002 (2 chairs).", "max_tokens": 6},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_argument(parser)
    args = parser.parse_args()
    model = resolve_model(args)
    root = Path(args.workdir) / "structured"
    (root / "tickets").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(TICKETS), root / "tickets" / "part-0.parquet")
    (root / "order.schema.json").write_text(json.dumps(SCHEMA))
    shardline_run(root / "tickets", root / "out", model, "--json-schema", str(root / "order.schema.json"),
                  "--compact-json", "--temperature", "0")
    for row in pq.read_table(root / "out" / "part-0.parquet").to_pylist():
        print({key: row[key] for key in ("id", "parsed", "finish_reason", "error")})


if __name__ == "__main__":
    main()
