"""Replaying a workload under a placement with the runtime's scheduling rules.

An event-driven simulation of ``asyncflow.runtime._scheduler``'s dispatchers, one per pool:

- Calls to a pool's roles join its queue in submission order. A gang call runs on
  every rank of the pool; it starts when its inputs are ready, no earlier call
  waits and nothing runs on the pool. A rank-local call starts on all the pool's
  free ranks (its rows split over them) once its inputs are ready; it never passes
  a waiting call of its own role, and passes a waiting gang call only while a gang
  call runs on the pool (else the waiting one could starve). A call on a
  streamed micro-batch not produced yet is not made yet: it holds back later calls
  of its role and later gang calls only (the runtime's open stream slot).
- A streamed call (one that handed out micro-batches) gives each rank back when
  that rank is done, at the fractions of its duration measured for its ranks; a
  call that streams nothing holds all its ranks to its end.
- Inputs are ready when every dependency finished and every streamed micro-batch
  read was produced: producer start + fraction * producer duration, i.e. when the
  producer's progress reaches the micro-batch's measured fraction.
- Calls on the micro-batches of a streamed call on the caller's own pool are
  read as the algorithm loops make them: one call on the whole batch after the
  streamed call (``Workload.on_placement``).
- A step's calls are submitted together, when the previous step's last call
  finished plus a fixed driver overhead.
- On a CPU machine each worker process runs ``max(1, cores // world)`` threads;
  when the busy workers (ranks held by running calls) want more threads than there
  are cores, every running call progresses at ``cores / threads wanted``
  (processor sharing). Calls running side by side also slow each other where
  they do not share a core (memory bandwidth, caches, the driver's work for
  them): with ``interference`` a, a call's rate is further divided by ``1 + a *
  o``, ``o`` the busy cores that other calls' threads take (``a`` is fitted
  from a profiled overlapped run, see :func:`asyncflow.plan.profile`). A
  placement with more worker processes than cores is slower even one call at a
  time (its processes take turns on the cores): with ``oversubscription`` s, every
  call's rate is divided by ``1 + s * max(0, world - cores) / cores`` (``s`` is
  fitted from profiled serial runs with fewer and with more processes).

Rates are piecewise constant: they change only when a call starts or ends, so the
simulation jumps from event to event (a call ends, a watched micro-batch is
produced, a step is submitted) and recomputes remaining work in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from asyncflow.plan._candidates import Placement
from asyncflow.plan._workload import CostModel, WorkCall, Workload

_TOL = 1e-9


class SimSpan(NamedTuple):
    """One simulated call (for debugging a prediction)."""

    pool: str
    ranks: tuple[int, ...]
    label: str
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the simulation of a placement predicts."""

    step_s: float
    """Mean seconds per step over the steps after the first (the only step when one)."""
    total_s: float
    """Seconds until the last call of the last step finished."""
    steps_s: tuple[float, ...]
    """Seconds of each step: from the previous step's end to its own."""
    busy_s: Mapping[str, float]
    """Per pool, rank-seconds of calls divided by its devices (mean busy time of a rank)."""
    spans: tuple[SimSpan, ...] = ()
    """Every simulated call, in start order."""


@dataclass(eq=False, kw_only=True)
class _Running:
    call: WorkCall
    pool: str
    ranks: tuple[int, ...]
    start: float
    work: float
    """Seconds it takes at rate 1."""
    done: float = 0.0
    held: list[int] = field(default_factory=list)
    """Ranks not given back yet."""
    releases: list[tuple[float, int]] = field(default_factory=list)
    """``(fraction, rank)``: when a streamed call gives a rank back, ascending."""
    watch: list[float] = field(default_factory=list)
    """Progress (seconds of work) at which a micro-batch someone reads is produced."""

    def progress_reached(self, fraction: float) -> bool:
        return self.done >= fraction * self.work - _TOL * (1.0 + self.work)


@dataclass(eq=False, kw_only=True)
class _Pool:
    name: str
    devices: int
    free: set[int]
    queue: list[WorkCall] = field(default_factory=list)
    running: list[_Running] = field(default_factory=list)


class _Simulation:
    def __init__(self, workload: Workload, costs: CostModel, placement: Placement, *,
                 cores: int | None, step_overhead_s: float, interference: float,
                 oversubscription: float) -> None:
        self.costs, self.cores, self.overhead = costs, cores, step_overhead_s
        self.interference = interference
        self.slowdown = 1.0 if cores is None else oversubscribed(placement.world, cores, oversubscription)
        self.pool_of = dict(placement.roles)
        self.pools = {n: _Pool(name=n, devices=d, free=set(range(d)))
                      for n, d in placement.pools.items()}
        self.threads = 1 if cores is None else max(1, cores // placement.world)
        self.by_step: list[list[WorkCall]] = [[] for _ in range(workload.steps)]
        for c in workload.calls:
            self.by_step[c.step].append(c)
        self.watched: dict[int, set[float]] = {}
        for c in workload.calls:
            for p in c.parts:
                if p.fraction < 1.0:
                    self.watched.setdefault(p.call, set()).add(p.fraction)
        self.running: dict[int, _Running] = {}
        self.finished: set[int] = set()
        self.spans: list[SimSpan] = []
        self.busy = dict.fromkeys(self.pools, 0.0)
        self.step_ends: list[float] = []
        self.now = 0.0
        self.next_step = 0
        self.submit_at: float | None = step_overhead_s if workload.steps else None

    def run(self) -> None:
        while True:
            if self.submit_at is not None and self.submit_at <= self.now + _TOL:
                self.submit()
            for pool in self.pools.values():
                self.dispatch(pool)
            if self.submit_at is None and not self.running:
                if self.next_step < len(self.by_step) or any(p.queue for p in self.pools.values()):
                    self.deadlock()
                return
            self.advance()

    def submit(self) -> None:
        """Queue the next step's calls, each on its role's pool, in submission order."""
        self.submit_at = None
        calls = self.by_step[self.next_step]
        self.next_step += 1
        for c in calls:
            self.pools[self.pool_of[c.role]].queue.append(c)
        if not calls:  # nothing to await: the step ends as it starts
            self.end_step()

    def end_step(self) -> None:
        self.step_ends.append(self.now)
        if self.next_step < len(self.by_step):
            self.submit_at = self.now + self.overhead

    def rates(self) -> dict[int, float]:
        """Each running call's progress per second (see the module docstring)."""
        if self.cores is None:
            return dict.fromkeys(self.running, 1.0)
        wanted = {i: self.threads * len(r.held) for i, r in self.running.items()}
        total = sum(wanted.values())
        if not total:
            return dict.fromkeys(self.running, 1.0 / self.slowdown)
        share, busy = min(1.0, self.cores / total) / self.slowdown, min(total, self.cores)
        return {i: share / (1.0 + self.interference * busy * (1.0 - w / total)) for i, w in wanted.items()}

    def advance(self) -> None:
        """Jump to the next event, then end the calls that are done."""
        rates = self.rates()
        dt = float("inf") if self.submit_at is None else self.submit_at - self.now
        for i, r in self.running.items():
            dt = min(dt, (r.work - r.done) / rates[i])
            marks = [*r.watch, *(f * r.work for f, _ in r.releases)]
            ahead = [w for w in marks if w - r.done > _TOL * (1.0 + r.work)]
            if ahead:
                dt = min(dt, (min(ahead) - r.done) / rates[i])
        dt = max(0.0, dt)
        self.now += dt
        for i, r in self.running.items():
            r.done += rates[i] * dt
            while r.releases and r.progress_reached(r.releases[0][0]):
                self.give_back(r, r.releases.pop(0)[1])
        for r in [r for r in self.running.values() if r.progress_reached(1.0)]:
            self.finish(r)

    def give_back(self, r: _Running, rank: int) -> None:
        r.held.remove(rank)
        self.pools[r.pool].free.add(rank)
        self.busy[r.pool] += self.now - r.start

    def finish(self, r: _Running) -> None:
        del self.running[r.call.index]
        pool = self.pools[r.pool]
        pool.running.remove(r)
        for rank in list(r.held):
            self.give_back(r, rank)
        self.finished.add(r.call.index)
        self.spans.append(SimSpan(r.pool, r.ranks, r.call.label, r.start, self.now))
        step = self.by_step[r.call.step]
        if all(c.index in self.finished for c in step):
            self.end_step()

    def ready(self, call: WorkCall) -> bool:
        if any(d not in self.finished for d in call.deps):
            return False
        for p in call.parts:
            if p.call in self.finished:
                continue
            producer = self.running.get(p.call)
            if producer is None or not producer.progress_reached(p.fraction):
                return False
        return True

    def made(self, call: WorkCall) -> bool:
        """Whether the runtime would have made the call yet: a call on a streamed
        micro-batch is made when the micro-batch is out."""
        return all(p.call in self.finished or (p.call in self.running
                                               and self.running[p.call].progress_reached(p.fraction))
                   for p in call.parts)

    def dispatch(self, pool: _Pool) -> None:
        """Start every call that can start now (as ``Scheduler._dispatch`` does)."""
        earlier = False  # an earlier call is still waiting
        gang_ahead = False  # an earlier gang call is waiting
        blocked_roles: set[str] = set()
        held_by_gang = any(not r.call.rank_local for r in pool.running)
        for call in list(pool.queue):
            if not self.made(call):  # the runtime's open slot: holds its role and gang calls
                earlier = True
                blocked_roles.add(call.role)
                continue
            ready = self.ready(call)
            if not call.rank_local:
                if ready and not earlier and not pool.running:
                    self.start(pool, call, sorted(pool.free))
                    continue
                earlier = gang_ahead = True
                blocked_roles.add(call.role)
                continue
            lanes = sorted(pool.free)
            if (ready and lanes and call.role not in blocked_roles
                    and (not gang_ahead or held_by_gang)):
                self.start(pool, call, lanes)
                continue
            earlier = True
            blocked_roles.add(call.role)

    def start(self, pool: _Pool, call: WorkCall, lanes: list[int]) -> None:
        work = self.costs.predict(call.role, call.method, len(lanes), call.rows_in)
        r = _Running(call=call, pool=pool.name, ranks=tuple(lanes), start=self.now, work=work,
                     held=list(lanes),
                     releases=sorted(zip(_lane_fractions(call.release, len(lanes)), lanes, strict=True)),
                     watch=sorted(f * work for f in self.watched.get(call.index, ())))
        pool.queue.remove(call)
        pool.free.difference_update(lanes)
        pool.running.append(r)
        self.running[call.index] = r

    def deadlock(self) -> None:
        waiting = [f"{c.label} on {p.name}" for p in self.pools.values() for c in p.queue]
        raise ValueError(f"the workload cannot finish under this placement: {', '.join(waiting)} "
                         "wait for inputs that nothing will produce (a dependency on a later call "
                         "of the same pool?)")

    def prediction(self) -> Prediction:
        steps_s = tuple(end - before for end, before in
                        zip(self.step_ends, [0.0, *self.step_ends[:-1]], strict=True))
        later = steps_s[1:] or steps_s
        busy = {n: self.busy[n] / p.devices for n, p in self.pools.items()}
        return Prediction(step_s=sum(later) / len(later) if later else 0.0,
                          total_s=self.step_ends[-1] if self.step_ends else 0.0,
                          steps_s=steps_s, busy_s=busy,
                          spans=tuple(sorted(self.spans, key=lambda s: (s.start, s.end, s.label))))


def _lane_fractions(release: tuple[float, ...], lanes: int) -> list[float]:
    """When each of ``lanes`` ranks is given back, as fractions of the call's duration.

    Measured on ``m`` ranks, the ``j``-th of ``lanes`` (from 0) takes the
    ``ceil((j + 1) m / lanes)``-th measured fraction, so one lane takes the last
    (the call's end) and ``m`` lanes take them all; no measure: all at the end.
    """
    m = len(release)
    if not m:
        return [1.0] * lanes
    return [release[-(-(j + 1) * m // lanes) - 1] for j in range(lanes)]


def simulate(workload: Workload, costs: CostModel, placement: Placement, *, steps: int = 3,
             cores: int | None = None, step_overhead_s: float = 0.0, migrate: bool = False,
             interference: float = 0.0, oversubscription: float = 0.0) -> Prediction:
    """Predict how long the workload's steps take under ``placement``.

    Args:
        workload: the calls of one (or more) steps.
        costs: seconds per call.
        placement: pools and the pool of each role.
        steps: how many times to run the workload's steps, one after the other.
        cores: CPU cores of the machine (calls share them, see the module
            docstring), or ``None`` on GPUs (no sharing).
        step_overhead_s: the driver's time between a step's end and the next
            step's calls (also before the first step).
        migrate: the streamed calls migrate their long tail (rank-local calls on
            their micro-batches stay per micro-batch on the producer's pool).
        interference: how much calls side by side on a CPU machine slow each
            other beyond sharing cores (see the module docstring; 0: not at all).
        oversubscription: how much more every call costs per worker process
            beyond one per core, relative to the cores (see
            :func:`oversubscribed`; 0: nothing).

    Returns:
        The prediction, with every simulated call in ``spans``.

    Raises:
        ValueError: a role of the workload has no pool in ``placement``, bad
            ``steps``, ``cores``, ``step_overhead_s``, ``interference`` or
            ``oversubscription``, or the workload cannot
            finish (a call waits for one queued behind it).
        MissingCostError: ``costs`` never measured a method the workload calls.
    """
    missing = [r for r in workload.roles if r not in placement.roles]
    if missing:
        raise ValueError(f"placement {placement.describe()!r} gives no pool to {missing}; "
                         "place every role of the workload")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be >= 1 (or None for GPUs), got {cores}")
    if step_overhead_s < 0:
        raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s}")
    if interference < 0:
        raise ValueError(f"interference must be >= 0, got {interference}")
    if oversubscription < 0:
        raise ValueError(f"oversubscription must be >= 0, got {oversubscription}")
    workload = workload.on_placement(placement.roles, placement.pools, migrate=migrate)
    sim = _Simulation(workload.repeat(steps), costs, placement, cores=cores,
                      step_overhead_s=step_overhead_s, interference=interference,
                      oversubscription=oversubscription)
    sim.run()
    return sim.prediction()


def rank(workload: Workload, costs: CostModel, placements: Sequence[Placement], *,
         cores: int | None = None, steps: int = 3, step_overhead_s: float = 0.0,
         interference: float = 0.0, oversubscription: float = 0.0) -> list[tuple[Placement, Prediction]]:
    """Simulate every placement and sort them by predicted seconds per step
    (fastest first; ties keep ``placements``' order).

    Arguments and errors as for :func:`simulate`.
    """
    results = [(p, simulate(workload, costs, p, steps=steps, cores=cores, step_overhead_s=step_overhead_s,
                            interference=interference, oversubscription=oversubscription))
               for p in placements]
    return sorted(results, key=lambda pair: pair[1].step_s)


def oversubscribed(world: int, cores: int, oversubscription: float) -> float:
    """How many times longer every call takes on a CPU machine when ``world``
    single-rank worker processes share ``cores`` cores: ``1 + oversubscription *
    max(0, world - cores) / cores`` (1 with no more processes than cores)."""
    return 1.0 + oversubscription * max(0, world - cores) / cores
