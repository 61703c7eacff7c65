"""The tensor-parallel verdict over the decoder types the model-coverage sweep builds
(tp_sweep.py): each type is split over 2 ranks or refused with one line, never a crash
of the verdict. A representative set runs by default; the whole sweep is slow and
prints one line per type and the counts."""

from __future__ import annotations

import pytest

from ..coverage import decoder_model_types, quiet_transformers
from .tp_sweep import tp_sweep, tp_verdict

# Type -> the outcome its verdict gives (each split type has a 2-rank test of its tokens).
REPRESENTATIVE = {
    "llama": "split", "qwen3_moe": "split", "phi3": "split", "gpt_neox": "split", "gpt2": "split",
    "falcon": "split", "gpt_bigcode": "split", "bloom": "split", "mpt": "split", "codegen": "split",
    "inkling_text": "refused",
}


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    quiet_transformers()


@pytest.mark.parametrize(("model_type", "outcome"), REPRESENTATIVE.items())
def test_representative_type_is_split_or_refused_in_one_line(model_type, outcome):
    result = tp_verdict(model_type)
    print(result.line())
    assert result.outcome == outcome, result.line()
    assert "\n" not in result.reason


@pytest.mark.slow
def test_every_decoder_type_is_split_or_refused():
    results = tp_sweep(decoder_model_types())
    failures = [result.line() for result in results if result.outcome == "failure"]
    assert not failures, "\n".join(failures)
