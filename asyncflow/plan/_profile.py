"""Profiling a job on real workers, then predicting placements from the profile.

:func:`profile` runs a few steps of a job one call at a time (``session.serial``,
so no call shares the machine with another) under two placements: every role on
its own 1-device pool, and every role on one pool of all the devices. The traces
give each call's cost on 1 and on N ranks (:class:`CostModel`) and the job's call
graph, batch and streamed (:class:`Workload`). On a CPU machine it then times a
few steps of the first placement with calls overlapping, and fits how much calls
side by side slow each other (``Profile.interference``); and where the roles
outnumber the cores, it runs the job serially once more on one 1-device pool per
core, and fits how much every call slows with more processes than cores
(``Profile.oversubscription``). :func:`predict` then simulates any placement.
This module runs Ray (lazily imported); the rest of the package is pure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from asyncflow.plan._candidates import Placement
from asyncflow.plan._simulate import Prediction, oversubscribed, rank, simulate
from asyncflow.plan._workload import CostModel, Workload, trace_samples

if TYPE_CHECKING:
    from asyncflow.runtime import Session
    from asyncflow.tracing import Trace


class Stepper(Protocol):
    """A job's roles, spawned in a session."""

    async def step(self, *, stream: bool) -> object:
        """One step of the algorithm (``stream``: the streamed variant)."""
        ...


class PlanJob(Protocol):
    """What the planner profiles: roles and an algorithm step."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The job's roles."""
        ...

    async def start(self, placement: Placement, session: Session) -> Stepper:
        """Spawn the roles on ``placement`` in ``session`` and put the data."""
        ...


@dataclass(kw_only=True)
class Profile:
    """What :func:`profile` measured."""

    costs: CostModel
    batch: Workload
    stream: Workload | None
    traces: dict[str, list[Trace]] = field(default_factory=dict)
    """Per profiled placement (``"1"`` and ``"<N>"`` devices per pool), its traces."""
    step_overhead_s: float = 0.0
    """Driver time per step outside any call (the serial steps' wall time minus
    their calls' time, per step)."""
    overlapped_s: dict[str, float] = field(default_factory=dict)
    """On a CPU machine, seconds per step of the 1-device-per-role placement with
    calls overlapping (``"batch"``, ``"stream"``): what ``interference`` is fitted to."""
    interference: float = 0.0
    """How much calls side by side slow each other beyond sharing cores (the
    simulator's ``interference``), fitted to ``overlapped_s``; 0 on GPUs."""
    oversubscription: float = 0.0
    """How much every call slows per worker process beyond one per core (the
    simulator's ``oversubscription``), fitted to the serial runs of the ``"1"`` and
    ``"packed"`` placements; 0 on GPUs or with no more roles than cores. ``costs``
    are those of a machine with no more processes than cores."""

    def workload(self, stream: bool) -> Workload:
        """The streamed workload when ``stream`` and profiled, else the batch one."""
        return self.stream if stream and self.stream is not None else self.batch


def profile_placements(roles: Sequence[str], devices: int, *,
                       cores: int | None = None) -> dict[str, Placement]:
    """The placements :func:`profile` runs: one pool per role with 1 device, and
    (with more than one device) one pool of ``devices`` for every role; with
    ``cores`` fewer than the roles, also ``"packed"``: one 1-device pool per core,
    the roles dealt out over them in turn."""
    out = {"1": Placement(pools={r: 1 for r in roles}, roles={r: r for r in roles})}
    if cores is not None and len(roles) > cores:  # right after "1": the machine drifts
        out["packed"] = Placement(pools={f"core{i}": 1 for i in range(cores)},
                                  roles={r: f"core{i % cores}" for i, r in enumerate(roles)})
    if devices > 1:
        out[str(devices)] = Placement(pools={"all": devices}, roles=dict.fromkeys(roles, "all"))
    return out


async def profile(job: PlanJob, *, devices: int, stream: bool = True, steps: int = 2,
                  cores: int | None = None) -> Profile:
    """Run ``job`` serially under :func:`profile_placements` and fit its costs.

    Each placement gets its own session (on the Ray instance running, else on one
    it starts and stops): a warm-up step of each kind, then
    ``steps`` traced batch steps (and ``steps`` streamed ones with ``stream``).
    With ``cores`` (a CPU machine), the first placement then runs ``steps`` more of
    each kind with calls overlapping, and ``Profile.interference`` is fitted to them;
    and with more roles than cores, the ``"packed"`` placement runs ``steps`` serial
    batch steps, and ``Profile.oversubscription`` is fitted to its calls' time
    against the first placement's (:func:`fit_oversubscription`).
    """
    from asyncflow.runtime import Session

    traces: dict[str, list[Trace]] = {}
    overheads: list[float] = []
    overlapped: dict[str, float] = {}
    placements = profile_placements(job.roles, devices, cores=cores)
    for name, placement in placements.items():
        async with Session() as session:
            stepper = await job.start(placement, session)
            session.serial = True
            kinds = [False, True] if stream and name != "packed" else [False]
            for kind in kinds:
                await stepper.step(stream=kind)
            traces[name] = []
            for kind in kinds:
                await session.start_trace()
                for _ in range(steps):
                    session.mark_step()
                    await stepper.step(stream=kind)
                trace = session.stop_trace()
                traces[name].append(trace)
                busy = sum(c.seconds for c in trace.calls)
                overheads.append(max(0.0, (trace.end - trace.start) - busy) / steps)
            session.serial = False
            if cores is not None and name == "1":
                for kind in kinds:
                    began = time.perf_counter()
                    for _ in range(steps):
                        await stepper.step(stream=kind)
                    overlapped["stream" if kind else "batch"] = (time.perf_counter() - began) / steps
    one = traces["1"]
    over = 0.0
    if cores is not None and "packed" in traces:
        over = fit_oversubscription(one[0], traces["packed"][0], placements["1"].world, cores=cores)
    slowdown = {name: 1.0 if cores is None else oversubscribed(placements[name].world, cores, over)
                for name in traces}
    costs = CostModel([s for name, ts in traces.items() for t in ts for s in trace_samples(t, 1 / slowdown[name])])
    found = Profile(costs=costs, batch=Workload.from_trace(one[0]),
                    stream=Workload.from_trace(one[1]) if stream else None, traces=traces,
                    step_overhead_s=min(overheads), overlapped_s=overlapped, oversubscription=over)
    if cores is not None:
        found.interference = fit_interference(found, placements["1"], cores=cores)
    return found


def fit_oversubscription(crowded: Trace, packed: Trace, world: int, *, cores: int) -> float:
    """The ``oversubscription`` s that explains serial calls taking longer with
    ``world`` single-rank processes (``crowded``) than with ``cores`` of them
    (``packed``, the same calls): their total time's ratio is ``1 + s * (world -
    cores) / cores``; 0 when it is not above 1 or ``world <= cores``."""
    if world <= cores:
        return 0.0
    ratio = sum(c.seconds for c in crowded.calls if c.ok) / max(1e-9, sum(c.seconds for c in packed.calls if c.ok))
    return max(0.0, (ratio - 1.0) * cores / (world - cores))


_GRID = tuple(i / 100 for i in range(101))


def fit_interference(found: Profile, placement: Placement, *, cores: int,
                     grid: Sequence[float] = _GRID) -> float:
    """The ``interference`` in ``grid`` whose predictions of ``placement`` come
    closest to ``found.overlapped_s`` (least squares of the log ratios); 0 when
    nothing overlapping was timed."""
    runs = [(found.workload(kind == "stream"), s) for kind, s in found.overlapped_s.items() if s]
    if not runs:
        return 0.0

    def error(a: float) -> float:
        return sum(math.log(simulate(w, found.costs, placement, cores=cores, interference=a,
                                     oversubscription=found.oversubscription,
                                     step_overhead_s=found.step_overhead_s).step_s / s) ** 2
                   for w, s in runs)

    return min(grid, key=error)


def predict(found: Profile, placement: Placement, *, cores: int | None, stream: bool = False,
            steps: int = 3) -> Prediction:
    """Seconds per step of the profiled job under ``placement`` (``stream``: the
    streamed variant, as the algorithm loops run it there, without migration)."""
    return simulate(found.workload(stream), found.costs, placement, steps=steps, cores=cores,
                    step_overhead_s=found.step_overhead_s, interference=found.interference,
                    oversubscription=found.oversubscription)


def rank_profiled(found: Profile, placements: Sequence[Placement], *, cores: int | None,
                  stream: bool = False) -> list[tuple[Placement, Prediction]]:
    """:func:`~asyncflow.plan.rank` of ``placements`` on the profiled job, as
    :func:`predict` predicts each (the driver's overhead and the fitted interference)."""
    return rank(found.workload(stream), found.costs, placements, cores=cores,
                step_overhead_s=found.step_overhead_s, interference=found.interference,
                oversubscription=found.oversubscription)


def sequential_s(found: Profile, placement: Placement, *, cores: int | None = None) -> float:
    """Seconds per step with one call at a time: the sum of the calls' predicted
    costs on their roles' pools (on ``cores`` CPU cores, slowed by the profile's
    ``oversubscription``), plus the driver's time per step."""
    total = 0.0
    for call in found.batch.calls:
        ranks = placement.pools[placement.roles[call.role]]
        total += found.costs.predict(call.role, call.method, ranks, call.rows_in)
    slowdown = 1.0 if cores is None else oversubscribed(placement.world, cores, found.oversubscription)
    return total * slowdown / max(1, found.batch.steps) + found.step_overhead_s
