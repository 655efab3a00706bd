"""bench.ppo's check of the planner's order against repeated timings: rounds pair
the placements, pairs whose round-by-round ratios separate them must be ordered as
measured, pairs they do not are ties."""

from __future__ import annotations

import pytest

from bench._ppo_plan import measured_order, order_agrees, paired_ratios, separated


def test_a_drift_shared_by_a_round_does_not_hide_a_steady_difference() -> None:
    # The machine slows 1.0 -> 1.6 over the rounds; b is 5 % slower than a in every round.
    a = [1.0, 1.2, 1.4, 1.6, 1.5]
    b = [x * 1.05 for x in a]
    assert paired_ratios(a, b) == pytest.approx([1 / 1.05] * 5)
    assert separated(a, b) and separated(b, a)


def test_ratios_on_both_sides_of_one_do_not_separate_two_placements() -> None:
    a = [1.0, 1.2, 1.4, 1.6, 1.5]
    b = [0.95, 1.25, 1.38, 1.7, 1.45]  # faster in rounds 1, 3, 5; slower in 2 and 4
    assert not separated(a, b)
    assert separated([2.0], [1.0])  # one round: its ratio
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])  # rounds must pair up


def test_the_measured_order_is_by_time_relative_to_each_round() -> None:
    # Medians would say a (1.3) < b (1.35); round by round b is faster in 4 of 5.
    repeats = {"a": [1.0, 1.1, 1.3, 1.6, 1.7], "b": [0.98, 1.08, 1.35, 1.55, 1.65]}
    assert measured_order(repeats) == ["b", "a"]


def test_a_prediction_must_order_every_separated_pair_as_measured() -> None:
    measured = {"colocate": [1.0, 1.02, 1.04], "split": [1.5, 1.55, 1.6], "standalone": [1.52, 1.53, 1.62]}
    agrees, tied = order_agrees(measured, {"colocate": 1.1, "split": 1.7, "standalone": 1.6})
    assert agrees and tied == [["split", "standalone"]]  # split vs standalone is a tie: either order
    agrees, _ = order_agrees(measured, {"colocate": 1.8, "split": 1.7, "standalone": 1.6})
    assert not agrees  # colocate is measurably fastest
