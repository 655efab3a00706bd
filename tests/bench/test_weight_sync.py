"""``bench._weight_sync.weight_sync`` on a tiny model: a rollout role on its own
pool pulls the actor's weights on real Ray workers, and the hybrid engine
reshards them on two real gloo processes; it returns every key, the pull
receives the model's parameter bytes and the reshard the formula's. Timings are
reported, never asserted."""

from __future__ import annotations

import math

import pytest

from bench._weight_sync import COLOCATED, weight_sync
from bench.transition import model_specs
from hybrid_engine import expected_bytes

KEYS = ("params", "s", "bytes", "colocated_s", "colocated_bytes")


def test_both_ways_measured_with_the_models_and_the_formulas_bytes() -> None:
    said: list[str] = []
    record = weight_sync(("small",), repeats=1, say=said.append)
    assert set(record) == {f"weight_sync_small_{k}" for k in KEYS}
    specs = model_specs("small")
    params = sum(math.prod(s.shape) for s in specs)
    assert record["weight_sync_small_params"] == params
    # Measured where they arrive (the rollout rank's store, the version column
    # left out): fp32, t = 1, each parameter byte once, no padding.
    assert record["weight_sync_small_bytes"] == 4 * params == sum(s.nbytes for s in specs)
    # 121-1121: each rank receives the other's half of the split parameters; the
    # norms, held whole, do not move.
    split = sum(s.nbytes for s in specs if s.dim is not None)
    assert record["weight_sync_small_colocated_bytes"] == expected_bytes(COLOCATED, specs, "hybridflow").sent
    assert record["weight_sync_small_colocated_bytes"] == split // 2 > 0
    assert record["weight_sync_small_s"] > 0 and record["weight_sync_small_colocated_s"] > 0
    assert any(f"{params:,} parameters" in line for line in said), said


@pytest.mark.parametrize(("sizes", "repeats", "match"), [
    (("small",), 0, "repeats must be >= 1"),
    (("1b",), 1, r"unknown sizes \['1b'\]"),
])
def test_bad_arguments_are_refused_before_anything_starts(sizes: tuple[str, ...], repeats: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        weight_sync(sizes, repeats=repeats)
