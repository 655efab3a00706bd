"""RLHFuse's fused training stage: two models (the actor and the critic) trained on
the same devices with one schedule, their pipelines in opposite directions so that
each fills the other's bubbles (RLHFuse section 5, after Chimera's bidirectional
pipelines).

- :func:`fused_greedy` is the paper's baseline: list scheduling that runs, whenever
  a device is free, a pass whose input is there, preferring the larger model and,
  within a model, backwards (they free memory) and early micro-batches.
- :func:`backfilled` keeps the slowest model's 1F1B and runs the other's passes in
  its bubbles, starting the backbone's passes as late as its own finish allows (so
  that the other model's passes run while it holds fewer activations).
- :func:`~workers.engines.pipeline.fused_annealed` (:mod:`._annealing`) is the
  paper's generator, searching from these schedules.
- :func:`fusion_lower_bound` is the paper's bound on any fused schedule's finish time.
- :func:`serial_cost` is the unfused baseline: each model's 1F1B, one after the other.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from workers.engines.pipeline._builders import one_f_one_b
from workers.engines.pipeline._schedule import (
    PipelineModel,
    Schedule,
    Task,
    TaskIndex,
    run_orders,
    simulate,
)

__all__ = ["SerialCost", "backfilled", "fused_greedy", "fusion_lower_bound", "serial_cost"]


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
               slack_s: float = 0.0, late: bool = True, late_by_s: float = 0.0, ramp: float = 0.0,
               anticipate: bool = False, bounded: bool = False) -> Schedule | None:
    """A fused schedule built around the slowest model's own 1F1B: that model (the
    backbone) keeps its 1F1B order on every device, and a pass of another model runs
    in the backbone's bubbles: where it ends before the backbone's next pass must
    start, ``slack_s`` later at most. No forward, of any model, starts where it
    would take the device's held activations above ``memory_limit``.

    With ``late``, the other model's passes may hold the backbone's next pass back
    until its latest start, the latest it can start without delaying the
    backbone's own finish (a first stage's forwards have slack until the pipeline
    needs them): the other model's passes then run while the backbone holds fewer
    activations. Without it, the backbone's passes start when they can.
    ``late_by_s`` (with ``late``) moves every latest start that much later: the
    backbone may finish that much after its own 1F1B, which no fused schedule beats
    when the devices' work adds up to more (:func:`fusion_lower_bound`), and the
    other model gets that much more room early on. With ``ramp`` above 0 the
    delay grows along the backbone's schedule instead: a pass whose latest start
    lies at the fraction ``x`` of the backbone's 1F1B finish moves
    ``late_by_s * x ** ramp`` later. The backbone's first passes (its first
    micro-batch's forwards, which every later pass waits for) then keep their
    time, and the other model's passes take the room where the backbone has it
    to spare, in its steady state and drain.
    With ``anticipate`` (and ``late``), a backbone pass whose input (the pass
    before it on another device) is not placed yet still bounds what runs before
    it: it is due at its latest start. Without it, the other model's passes of
    any length run there until that input is placed, and can hold the backbone
    back when it arrives.
    With ``bounded``, the other models also keep 1F1B's bound on the micro-batches
    a stage holds (``p - s`` on stage ``s`` of ``p``), leaving the memory to the
    backbone's peaks.

    Returns:
        The schedule, or None if the limit leaves every device waiting.
    """
    return fill(Backbone.of(models), memory_limit=memory_limit, slack_s=slack_s, late=late, late_by_s=late_by_s,
                ramp=ramp, anticipate=anticipate, bounded=bounded)


@dataclasses.dataclass(frozen=True)
class Backbone:
    """What :func:`backfilled` builds around, the same for every limit and delay:
    the models' task index, the slowest model (the backbone), its 1F1B order per
    device, each of its passes' latest start and its 1F1B's finish."""

    models: tuple[PipelineModel, ...]
    index: TaskIndex
    spine: int
    queues: list[list[int]]
    latest: dict[int, float]
    finish_s: float

    @staticmethod
    def of(models: Sequence[PipelineModel]) -> Backbone:
        index = TaskIndex(models)
        finishes = [simulate(one_f_one_b(m)).finish_s for m in models]
        spine = max(range(len(models)), key=lambda m: finishes[m])
        queues = [[index.ids[t._replace(model=spine)] for t in order]
                  for order in one_f_one_b(models[spine]).orders]
        return Backbone(tuple(models), index, spine, queues, _latest_starts(models[spine], spine, index),
                        finishes[spine])


def fill(backbone: Backbone, *, memory_limit: float | None = None, slack_s: float = 0.0, late: bool = True,
         late_by_s: float = 0.0, ramp: float = 0.0, anticipate: bool = False,
         bounded: bool = False) -> Schedule | None:
    """:func:`backfilled` around a prepared ``backbone`` (the searches build many)."""
    models, index, spine = backbone.models, backbone.index, backbone.spine
    queues, latest = backbone.queues, backbone.latest
    if late_by_s:
        latest = {task: start + late_by_s * ((max(start, 0.0) / backbone.finish_s) ** ramp if ramp else 1.0)
                  for task, start in latest.items()}
    lanes = _lanes(models, index.devices, skip=spine)
    taken = {lane: [0, 0] for device in lanes for lane in device}
    at = [0] * index.devices
    end: dict[int, float] = {}
    free, held = [0.0] * index.devices, [0.0] * index.devices
    orders: list[list[int]] = [[] for _ in range(index.devices)]
    limit = math.inf if memory_limit is None else memory_limit + 1e-9
    for _ in range(len(index.tasks)):
        # (start, at one start the backbone after the others if late else before them, device, pass, lane)
        best: tuple[float, int, int, int, tuple[int, int, int] | None] | None = None
        for d in range(index.devices):
            due = math.inf  # the latest the backbone's next pass here may start
            if at[d] < len(queues[d]):
                task = queues[d][at[d]]
                ready = _ready(index, end, task, free[d])
                # Over the limit it waits for a backward here to free memory: the others run.
                if held[d] + index.memory[task] <= limit:
                    if ready is not None:
                        due = (max(ready, latest[task]) if late else ready) + slack_s
                        key = (ready, 1 if late else -1, d, task, None)
                        best = min(best, key) if best else key
                    elif late and anticipate:  # its input is not placed yet: due all the same
                        due = latest[task] + slack_s
            for lane in lanes[d]:
                for task in _lane_heads(index, models, lane, taken[lane]):
                    start = _ready(index, end, task, free[d])
                    if start is None or start + index.cost[task] > due + 1e-9:
                        continue
                    if held[d] + index.memory[task] > limit:
                        continue
                    if bounded and not index.tasks[task].backward and taken[lane][0] - taken[lane][1] >= \
                            models[lane[0]].virtual_stages - lane[2]:
                        continue
                    best = min(best, (start, 0, d, task, lane)) if best else (start, 0, d, task, lane)
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


def _latest_starts(model: PipelineModel, m: int, index: TaskIndex) -> dict[int, float]:
    """For each pass of ``model`` (model ``m`` of ``index``), the latest it can start
    in the model's own 1F1B order with the model alone still finishing when that
    schedule does: its end time's slack, passed back along the device orders and the
    passes' dependencies."""
    alone = TaskIndex([model])
    orders = alone.orders(one_f_one_b(model))
    end = run_orders(alone, orders)
    assert end is not None, "1F1B runs"
    successors: list[list[int]] = [list(children) for children in alone.dependents]
    for order in orders:
        for a, b in itertools.pairwise(order):
            successors[a].append(b)
    waiting = [len(s) for s in successors]
    before: list[list[int]] = [[] for _ in alone.tasks]
    for t, children in enumerate(successors):
        for child in children:
            before[child].append(t)
    latest = [max(end)] * len(alone.tasks)
    todo = [t for t, n in enumerate(waiting) if n == 0]
    while todo:  # from the last passes back
        t = todo.pop()
        latest[t] = min([latest[c] for c in successors[t]], default=max(end)) - alone.cost[t]
        for parent in before[t]:
            waiting[parent] -= 1
            if waiting[parent] == 0:
                todo.append(parent)
    return {index.ids[alone.tasks[t]._replace(model=m)]: latest[t] for t in range(len(alone.tasks))}


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
