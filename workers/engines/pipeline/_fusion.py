"""RLHFuse's fused training stage: two models (the actor and the critic) trained on
the same devices with one schedule, their pipelines in opposite directions so that
each fills the other's bubbles (RLHFuse section 5, after Chimera's bidirectional
pipelines).

- :func:`fused_greedy` is the paper's baseline: list scheduling that runs, whenever
  a device is free, a pass whose input is there, preferring the larger model and,
  within a model, backwards (they free memory) and early micro-batches.
- :func:`fused_annealed` is the paper's generator: simulated annealing over the
  devices' orders, starting from the greedy schedule, moving by swapping two adjacent
  passes of one device; first for the finish time, then, without giving any of it
  back, for the peak of held activations.
- :func:`fusion_lower_bound` is the paper's bound on any fused schedule's finish time.
- :func:`serial_cost` is the unfused baseline: each model's 1F1B, one after the other.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence

from workers.engines.pipeline._builders import one_f_one_b
from workers.engines.pipeline._schedule import (
    PipelineModel,
    Schedule,
    ScheduleError,
    Task,
    TaskIndex,
    peaks,
    run_orders,
    simulate,
)

__all__ = ["SerialCost", "backfilled", "fused_annealed", "fused_greedy", "fusion_lower_bound", "serial_cost"]


@dataclasses.dataclass(frozen=True)
class SerialCost:
    """The unfused baseline: each model's 1F1B schedule, one after the other."""

    finish_s: float
    """The sum of the models' finish times."""
    peak: float
    """The largest peak of held activations on any device (the models' peaks do not
    add up: one model's activations are gone before the next starts)."""


def serial_cost(models: Sequence[PipelineModel]) -> SerialCost:
    """What running each of ``models`` with its own 1F1B schedule, one after the
    other, costs."""
    runs = [simulate(one_f_one_b(dataclasses.replace(m, reverse=False))) for m in models]
    return SerialCost(finish_s=sum(r.finish_s for r in runs), peak=max(r.peak for r in runs))


def _priority(models: Sequence[PipelineModel]) -> list[int]:
    """Rank of each model by its total work, the largest first."""
    work = [m.pipelines * m.micro_batches * m.virtual_stages * (m.forward_s + m.backward_s) for m in models]
    ranked = sorted(range(len(models)), key=lambda i: -work[i])
    return [ranked.index(i) for i in range(len(models))]


def fused_greedy(models: Sequence[PipelineModel]) -> Schedule:
    """The greedy fused schedule of ``models`` (see the module docstring).

    Args:
        models: the models sharing the devices; the second and later usually with
            ``reverse=True`` (pipelines in the other direction).

    Returns:
        A schedule of every pass of every model.

    Raises:
        EngineConfigError: if the models do not cover the same devices.
    """
    index = TaskIndex(models)
    rank = _priority(models)
    lanes = _lanes(models, index.devices)
    taken = {lane: [0, 0] for device in lanes for lane in device}
    end: dict[int, float] = {}
    free = [0.0] * index.devices
    orders: list[list[int]] = [[] for _ in range(index.devices)]
    for _ in range(len(index.tasks)):
        best: tuple[tuple[float, int, bool, int, int], int, tuple[int, int, int], int] | None = None
        for d, device_lanes in enumerate(lanes):
            for lane in device_lanes:
                for task in _lane_heads(index, models, lane, taken[lane]):
                    start = _ready(index, end, task, free[d])
                    if start is None:
                        continue
                    t = index.tasks[task]
                    key = (start, rank[t.model], not t.backward, t.micro_batch, t.stage)
                    if best is None or key < best[0]:
                        best = (key, d, lane, task)
        assert best is not None, "list scheduling always has a ready pass"
        (start, *_), d, lane, task = best
        end[task] = free[d] = start + index.cost[task]
        taken[lane][index.tasks[task].backward] += 1
        orders[d].append(task)
    return index.schedule(orders)


def fusion_lower_bound(models: Sequence[PipelineModel]) -> float:
    """A lower bound on the finish time of any schedule of ``models`` on their devices.

    RLHFuse's bound, taken over every subset of the models: on each device, the
    earliest a pass of the subset can arrive (the forwards of the stages before it),
    plus every pass of the subset the device runs, plus the least time the last of
    them still needs downstream (the backwards of the stages before it); the largest
    over devices and subsets. No schedule beats it; one may not reach it.
    """
    index = TaskIndex(models)
    bound = 0.0
    for d in range(index.devices):
        per_model = []
        for m, model in enumerate(models):
            stages = [s for j in range(model.pipelines) for s in range(model.virtual_stages)
                      if model.device_of(j, s) == d]
            work = sum(index.cost[t] for t in range(len(index.tasks))
                       if index.device[t] == d and index.tasks[t].model == m)
            per_model.append((min(stages) * model.forward_s, work, min(stages) * model.backward_s))
        for size in range(1, len(models) + 1):
            for subset in itertools.combinations(per_model, size):
                arrive = min(a for a, _, _ in subset)
                tail = min(t for _, _, t in subset)
                bound = max(bound, arrive + sum(w for _, w, _ in subset) + tail)
    return bound


def backfilled(models: Sequence[PipelineModel], *, memory_limit: float | None = None,
               slack_s: float = 0.0) -> Schedule | None:
    """A fused schedule built around the slowest model's own 1F1B: that model keeps
    its 1F1B order on every device, and a pass of another model runs only where it
    ends before the backbone's next pass could start, ``slack_s`` later at most
    (backfilling its bubbles) and, for a forward, keeps the device's held
    activations within ``memory_limit``.

    Returns:
        The schedule, or None if the limit leaves every device waiting.
    """
    index = TaskIndex(models)
    finishes = [simulate(one_f_one_b(m)).finish_s for m in models]
    spine = max(range(len(models)), key=lambda m: finishes[m])
    queues = [[index.ids[t._replace(model=spine)] for t in order] for order in one_f_one_b(models[spine]).orders]
    lanes = _lanes(models, index.devices, skip=spine)
    taken = {lane: [0, 0] for device in lanes for lane in device}
    at = [0] * index.devices
    end: dict[int, float] = {}
    free, held = [0.0] * index.devices, [0.0] * index.devices
    orders: list[list[int]] = [[] for _ in range(index.devices)]
    limit = math.inf if memory_limit is None else memory_limit + 1e-9
    for _ in range(len(index.tasks)):
        best: tuple[float, int, int, int, tuple[int, int, int] | None] | None = None
        for d in range(index.devices):
            due = math.inf  # when the backbone's next pass could start here
            if at[d] < len(queues[d]):
                task = queues[d][at[d]]
                ready = _ready(index, end, task, free[d])
                if ready is not None:
                    due = ready
                    best = min(best, (ready, 0, d, task, None)) if best else (ready, 0, d, task, None)
            for lane in lanes[d]:
                for task in _lane_heads(index, models, lane, taken[lane]):
                    start = _ready(index, end, task, free[d])
                    if start is None or start + index.cost[task] > due + slack_s + 1e-9:
                        continue
                    if held[d] + index.memory[task] > limit:
                        continue
                    best = min(best, (start, 1, d, task, lane)) if best else (start, 1, d, task, lane)
        if best is None:
            return None
        start, _, d, task, chosen = best
        end[task] = free[d] = start + index.cost[task]
        held[d] += index.memory[task]
        if chosen is None:
            at[d] += 1
        else:
            taken[chosen][index.tasks[task].backward] += 1
        orders[d].append(task)
    return index.schedule(orders)


def _lanes(models: Sequence[PipelineModel], devices: int, *, skip: int = -1) -> list[list[tuple[int, int, int]]]:
    """Per device, its (model, pipeline, virtual stage) lanes: each runs its forwards,
    and its backwards, in micro-batch order."""
    lanes: list[list[tuple[int, int, int]]] = [[] for _ in range(devices)]
    for m, model in enumerate(models):
        if m == skip:
            continue
        for j in range(model.pipelines):
            for s in range(model.virtual_stages):
                lanes[model.device_of(j, s)].append((m, j, s))
    return lanes


def _lane_heads(index: TaskIndex, models: Sequence[PipelineModel], lane: tuple[int, int, int],
                taken: list[int]) -> list[int]:
    """The lane's next backward and next forward (backwards first), those left."""
    m, j, s = lane
    return [index.ids[Task(m, j, taken[backward], s, backward)]
            for backward in (True, False) if taken[backward] < models[m].micro_batches]


def _ready(index: TaskIndex, end: dict[int, float], task: int, free: float) -> float | None:
    """When ``task`` could start on its device (free at ``free``); None while its
    dependency has not run."""
    dep = index.dependency[task]
    if dep < 0:
        return free
    done = end.get(dep)
    return None if done is None else max(free, done)


_LIMITS = (1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0)
"""Activation limits, as multiples of the serial 1F1B peak, the annealing's
backfilled starting points are built with."""
_SLACKS = (0.0, 0.25, 0.5, 1.0)
"""How long a backfilled pass may delay the backbone's next one, in the largest
forward's time, for the annealing's starting points (a little delay can let the
other model's chain through sooner)."""


def fused_annealed(
    models: Sequence[PipelineModel],
    *,
    iterations: int = 20_000,
    memory_iterations: int | None = None,
    memory_limit: float | None = None,
    seed: int = 0,
) -> Schedule:
    """RLHFuse's annealed fused schedule of ``models`` (see the module docstring).

    The search starts from the best of the greedy schedule and backfilled ones
    (:func:`backfilled` under several activation limits and delays): the earliest
    finish, and among equally early ones the lowest peak. It then swaps adjacent
    passes to finish earlier (within ``memory_limit``), then to hold fewer
    activations at no cost in finish time.

    Args:
        models: as :func:`fused_greedy`.
        iterations: moves tried while minimising the finish time.
        memory_iterations: moves tried while then minimising the peak of held
            activations (default ``iterations``).
        memory_limit: the most activation memory a device may hold (RLHFuse's
            per-stage capacity); None: no limit.
        seed: the search's random seed (the search is deterministic given it).

    Returns:
        A schedule that finishes no later than its starting point; without a memory
        limit, no later than :func:`fused_greedy`'s.

    Raises:
        ScheduleError: if no starting point keeps within ``memory_limit``.
    """
    index = TaskIndex(models)
    serial_peak = serial_cost(models).peak
    forward = max(m.forward_s for m in models)
    starts = [fused_greedy(models)] + [backfilled(models, memory_limit=serial_peak * f, slack_s=forward * k)
                                       for f in _LIMITS for k in _SLACKS]
    runs = [(simulate(s), s) for s in starts if s is not None]
    if memory_limit is not None:
        runs = [(r, s) for r, s in runs if r.peak <= memory_limit + 1e-9]
    if not runs:
        raise ScheduleError(f"no fused schedule found within memory_limit={memory_limit}")
    first = min(r.finish_s for r, _ in runs)
    near = [(r.peak, r.finish_s, i) for i, (r, _) in enumerate(runs) if r.finish_s <= first + 1e-9]
    orders = index.orders(runs[min(near)[2]][1])
    rng = random.Random(seed)
    costs = [c for c in index.cost if c > 0] or [1.0]
    cap = math.inf if memory_limit is None else memory_limit + 1e-9
    orders = _anneal_time(index, orders, rng, iterations, hot=max(costs), cold=min(costs) * 1e-3, cap=cap)
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

