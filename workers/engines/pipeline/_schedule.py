"""Pipeline schedules as data: which forward and backward passes each device runs, in
which order, and what that order costs.

A :class:`PipelineModel` describes one model's pipelines over a row of devices (the
pipeline-stage groups of a pool): its stage count, micro-batches, per-stage costs and
direction. A :class:`Schedule` gives every device its ordered list of
:class:`Task`\\ s (one forward or backward pass of one micro-batch through one stage).
The schedule builders (:mod:`._builders`, :mod:`._fusion`) produce schedules,
:func:`~workers.engines.pipeline.run_schedule` runs one on this rank's stages, and
:func:`simulate` says what one costs: when each pass ends, the finish time, and
each device's peak of held activations.

Dependencies are the model's own: a forward of stage ``s`` needs the forward of stage
``s - 1`` of the same micro-batch; a backward of stage ``s`` needs the backward of
stage ``s + 1`` (the last stage's backward needs its own forward). Nothing else orders
passes of different devices, so a schedule is valid when these dependencies and each
device's order leave no cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from workers.engines._errors import EngineConfigError

__all__ = ["PipelineModel", "Schedule", "ScheduleError", "Simulation", "Task", "simulate"]


class ScheduleError(EngineConfigError):
    """A schedule that cannot run: a device misses or repeats a pass, or the order
    deadlocks (a cycle between the devices' orders and the passes' dependencies)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineModel:
    """One model's pipelines over a row of devices.

    The model is cut into ``stages * chunks`` consecutive virtual stages; virtual
    stage ``v`` runs on device ``v % stages`` of its pipeline (``chunks > 1`` is the
    interleaved layout, each device holding ``chunks`` non-adjacent pieces). With
    ``pipelines = k`` the devices hold ``k`` disjoint pipelines side by side (RLHFuse's
    fusion factor: ``k`` data-parallel copies of a model with ``stages`` stages, fused
    with a model that spans all ``k * stages`` devices).
    """

    name: str
    """Names the model in reports (``"actor"``, ``"critic"``)."""
    stages: int
    """Pipeline stages (devices) per pipeline."""
    micro_batches: int
    """Micro-batches each pipeline processes in one training step."""
    forward_s: float = 1.0
    """Seconds (or any unit) of one micro-batch's forward through one virtual stage."""
    backward_s: float = 2.0
    """The same for its backward."""
    activation: float = 1.0
    """Activation memory one micro-batch holds on one virtual stage from its forward
    to its backward (any unit)."""
    chunks: int = 1
    """Virtual stages per device (interleaved 1F1B when above 1)."""
    pipelines: int = 1
    """Disjoint pipelines over the row of devices (the fusion factor)."""
    reverse: bool = False
    """Whether stage 0 sits on the row's last device (the second model of a
    bidirectional, fused schedule runs its pipelines the other way)."""

    def __post_init__(self) -> None:
        for field in ("stages", "micro_batches", "chunks", "pipelines"):
            if getattr(self, field) < 1:
                raise EngineConfigError(f"PipelineModel.{field} must be at least 1, got {getattr(self, field)}")
        for field in ("forward_s", "backward_s", "activation"):
            if getattr(self, field) < 0:
                raise EngineConfigError(f"PipelineModel.{field} must not be negative, got {getattr(self, field)}")

    @property
    def devices(self) -> int:
        """Devices the model's pipelines cover: ``stages * pipelines``."""
        return self.stages * self.pipelines

    @property
    def virtual_stages(self) -> int:
        """Stages of one pipeline counting each chunk: ``stages * chunks``."""
        return self.stages * self.chunks

    def device_of(self, pipeline: int, stage: int) -> int:
        """The device (0-based, along the row) that runs virtual ``stage`` of ``pipeline``."""
        device = pipeline * self.stages + stage % self.stages
        return self.devices - 1 - device if self.reverse else device


class Task(NamedTuple):
    """One pass of one micro-batch through one virtual stage of one model."""

    model: int
    """Index of the model in :attr:`Schedule.models`."""
    pipeline: int
    micro_batch: int
    stage: int
    """Virtual stage (``0 .. stages * chunks - 1``)."""
    backward: bool


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Each device's ordered passes, for the models sharing a row of devices.

    Build with the builders (:func:`one_f_one_b`, :func:`fused_greedy`,
    :func:`backfilled`, :func:`fused_annealed`); :func:`simulate` checks one.
    """

    models: tuple[PipelineModel, ...]
    orders: tuple[tuple[Task, ...], ...]
    """``orders[d]``: device ``d``'s passes in the order it runs them."""

    @property
    def devices(self) -> int:
        """The row's devices."""
        return len(self.orders)

    def describe(self) -> str:
        """One line per device, ``F``/``B`` + model letter + micro-batch (for logs and tests)."""
        letters = "abcdefghijklmnopqrstuvwxyz"
        return "\n".join(
            " ".join(f"{'B' if t.backward else 'F'}{letters[t.model]}{t.micro_batch}" for t in order)
            for order in self.orders
        )


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What a schedule costs when every pass takes its model's stated time and
    messages between devices are free."""

    finish_s: float
    """When the last pass ends."""
    peak_activation: tuple[float, ...]
    """Per device: the most activation memory held at once."""
    busy_s: tuple[float, ...]
    """Per device: the seconds it computes."""

    @property
    def peak(self) -> float:
        """The largest device peak of held activations."""
        return max(self.peak_activation, default=0.0)

    @property
    def bubble(self) -> float:
        """Fraction of the devices' time (until ``finish_s``) spent idle."""
        total = self.finish_s * len(self.busy_s)
        return 1.0 - sum(self.busy_s) / total if total else 0.0


class TaskIndex:
    """Integer ids for the tasks of ``models`` and, per id, its device, cost,
    activation, dependency and dependents: the simulator's and the searches' tables."""

    def __init__(self, models: Sequence[PipelineModel]) -> None:
        devices = {m.devices for m in models}
        if len(devices) != 1:
            raise EngineConfigError(
                "models fused on one row of devices must cover the same devices (stages * pipelines); got "
                + ", ".join(f"{m.name}: {m.devices}" for m in models)
            )
        self.models = tuple(models)
        self.devices = devices.pop()
        self.tasks: list[Task] = []
        self.device: list[int] = []
        self.cost: list[float] = []
        self.memory: list[float] = []  # + on a forward, - on its backward
        self.dependency: list[int] = []  # -1: none
        self.ids: dict[Task, int] = {}
        for m, model in enumerate(models):
            for j in range(model.pipelines):
                for mb in range(model.micro_batches):
                    for s in range(model.virtual_stages):
                        for backward in (False, True):
                            self._add(Task(m, j, mb, s, backward), model)
        self.dependents: list[list[int]] = [[] for _ in self.tasks]
        for i, task in enumerate(self.tasks):
            last = self.models[task.model].virtual_stages - 1
            dep: Task | None
            if task.backward:
                dep = task._replace(backward=task.stage != last, stage=min(task.stage + 1, last))
            else:
                dep = task._replace(stage=task.stage - 1) if task.stage > 0 else None
            self.dependency.append(-1 if dep is None else self.ids[dep])
            if dep is not None:
                self.dependents[self.ids[dep]].append(i)

    def _add(self, task: Task, model: PipelineModel) -> None:
        self.ids[task] = len(self.tasks)
        self.tasks.append(task)
        self.device.append(model.device_of(task.pipeline, task.stage))
        self.cost.append(model.backward_s if task.backward else model.forward_s)
        self.memory.append(-model.activation if task.backward else model.activation)

    def orders(self, schedule: Schedule) -> list[list[int]]:
        """``schedule``'s orders as ids, checked: each device runs exactly its own passes once."""
        if schedule.devices != self.devices:
            raise ScheduleError(f"the schedule has {schedule.devices} devices, its models cover {self.devices}")
        seen = [False] * len(self.tasks)
        orders: list[list[int]] = []
        for d, order in enumerate(schedule.orders):
            ids = []
            for task in order:
                i = self.ids.get(task)
                if i is None or self.device[i] != d or seen[i]:
                    why = "is not a pass of its models" if i is None else (
                        f"belongs on device {self.device[i]}" if self.device[i] != d else "comes twice")
                    raise ScheduleError(f"device {d}: {task} {why}")
                seen[i] = True
                ids.append(i)
            orders.append(ids)
        if not all(seen):
            raise ScheduleError(f"no device runs {self.tasks[seen.index(False)]}")
        return orders

    def schedule(self, orders: Sequence[Sequence[int]]) -> Schedule:
        """The :class:`Schedule` of id ``orders``."""
        return Schedule(self.models, tuple(tuple(self.tasks[i] for i in order) for order in orders))


def run_orders(index: TaskIndex, orders: Sequence[Sequence[int]]) -> list[float] | None:
    """Each task's end time when the devices run ``orders``; None if they deadlock.

    Each device runs its next pass as soon as the device is free and the pass's one
    dependency has ended; a device whose next pass waits is woken by that dependency.
    """
    end: list[float] = [-1.0] * len(index.tasks)
    free = [0.0] * len(orders)
    position = [0] * len(orders)
    dependency, cost, device, dependents = index.dependency, index.cost, index.device, index.dependents
    ready = list(range(len(orders)))
    done = 0
    while ready:
        d = ready.pop()
        order, at = orders[d], position[d]
        while at < len(order):
            task = order[at]
            dep = dependency[task]
            start = free[d]
            if dep >= 0:
                if end[dep] < 0:
                    break
                start = max(start, end[dep])
            free[d] = end[task] = start + cost[task]
            at += 1
            for child in dependents[task]:
                if device[child] != d:
                    ready.append(device[child])
        done += at - position[d]
        position[d] = at
    return end if done == len(index.tasks) else None


def peaks(index: TaskIndex, orders: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Per device, the most activation memory held at once running ``orders``."""
    out = []
    memory = index.memory
    for order in orders:
        held = peak = 0.0
        for task in order:
            held += memory[task]
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


def simulate(schedule: Schedule) -> Simulation:
    """The finish time, device peaks of held activations and busy time of ``schedule``.

    Raises:
        ScheduleError: if a device misses or repeats a pass, runs another device's, or
            the orders deadlock.
    """
    index = TaskIndex(schedule.models)
    orders = index.orders(schedule)
    end = run_orders(index, orders)
    if end is None:
        raise ScheduleError("the schedule deadlocks: a device waits for a pass that waits for it\n"
                            + schedule.describe())
    busy = tuple(sum(index.cost[t] for t in order) for order in orders)
    return Simulation(finish_s=max(end, default=0.0), peak_activation=peaks(index, orders), busy_s=busy)
