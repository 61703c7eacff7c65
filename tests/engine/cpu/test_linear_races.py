"""The packed linears' race: it runs a decoder layer's linears at the rows a step runs
(a decode step's and the engine's token budget), and a result below the margin is
measured again before torch's matmul replaces the packed path."""

import pytest
import torch

from shardline.engine.cpu import linear_race, path_races
from shardline.engine.cpu.capability import ModelShape

SHAPE = ModelShape(hidden_size=32, widest_linear=48, num_heads=4, num_kv_heads=2, head_dim=8)


def test_the_layer_is_raced_at_a_decode_and_a_prefill_steps_rows():
    assert path_races.measured_rows(2048) == (path_races.MEASURED_DECODE_ROWS, 2048)
    assert path_races.measured_rows(1 << 16) == (path_races.MEASURED_DECODE_ROWS, path_races.MEASURED_PREFILL_ROWS)
    assert path_races.measured_rows(16) == (16,)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_the_race_runs_the_packed_matmul_at_the_engines_rows(monkeypatch):
    seen: list[int] = []
    original = path_races.packed_matmul

    def recorded(x: torch.Tensor, *rest) -> torch.Tensor:
        seen.append(x.shape[0])
        return original(x, *rest)

    monkeypatch.setattr(path_races, "packed_matmul", recorded)
    assert path_races.linear_speedup(torch.float32, torch.float32, SHAPE, rows_hint=300) > 0
    assert set(seen) == {path_races.MEASURED_DECODE_ROWS, 300}


def _sequence(*values: float):
    calls: list[float] = []
    iterator = iter(values)

    def speedup() -> float:
        calls.append(next(iterator))
        return calls[-1]

    return speedup, calls


def test_a_result_below_the_threshold_is_measured_again_and_the_best_kept():
    speedup, calls = _sequence(0.8, 0.95, 0.5)
    assert path_races.confirmed(speedup, threshold=0.9) == 0.95
    assert calls == [0.8, 0.95]  # the second run passed: no third


def test_the_alternative_wins_only_where_every_run_finds_the_default_slower():
    speedup, calls = _sequence(0.8, 0.7, 0.85, 2.0)
    assert path_races.confirmed(speedup, threshold=0.9) == 0.85
    assert len(calls) == path_races.CONFIRMING_RACES


def test_a_result_above_the_threshold_is_measured_once():
    speedup, calls = _sequence(1.2, 0.1)
    assert path_races.confirmed(speedup, threshold=0.9) == 1.2
    assert calls == [1.2]


def test_the_small_kernel_takes_arithmetic_bound_rows_by_a_smaller_margin():
    between = (linear_race.ARITHMETIC_TAKE_RATIO + linear_race.TAKE_RATIO) / 2
    taken = linear_race.rows_taken(lambda rows: between)
    assert taken == frozenset(rows for rows in linear_race.KERNEL_ROW_COUNTS
                              if rows >= linear_race.ARITHMETIC_TAKE_ROWS)
    assert linear_race.rows_taken(lambda rows: linear_race.ARITHMETIC_TAKE_RATIO * 0.99) == frozenset()
