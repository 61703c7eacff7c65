"""The tensor-parallel sweep: for each decoder type the model-coverage sweep builds
(tests/engine/coverage.py), what the pre-flight verdict says of 2 ranks, one line per
type: "split", "refused" (the verdict's one-line ShardingError), "not run" (the engine
refuses the model on one rank already), "skipped" (the coverage sweep skips it) or
"failure" (any other exception: a bug in the verdict).

``python -m tests.engine.parallel.tp_sweep`` prints the lines and the counts.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import tiny_config
from shardline.engine.parallel.group import ShardingError
from shardline.engine.parallel.verdict import tensor_parallel_verdict

from ..coverage import decoder_model_types, quiet_transformers
from ..coverage_configs import SKIPPED, VOCAB_SIZE, tiny_overrides

OUTCOMES = ("split", "refused", "not run", "skipped", "failure")


@dataclasses.dataclass(frozen=True)
class TPVerdict:
    """What the verdict says of ``model_type`` over ``size`` ranks."""

    model_type: str
    outcome: str
    reason: str = ""

    def line(self) -> str:
        return f"{self.model_type}: {self.outcome}" + (f": {self.reason}" if self.reason else "")


def tp_verdict(model_type: str, size: int = 2) -> TPVerdict:
    """The verdict on ``model_type``'s first tiny config over ``size`` ranks."""
    if model_type in SKIPPED:
        return TPVerdict(model_type, "skipped", SKIPPED[model_type])
    try:
        config = tiny_config(model_type, VOCAB_SIZE, **tiny_overrides(model_type))
        support = model_support(config)
        if not support.ok:
            return TPVerdict(model_type, "not run", _one_line(str(support.reason)))
        tensor_parallel_verdict(config, size, quantization=None, task="generate")
    except ShardingError as error:
        return TPVerdict(model_type, "refused", _one_line(str(error)))
    except Exception as error:  # noqa: BLE001 - the sweep reports every way a verdict fails
        return TPVerdict(model_type, "failure", f"{type(error).__name__}: {_one_line(str(error))}")
    return TPVerdict(model_type, "split")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def tp_sweep(model_types: list[str], size: int = 2) -> list[TPVerdict]:
    """Each type's verdict, printed as it comes, then the counts by outcome."""
    results = []
    for model_type in model_types:
        result = tp_verdict(model_type, size)
        print(result.line(), flush=True)
        results.append(result)
    counts = collections.Counter(result.outcome for result in results)
    print(", ".join(f"{outcome}: {counts[outcome]}" for outcome in OUTCOMES), flush=True)
    return results


if __name__ == "__main__":
    quiet_transformers()
    tp_sweep(sys.argv[1:] or decoder_model_types())
