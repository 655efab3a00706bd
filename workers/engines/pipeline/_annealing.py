"""RLHFuse's schedule generator (its section 5.2): simulated annealing over the
devices' orders of a fused schedule, starting from the greedy and backfilled
schedules (:mod:`._fusion`), moving by swapping two adjacent passes of one device;
first for the finish time, then, without giving any of it back, for the peak of
held activations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from workers.engines.pipeline._fusion import (
    Backbone,
    fill,
    fused_greedy,
    fusion_lower_bound,
    serial_cost,
)
from workers.engines.pipeline._schedule import (
    PipelineModel,
    Schedule,
    ScheduleError,
    TaskIndex,
    peaks,
    run_orders,
    simulate,
)

__all__ = ["fused_annealed"]


_LIMITS = (1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0)
"""Activation limits, as multiples of the serial 1F1B peak, the annealing's
backfilled starting points are built with."""
_SLACKS = (0.0, 0.25, 0.5, 1.0)
"""How long a backfilled pass may delay the backbone's next one, in the largest
forward's time, for the annealing's starting points (a little delay can let the
other model's chain through sooner)."""
_DELAYS = (0.5, 1.0, 1.5, 2.0)
"""How much later than its own 1F1B the backbone may finish in the late, delayed
backfilled starting points, in multiples of the gap between the lower bound and
that finish (where the devices' work adds up to more than the backbone's 1F1B
takes, the other model needs that room)."""
_RAMPS = (1.0, 2.0, 4.0)
"""How that delay grows along the backbone's schedule in the ramped starting points
(:func:`backfilled`'s ``ramp``): the backbone's first passes keep their time, which
a tight activation limit needs (the other model cannot hold its passes there), so
these are built under the lower limits only."""


def fused_annealed(
    models: Sequence[PipelineModel],
    *,
    iterations: int = 20_000,
    memory_iterations: int | None = None,
    memory_limit: float | None = None,
    tolerance: float = 0.005,
    seed: int = 0,
) -> Schedule:
    """RLHFuse's annealed fused schedule of ``models`` (see the module docstring).

    The search anneals up to seven starting points: the greedy schedule and the
    best backfilled ones with the backbone's passes late, eager, late with the
    other model bounded as in 1F1B, (where the lower bound lies past the
    backbone's own 1F1B finish) late with the backbone's finish moved toward that
    bound, all at once and growing along its schedule, and late with its passes
    anticipated (:func:`backfilled` under several activation limits and delays;
    the earliest finish, then the lowest peak). Each is annealed by moving
    adjacent passes to finish earlier (within ``memory_limit``); of the results
    finishing within ``tolerance`` of the earliest, the one holding the fewest
    activations is annealed again to hold fewer at no cost in finish time.

    Args:
        models: as :func:`fused_greedy`.
        iterations: moves tried while minimising the finish time.
        memory_iterations: moves tried while then minimising the peak of held
            activations (default ``iterations``).
        memory_limit: the most activation memory a device may hold (RLHFuse's
            per-stage capacity); None: no limit.
        tolerance: the fraction of the finish time the search gives up for fewer
            held activations (0: the earliest finish, whatever it holds).
        seed: the search's random seed (the search is deterministic given it).

    Returns:
        A schedule that finishes no later than its starting points' earliest times
        ``1 + tolerance``; without a memory limit, no later than
        :func:`fused_greedy`'s times that.

    Raises:
        ScheduleError: if no starting point keeps within ``memory_limit``.
    """
    index = TaskIndex(models)
    serial_peak = serial_cost(models).peak
    forward = max(m.forward_s for m in models)
    greedy = fused_greedy(models)
    cap = math.inf if memory_limit is None else memory_limit + 1e-9
    backbone = Backbone.of(models)
    first: list[Schedule | None] = [greedy]
    gap = max(fusion_lower_bound(models) - backbone.finish_s, 0.0)
    groups = [first] + [
        [fill(backbone, memory_limit=serial_peak * f, slack_s=forward * k, late=late, bounded=bounded)
         for f in _LIMITS for k in _SLACKS] for late, bounded in ((True, False), (False, False), (True, True))]
    if gap > 0:
        groups.append([fill(backbone, memory_limit=serial_peak * f, late_by_s=gap * k) for f in _LIMITS for k in _DELAYS])
        groups.append([fill(backbone, memory_limit=serial_peak * f, slack_s=forward * s, late_by_s=gap * k, ramp=r)
                       for f in _LIMITS if f <= 1.5 for k in _DELAYS for r in _RAMPS for s in _SLACKS[:2]])
    groups.append([fill(backbone, memory_limit=serial_peak * f, slack_s=forward * s, late_by_s=gap * k, anticipate=True)
                   for f in _LIMITS for s in _SLACKS[:2] for k in (0.0, *(_DELAYS if gap > 0 else ()))])
    # The greedy schedule, and the earliest (then leanest) of the late, the eager, the
    # late and bounded, the late and delayed, the late and ramped, and the late and
    # anticipating backfilled ones.
    starts = []
    for group in groups:
        runs = [(r.finish_s, r.peak, n, s) for n, s in enumerate(group) if s is not None
                for r in [simulate(s)] if r.peak <= cap]
        if runs:
            starts.append(min(runs, key=lambda run: run[:3])[3])
    if not starts:
        raise ScheduleError(f"no fused schedule found within memory_limit={memory_limit}")
    rng = random.Random(seed)
    costs = [c for c in index.cost if c > 0] or [1.0]
    searched: list[tuple[float, float, int, list[list[int]]]] = []
    for start in starts:
        found = _anneal_time(index, index.orders(start), rng, iterations, hot=max(costs), cold=min(costs) * 1e-3,
                             cap=cap)
        end = run_orders(index, found)
        assert end is not None, "the search keeps schedules that run"
        searched.append((max(end), max(peaks(index, found)), len(searched), found))
    earliest = min(run[0] for run in searched)
    near = [run for run in searched if run[0] <= earliest * (1 + tolerance) + 1e-9]
    orders = min(near, key=lambda run: (run[1], run[0], run[2]))[3]
    rounds = iterations if memory_iterations is None else memory_iterations
    activations = [abs(a) for a in index.memory if a] or [1.0]
    orders = _anneal_memory(index, orders, rng, rounds, hot=max(activations), cold=min(activations) * 1e-3)
    return index.schedule(orders)


def _time_energy(end: list[float], orders: list[list[int]]) -> float:
    """The finish time, plus a hundredth of the devices' mean finish: among schedules
    that finish together, the search prefers ones whose devices free up sooner (that
    slack is what the next moves shorten the critical path with)."""
    finishes = [end[order[-1]] for order in orders if order]
    return max(finishes) + 0.01 * sum(finishes) / len(finishes)


def _swap(orders: list[list[int]], d: int, i: int) -> None:
    orders[d][i], orders[d][i + 1] = orders[d][i + 1], orders[d][i]


def _moves(orders: list[list[int]], rng: random.Random) -> tuple[int, int]:
    """A random adjacent pair (device, position) to swap."""
    while True:
        d = rng.randrange(len(orders))
        if len(orders[d]) > 1:
            return d, rng.randrange(len(orders[d]) - 1)


def _cooling(hot: float, cold: float, rounds: int) -> float:
    return (cold / hot) ** (1.0 / max(rounds, 1))


def _anneal_time(index: TaskIndex, orders: list[list[int]], rng: random.Random, rounds: int, *,
                 hot: float, cold: float, cap: float) -> list[list[int]]:
    end = run_orders(index, orders)
    assert end is not None, "the start schedule runs"
    energy = _time_energy(end, orders)
    best, best_energy = [list(o) for o in orders], energy
    temperature, alpha = hot, _cooling(hot, cold, rounds)
    for _ in range(rounds):
        d, i = _moves(orders, rng)
        _swap(orders, d, i)
        moved = run_orders(index, orders) if cap == math.inf or peaks(index, [orders[d]])[0] <= cap else None
        if moved is None:
            _swap(orders, d, i)
            continue
        new = _time_energy(moved, orders)
        if new <= energy or rng.random() < math.exp((energy - new) / temperature):
            energy = new
            if new < best_energy:
                best, best_energy = [list(o) for o in orders], new
        else:
            _swap(orders, d, i)
        temperature *= alpha
    return best


def _anneal_memory(index: TaskIndex, orders: list[list[int]], rng: random.Random, rounds: int, *,
                   hot: float, cold: float) -> list[list[int]]:
    end = run_orders(index, orders)
    assert end is not None, "the start schedule runs"
    finish = max(end)
    device_peaks = list(peaks(index, orders))

    def energy_of(p: list[float]) -> float:
        # The peak, then the other devices' peaks: a move that lowers a device
        # that is not (yet) the highest still counts.
        return max(p) + 0.01 * sum(p) / len(p)

    energy = energy_of(device_peaks)
    best, best_energy = [list(o) for o in orders], energy
    temperature, alpha = hot, _cooling(hot, cold, rounds)
    for _ in range(rounds):
        d, i = _moves(orders, rng)
        _swap(orders, d, i)
        old_peak = device_peaks[d]
        device_peaks[d] = peaks(index, [orders[d]])[0]
        new = energy_of(device_peaks)
        accept = new <= energy or rng.random() < math.exp((energy - new) / temperature)
        if accept:
            moved = run_orders(index, orders)
            accept = moved is not None and max(moved) <= finish + 1e-9
        if accept:
            energy = new
            if new < best_energy:
                best, best_energy = [list(o) for o in orders], new
        else:
            _swap(orders, d, i)
            device_peaks[d] = old_peak
        temperature *= alpha
    return best

