"""bench.ppo's check of the planner's order against repeated timings: pairs the
timings separate must be ordered as measured, pairs they do not are ties."""

from __future__ import annotations

from bench._ppo_plan import order_agrees, separated


def test_quartiles_that_overlap_do_not_separate_two_placements() -> None:
    assert separated([1.0, 1.1, 1.2], [1.5, 1.6, 1.7])
    assert not separated([1.0, 1.3, 1.5], [1.3, 1.45, 1.6])  # quartiles 1.15-1.4 and 1.375-1.525
    assert separated([2.0], [1.0])  # one run each: their values


def test_a_prediction_must_order_every_separated_pair_as_measured() -> None:
    measured = {"colocate": [1.0, 1.02, 1.04], "split": [1.5, 1.55, 1.6], "standalone": [1.52, 1.6, 1.62]}
    agrees, tied = order_agrees(measured, {"colocate": 1.1, "split": 1.7, "standalone": 1.6})
    assert agrees and tied == [["split", "standalone"]]  # split vs standalone is a tie: either order
    agrees, _ = order_agrees(measured, {"colocate": 1.8, "split": 1.7, "standalone": 1.6})
    assert not agrees  # colocate is measurably fastest
