"""Model coverage: no decoder-only model type runs with wrong tokens.

Each type is built tiny and random, in two configs (tests/engine/coverage_configs.py),
and compared token for token with transformers' greedy generate (tests/engine/coverage.py).
A type passes when it is at parity or refused at load with shardline's own error; wrong
tokens or a crash fail.

A representative set runs by default, and a handful in their second config. The whole sweep over every type in the
installed transformers' causal-LM mapping takes tens of minutes on two cores, so it
runs only when SHARDLINE_COVERAGE_SWEEP=1 (and is marked slow), both configs per
type; it prints one line per type and config and the counts by class (``python -m tests.engine.coverage`` prints the
same report without pytest).
"""

from __future__ import annotations

import os

import pytest

from .coverage import REPRESENTATIVE, SECOND_REPRESENTATIVE, check_type, decoder_model_types, quiet_transformers, sweep


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    quiet_transformers()


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_type_is_exact_or_refused(model_type, tmp_path):
    result = check_type(model_type, tmp_path)
    print(result.line())
    assert result.outcome in ("parity", "refused"), result.line()


@pytest.mark.parametrize("model_type", SECOND_REPRESENTATIVE)
def test_representative_type_in_its_second_config_is_exact_or_refused(model_type, tmp_path):
    result = check_type(model_type, tmp_path, config=2)
    print(result.line())
    assert result.outcome in ("parity", "refused"), result.line()


def test_a_model_whose_tokens_ignore_the_context_is_not_counted_as_parity(tmp_path):
    """The sweep's own guard: at transformers' default weight scale a tiny model's
    greedy tokens follow the last token alone, and the sweep says so."""
    from shardline.engine.model.tiny import build_tiny_model

    from .coverage import _context_matters, _load_reference

    model_dir = build_tiny_model(tmp_path / "flat", "llama", num_hidden_layers=1)
    model, expected, _ = _load_reference(str(model_dir))
    assert _context_matters(model, expected)
    for parameter in model.parameters():  # an attention that reads nothing of the context
        if parameter.dim() > 1:
            parameter.data.mul_(0.02 / 0.2)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    assert not _context_matters(model, _reference_tokens(model))


def _reference_tokens(model):
    from .coverage import _prompts, _reference

    return _reference(model, _prompts())


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SHARDLINE_COVERAGE_SWEEP") != "1",
                    reason="the full model-coverage sweep runs with SHARDLINE_COVERAGE_SWEEP=1")
def test_every_decoder_type_is_exact_or_refused(tmp_path):
    results = sweep(decoder_model_types(), tmp_path)
    failures = [result.line() for result in results if result.outcome == "failure"]
    assert not failures, "\n".join(failures)
