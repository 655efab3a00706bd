"""What one step of a run asks of the pools, and what each kind of call costs.

Both come from profile traces (:class:`asyncflow.tracing._records.Trace`): a
:class:`Workload` is the call graph of one traced step (who calls what, on how
many rows, after which calls or streamed micro-batches); a :class:`CostModel` is a
least-squares fit of measured call durations against rows per rank, per role,
method and number of ranks. The simulator (``asyncflow.plan._simulate``) replays
the first under a placement, timing each call with the second.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from asyncflow.tracing._records import CallRecord, Trace


class MissingCostError(KeyError, ValueError):
    """The cost model has no measured call of a ``(role, method)``."""

    def __str__(self) -> str:  # KeyError's own __str__ would quote the message
        return str(self.args[0]) if self.args else ""


class StreamPart(NamedTuple):
    """One streamed micro-batch a call reads."""

    call: int
    """Index (in the workload) of the producing call."""
    batch: int
    """Micro-batch number, from 1."""
    fraction: float
    """When the producer had produced it, as a fraction of the producer's duration."""


@dataclass(frozen=True, kw_only=True)
class WorkCall:
    """One call of a workload."""

    index: int
    """Position in the workload (submission order, over all steps)."""
    role: str
    method: str
    rank_local: bool
    """The call may run on any number of its pool's free ranks (else on all of them)."""
    rows_in: int
    """Total input rows: over its ranks, the rows of each rank's largest data argument."""
    deps: tuple[int, ...] = ()
    """Indices of calls whose whole output it reads."""
    parts: tuple[StreamPart, ...] = ()
    """Streamed micro-batches it reads (it waits for those only, not the producers' end)."""
    release: tuple[float, ...] = ()
    """A streamed call gives each rank back as soon as that rank is done: when its
    ranks were given back, as fractions of its duration, ascending (empty: every
    rank at its end)."""
    step: int = 0

    @property
    def label(self) -> str:
        """``role.method#index``."""
        return f"{self.role}.{self.method}#{self.index}"


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The calls of one or more steps, in submission order.

    A step's calls only name calls of the same step: the algorithm's loop awaits a
    step's calls before it makes the next step's, so the step barrier is the only
    link between steps.
    """

    calls: tuple[WorkCall, ...]
    """In submission order; ``calls[i].index == i``."""
    steps: int = 1
    """Steps the calls span (``WorkCall.step`` runs from 0 to ``steps - 1``)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles called, in order of first call."""
        return tuple(dict.fromkeys(c.role for c in self.calls))

    @classmethod
    def from_trace(cls, trace: Trace, step: int | None = None) -> Workload:
        """The calls of one traced step, renumbered from 0.

        Args:
            trace: a profile trace.
            step: which step (``CallRecord.step``); ``None``: the last complete
                step, i.e. the last whose calls all succeeded and after which the
                trace has a later step (the trace may stop in the middle of its
                last one), or, when no step is followed by another, the last step
                whose calls all succeeded.

        Returns:
            A one-step workload. Dependencies on calls of other steps are dropped.

        Raises:
            ValueError: the trace has no such step, or the step has failed calls.
        """
        chosen = _pick_step(trace) if step is None else step
        records = [c for c in trace.calls if c.step == chosen]
        if not records:
            have = sorted({c.step for c in trace.calls})
            raise ValueError(f"the trace has no calls in step {chosen} (steps traced: {have}); "
                             "pass one of those as step=")
        failed = [c.label for c in records if not c.ok]
        if failed:
            raise ValueError(f"step {chosen} has failed calls ({', '.join(failed)}), whose durations "
                             "mean nothing; pick a step whose calls all succeeded")
        index = {c.call_id: i for i, c in enumerate(records)}
        by_id = {c.call_id: c for c in records}
        calls = tuple(
            WorkCall(index=i, role=c.role, method=c.method, rank_local=c.rank_local,
                     rows_in=rows_in(c),
                     deps=tuple(index[d] for d in c.deps if d in index),
                     parts=tuple(StreamPart(index[p], k, part_fraction(by_id[p], k))
                                 for p, k in c.parts if p in index),
                     release=release_fractions(c))
            for i, c in enumerate(records))
        return cls(calls=calls, steps=1)

    def repeat(self, n: int) -> Workload:
        """``n`` copies of this workload's steps, one after the other, renumbered.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"repeat(n) needs n >= 1, got {n}")
        size = len(self.calls)
        calls = tuple(
            WorkCall(index=c.index + r * size, role=c.role, method=c.method,
                     rank_local=c.rank_local, rows_in=c.rows_in,
                     deps=tuple(d + r * size for d in c.deps),
                     parts=tuple(p._replace(call=p.call + r * size) for p in c.parts),
                     release=c.release,
                     step=c.step + r * self.steps)
            for r in range(n) for c in self.calls)
        return Workload(calls=calls, steps=self.steps * n)

    def on_placement(self, pool_of: Mapping[str, str], devices: Mapping[str, int], *,
                     migrate: bool = False) -> Workload:
        """This workload as the algorithm loops run it on a placement
        (``asyncflow.algos.Feed``): a role's calls on the micro-batches
        of a streamed call on the role's own pool become one call on the whole
        batch, after the streamed call. With ``migrate`` (the tail may leave some
        ranks), rank-local calls on a pool of several ranks stay per micro-batch.

        Args:
            pool_of: each role's pool.
            devices: each pool's devices.
            migrate: the streamed calls migrate their long tail.
        """
        groups: dict[tuple[int, str, str], list[WorkCall]] = {}
        for c in self.calls:
            producers = {p.call for p in c.parts}
            if len(producers) != 1:
                continue
            source = self.calls[producers.pop()]
            pool = pool_of[c.role]
            if pool != pool_of[source.role] or (migrate and c.rank_local and devices[pool] > 1):
                continue
            groups.setdefault((source.index, c.role, c.method), []).append(c)
        if not groups:
            return self
        # Each group becomes one call, in its first member's place in the queue.
        merged = {members[0].index: (producer, members) for (producer, _, _), members in groups.items()}
        head = {m.index: members[0].index for members in groups.values() for m in members}
        kept = [c for c in self.calls if head.get(c.index, c.index) == c.index]
        index = {c.index: i for i, c in enumerate(kept)}

        def renumber(deps: Iterable[int]) -> tuple[int, ...]:
            return tuple(sorted({index[head.get(d, d)] for d in deps}))

        calls = []
        for c in kept:
            if c.index in merged:
                producer, members = merged[c.index]
                calls.append(WorkCall(index=index[c.index], role=c.role, method=c.method, rank_local=c.rank_local,
                                      rows_in=sum(m.rows_in for m in members), step=c.step,
                                      deps=renumber([producer, *(d for m in members for d in m.deps)])))
            else:
                calls.append(WorkCall(index=index[c.index], role=c.role, method=c.method, rank_local=c.rank_local,
                                      rows_in=c.rows_in, deps=renumber(c.deps), release=c.release, step=c.step,
                                      parts=tuple(p._replace(call=index[p.call]) for p in c.parts)))
        return Workload(calls=tuple(calls), steps=self.steps)


def rows_in(call: CallRecord) -> int:
    """Total input rows of a call: over its ranks, each rank's ``rows_in`` (its
    ``rows`` for spans recorded without one)."""
    return sum(int(getattr(span, "rows_in", span.rows)) for span in call.ranks)


def part_fraction(producer: CallRecord, batch: int) -> float:
    """When ``producer`` had produced micro-batch ``batch`` (from 1), as a fraction of
    its duration (1.0 when the trace has no time for it)."""
    if not 1 <= batch <= len(producer.part_times) or producer.seconds <= 0:
        return 1.0
    fraction = (producer.part_times[batch - 1] - producer.started) / producer.seconds
    return min(1.0, max(0.0, fraction))


def release_fractions(call: CallRecord) -> tuple[float, ...]:
    """When a streamed call's ranks were done, as fractions of its duration, ascending
    (empty for a call that streams nothing: the runtime holds its ranks to the end)."""
    if not call.part_times or call.seconds <= 0:
        return ()
    return tuple(sorted(min(1.0, max(0.0, (span.end - call.started) / call.seconds))
                        for span in call.ranks))


def _pick_step(trace: Trace) -> int:
    steps = sorted({c.step for c in trace.calls})
    clean = [s for s in steps if all(c.ok for c in trace.calls if c.step == s)]
    if not clean:
        raise ValueError("the trace has no step whose calls all succeeded; profile again")
    followed = [s for s in clean if s < steps[-1]]
    return followed[-1] if followed else clean[-1]


# ----- costs -----


class CostSample(NamedTuple):
    """One measured call."""

    role: str
    method: str
    ranks: int
    """Ranks it ran on."""
    rows_per_rank: float
    seconds: float
    """From dispatch to finish, as the driver measured it (transfers included)."""


class _Line(NamedTuple):
    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class CostModel:
    """Seconds a call takes, fitted from measured calls.

    Per ``(role, method, ranks)``, a least-squares line ``seconds = a + b *
    rows_per_rank`` with ``a, b >= 0`` (the median when all samples have the same
    rows per rank: scaling one measurement by rows would treat fixed costs as
    per-row ones).

    Args:
        samples: the measured calls.

    Attributes:
        samples: the same, grouped by ``(role, method, ranks)``.
    """

    def __init__(self, samples: Iterable[CostSample]) -> None:
        grouped: dict[tuple[str, str, int], list[CostSample]] = {}
        for s in samples:
            grouped.setdefault((s.role, s.method, s.ranks), []).append(s)
        self.samples = [s for group in grouped.values() for s in group]
        self._fits = {key: _fit([s.rows_per_rank for s in group], [s.seconds for s in group])
                      for key, group in grouped.items()}
        self._ranks: dict[tuple[str, str], list[int]] = {}
        for role, method, d in sorted(self._fits):
            self._ranks.setdefault((role, method), []).append(d)

    @classmethod
    def from_traces(cls, *traces: Trace) -> CostModel:
        """Fit the calls of the traces that succeeded (every step).

        A call's ranks are its rank spans; a gang call traced without spans counts
        as running on its whole pool, a rank-local one without spans is skipped.
        """
        return cls(s for trace in traces for s in trace_samples(trace))

    def known(self) -> list[tuple[str, str]]:
        """The ``(role, method)`` pairs measured."""
        return list(self._ranks)

    def fit(self, role: str, method: str, ranks: int) -> tuple[float, float] | None:
        """``(a, b)`` of the line fitted on ``ranks`` ranks, or ``None`` if never measured."""
        line = self._fits.get((role, method, ranks))
        return None if line is None else (line.a, line.b)

    def predict(self, role: str, method: str, ranks: int, rows: float) -> float:
        """Seconds of a ``role.method`` call on ``ranks`` ranks with ``rows`` input rows in all.

        On a number of ranks never measured for that method, the fit of the nearest
        measured number ``d0`` (the larger on a tie) is scaled assuming time is
        proportional to rows per rank: ``fit_d0(rows / d0) * d0 / ranks``.

        Raises:
            MissingCostError: ``(role, method)`` was never measured.
            ValueError: ``ranks`` < 1.
        """
        if ranks < 1:
            raise ValueError(f"predict needs ranks >= 1, got {ranks}")
        measured = self._ranks.get((role, method))
        if not measured:
            raise MissingCostError(
                f"no measured call of {role}.{method} (measured: "
                f"{', '.join(f'{r}.{m}' for r, m in self.known()) or 'none'}); "
                "profile a run that calls it")
        if ranks in measured:
            return self._fits[role, method, ranks](rows / ranks)
        d0 = min(measured, key=lambda d: (abs(d - ranks), -d))
        return self._fits[role, method, d0](rows / d0) * d0 / ranks


def trace_samples(trace: Trace, scale: float = 1.0) -> list[CostSample]:
    """The calls of ``trace`` that succeeded as cost samples, their seconds times
    ``scale`` (see :meth:`CostModel.from_traces` for their ranks)."""
    samples = []
    for c in trace.calls:
        d = len(c.ranks) or (0 if c.rank_local else trace.pools.get(c.pool, 0))
        if c.ok and d > 0:
            samples.append(CostSample(c.role, c.method, d, rows_in(c) / d, c.seconds * scale))
    return samples


def _fit(xs: Sequence[float], ys: Sequence[float]) -> _Line:
    """Least squares ``y = a + b x`` with ``a, b >= 0``; for one distinct x, the
    median (a call stalled by another process on a shared machine does not move it)."""
    n = len(xs)
    mean_y = sum(ys) / n
    if len(set(xs)) < 2:
        return _Line(max(0.0, statistics.median(ys)), 0.0)
    mean_x = sum(xs) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    if b >= 0 and mean_y - b * mean_x >= 0:
        return _Line(mean_y - b * mean_x, b)
    # The unconstrained optimum is infeasible, so the constrained one lies on a
    # boundary: b = 0 (a constant) or a = 0 (a line through the origin).
    x2 = sum(x * x for x in xs)
    through_origin = _Line(0.0, max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / x2))
    constant = _Line(max(0.0, mean_y), 0.0)
    return min((constant, through_origin),
               key=lambda line: math.fsum((line(x) - y) ** 2 for x, y in zip(xs, ys, strict=True)))
