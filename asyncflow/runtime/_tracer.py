"""Recording a trace of a session's calls (see ``asyncflow.tracing`` for the model
and the exports).

The scheduler calls the hooks below at submit, start, each rank's return, each
streamed micro-batch and the end of a call, only while a :class:`Tracer` is
recording: with tracing off each hook is one attribute test. A traced call asks
its ranks to time themselves (``CallSpec.trace``); their spans come back with
their results, on their own clocks, and are shifted here by each worker's clock
offset, measured when recording starts (the ping with the shortest round trip).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncflow.tracing import CallRecord, PullSpan, RankSpan, Trace
from channels import RankResult

if TYPE_CHECKING:
    from asyncflow.runtime._calls import Call

Clock = Callable[[int], Awaitable[float]]
"""A worker's ``time.time()``."""

PINGS = 5
"""Clock pings per worker when recording starts."""


@dataclass
class _Open:
    """A call being recorded."""

    submitted: float
    step: int
    pool: str = ""
    started: float = 0.0
    deps: tuple[int, ...] = ()
    parts: tuple[tuple[int, int], ...] = ()
    ranks: list[tuple[int, RankResult]] = field(default_factory=list)
    part_times: list[float] = field(default_factory=list)


class Tracer:
    """Records the calls of a session while on (``Runtime.start_trace``)."""

    def __init__(self, pools: Mapping[str, Sequence[int]], roles: Mapping[str, str]) -> None:
        self.recording = False
        self._pools = {name: list(workers) for name, workers in pools.items()}
        self._roles = dict(roles)
        self._offsets: dict[int, float] = {}
        self._open: dict[int, _Open] = {}
        self._trace = Trace()

    async def start(self, clock: Clock) -> None:
        """Measure every worker's clock offset, then record from now on."""
        for workers in self._pools.values():
            for w in workers:
                self._offsets[w] = await _offset(clock, w)
        self._open.clear()
        self._trace = Trace(pools={n: len(w) for n, w in self._pools.items()}, roles=dict(self._roles),
                            start=time.time())
        self.recording = True

    def stop(self) -> Trace:
        """Stop recording; the trace of the calls that ended meanwhile."""
        self.recording = False
        self._open.clear()
        self._trace.end = time.time()
        self._trace.calls.sort(key=lambda c: (c.place, c.call_id))  # recorded as they ended
        return self._trace

    def mark_step(self) -> None:
        """A new step of the algorithm starts (its calls get the next step number)."""
        if self.recording:
            self._trace.steps.append(time.time())

    # ----- hooks (the scheduler calls them only while recording) -----

    def records(self, call: Call) -> bool:
        """Whether ``call`` is being recorded (its ranks time themselves)."""
        return call.call_id in self._open

    def submitted(self, call: Call) -> None:
        self._open[call.call_id] = _Open(submitted=time.time(), step=max(0, len(self._trace.steps) - 1))

    def started(self, call: Call, pool: str) -> None:
        rec = self._open.get(call.call_id)
        if rec is None:
            return
        rec.started, rec.pool = time.time(), pool
        parts = frozenset().union(*(f._parts for f in call.data_args.values()))
        calls = frozenset().union(*(f._calls for f in call.data_args.values()))
        streamed = {p for p, _ in parts}
        rec.parts = tuple(sorted(parts))
        rec.deps = tuple(sorted(c for c in calls if c not in streamed))

    def rank_returned(self, call: Call, rank: int, result: RankResult) -> None:
        rec = self._open.get(call.call_id)
        if rec is not None:
            rec.ranks.append((rank, result))

    def part(self, call: Call) -> None:
        rec = self._open.get(call.call_id)
        if rec is not None:
            rec.part_times.append(time.time())

    def ended(self, call: Call) -> None:
        rec = self._open.pop(call.call_id, None)
        if rec is None or not rec.started:
            return
        res = call.result
        ok = res.done() and not res.cancelled() and res.exception() is None
        self._trace.calls.append(CallRecord(
            call_id=call.call_id, role=call.role, method=call.method, pool=rec.pool, rank_local=call.rank_local,
            deps=rec.deps, parts=rec.parts, step=rec.step, place=call.place, submitted=rec.submitted, started=rec.started,
            finished=time.time(), ok=ok, part_times=tuple(rec.part_times),
            ranks=tuple(self._span(rec.pool, rank, result) for rank, result in rec.ranks
                        if result.timing is not None)))

    def _span(self, pool: str, rank: int, result: RankResult) -> RankSpan:
        t = result.timing
        assert t is not None
        shift = self._offsets.get(result.worker, 0.0)
        pulls = tuple(PullSpan(start=p.start - shift, end=p.end - shift, source=p.source, rows=p.rows,
                               bytes=p.bytes) for p in t.pulls)
        return RankSpan(pool=pool, rank=rank, worker=result.worker, start=t.start - shift, end=t.end - shift,
                        rows=result.num_rows, rows_in=t.rows_in, bytes_pulled=t.bytes_pulled, pulls=pulls,
                        cpu_s=t.cpu_s)


async def _offset(clock: Clock, worker: int) -> float:
    """``worker``'s clock minus the driver's, from the ping with the shortest round trip."""
    best: tuple[float, float] | None = None
    for _ in range(PINGS):
        t0 = time.time()
        there = await clock(worker)
        t1 = time.time()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, there - (t0 + t1) / 2)
    assert best is not None
    return best[1]


def tracer_for(pools: Mapping[str, Sequence[int]], roles: Mapping[str, Any]) -> Tracer:
    """A tracer for a session's pools (name -> worker indices) and roles (name ->
    ``RoleSpec``)."""
    return Tracer(pools, {name: spec.pool.name for name, spec in roles.items()})
