"""Numbers from a trace: wall, busy and idle time, the dependency chain, the bound.

:func:`summarise` answers "how far is this run from what its dependencies and its
busiest pool allow": the longest chain of measured call times through the data,
role-order and step dependencies (unlimited resources), the busiest rank of each
pool (no overlap at all), and per step the busiest rank counted from the earliest
its inputs let it start; the largest is a lower bound on the wall time of the
same calls. :func:`check_spans` catches traces whose spans cannot be right
(clock offsets gone wrong, a recorder bug), and :func:`markdown_table` formats
rows for reports.

The helpers :func:`time_origin`, :func:`trace_end`, :func:`pool_ranks` and
:func:`role_order` give the exporters one shared view of a trace's time span,
lanes and roles.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from asyncflow.tracing._records import CallRecord, RankSpan, Trace

OVERLAP_TOLERANCE_S = 1e-6
"""Two spans on one rank may overlap by this much (clock rounding)."""
PULL_TOLERANCE_S = 1e-3
"""A pull may lie outside its rank's span by this much (clock-offset error)."""

_Pred = tuple[int, int | None]
"""A predecessor of a call: ``(call id, None)`` for its whole output, ``(call id,
k)`` for its micro-batch ``k``."""


@dataclass(frozen=True)
class TraceSummary:
    """What :func:`summarise` measured (seconds unless named otherwise).

    Attributes:
        wall_s: from the first call's submission to the last call's end (the
            trace's own start and end when it holds no call).
        busy_s: per pool, the busiest rank's busy time (sum of its span lengths).
        rank_busy_s: per pool, each rank's busy time.
        stage_busy_s: per ``role.method``, span seconds summed over ranks.
        stage_cpu_s: per ``role.method``, the CPU seconds of the ranks' calling
            threads in those spans (below ``stage_busy_s`` by their waiting).
        idle_fraction: per pool, ``1 - sum(rank busy) / (ranks * wall_s)`` (0 when
            the trace spans no time); negative means spans outlast the wall time.
        chain_s: the longest dependency chain of the driver-measured call times,
            every call starting as soon as what it reads is ready.
        load_bound_s: the sum over steps (the loop awaits each step before the
            next) of the most any rank needs in it: the earliest its first call
            can start (by the chain), plus its busy time, plus the shortest chain
            that must follow its calls; at least the step's own chain.
        bound_s: ``max(chain_s, load_bound_s, max(busy_s))``, a lower bound on
            the wall time: no schedule of the same calls can beat it.
        critical_path: labels (``role.method#id``) of the calls on the longest
            chain, first to last.
        bytes_pulled: bytes of input rows that travelled between workers.
        calls: calls that succeeded.
        failed: calls that failed or were cancelled.
    """

    wall_s: float
    busy_s: dict[str, float]
    rank_busy_s: dict[str, list[float]]
    stage_busy_s: dict[str, float]
    stage_cpu_s: dict[str, float]
    idle_fraction: dict[str, float]
    chain_s: float
    load_bound_s: float
    bound_s: float
    critical_path: list[str]
    bytes_pulled: int
    calls: int
    failed: int


def summarise(trace: Trace) -> TraceSummary:
    """Measure a trace (see :class:`TraceSummary` for what each number means).

    Busy times, stage times and bytes count every call, failed ones included (their
    ranks were occupied); the dependency chain skips failed calls, and ignores
    dependencies on calls that are not in the trace.

    Args:
        trace: the recorded trace.

    Returns:
        The summary.

    Raises:
        ValueError: the calls' dependencies form a cycle (a corrupt trace).
    """
    calls = _in_submission_order(trace)
    if calls:
        wall = max(c.finished for c in calls) - min(c.submitted for c in calls)
    else:
        wall = trace.end - trace.start
    wall = max(wall, 0.0)
    ranks = pool_ranks(trace)
    rank_busy = {pool: [0.0] * n for pool, n in ranks.items()}
    stage: dict[str, float] = {}
    stage_cpu: dict[str, float] = {}
    bytes_pulled = 0
    for call in calls:
        key = f"{call.role}.{call.method}"
        stage.setdefault(key, 0.0)
        stage_cpu.setdefault(key, 0.0)
        for span in call.ranks:
            rank_busy[span.pool][span.rank] += span.seconds
            stage[key] += span.seconds
            stage_cpu[key] += span.cpu_s
            bytes_pulled += span.bytes_pulled
    busy = {pool: max(per_rank, default=0.0) for pool, per_rank in rank_busy.items()}
    idle = {pool: 1.0 - sum(per_rank) / (len(per_rank) * wall) if per_rank and wall > 0 else 0.0
            for pool, per_rank in rank_busy.items()}
    ok = [c for c in calls if c.ok]
    chain, path, finish = _longest_chain(ok)
    loaded = _load_bound(ok, finish)
    return TraceSummary(
        wall_s=wall, busy_s=busy, rank_busy_s=rank_busy, stage_busy_s=stage, stage_cpu_s=stage_cpu,
        idle_fraction=idle,
        chain_s=chain, load_bound_s=loaded, bound_s=max(chain, loaded, max(busy.values(), default=0.0)),
        critical_path=path, bytes_pulled=bytes_pulled, calls=len(ok), failed=len(calls) - len(ok))


def check_spans(trace: Trace) -> None:
    """Check that a trace's spans are consistent.

    Raises:
        ValueError: two spans on one rank overlap by more than
            ``OVERLAP_TOLERANCE_S``, or a pull lies outside its rank's span by more
            than ``PULL_TOLERANCE_S``; the message names the pool, rank and calls
            (every problem, up to ten).
    """
    problems: list[str] = []
    lanes: dict[tuple[str, int], list[tuple[RankSpan, CallRecord]]] = {}
    for call in trace.calls:
        for span in call.ranks:
            lanes.setdefault((span.pool, span.rank), []).append((span, call))
            for pull in span.pulls:
                if pull.start < span.start - PULL_TOLERANCE_S or pull.end > span.end + PULL_TOLERANCE_S:
                    problems.append(
                        f"pool {span.pool} rank {span.rank}: {call.label}'s pull from worker {pull.source} "
                        f"({pull.start:.6f}-{pull.end:.6f}) lies outside its span "
                        f"({span.start:.6f}-{span.end:.6f})")
    for (pool, rank), spans in sorted(lanes.items()):
        spans.sort(key=lambda sc: (sc[0].start, sc[0].end, sc[1].call_id))
        latest: tuple[RankSpan, CallRecord] | None = None  # the span that ends last so far
        for span, call in spans:
            if latest is not None and span.start < latest[0].end - OVERLAP_TOLERANCE_S:
                prev, prev_call = latest
                problems.append(
                    f"pool {pool} rank {rank}: {prev_call.label} ({prev.start:.6f}-{prev.end:.6f}) overlaps "
                    f"{call.label} ({span.start:.6f}-{span.end:.6f})")
            if latest is None or span.end > latest[0].end:
                latest = (span, call)
    if problems:
        more = f"\n... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError("inconsistent trace spans (check the workers' clock offsets):\n"
                         + "\n".join(problems[:10]) + more)


def markdown_table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """Format rows as a Markdown table.

    Args:
        rows: one mapping per row; a missing key or ``None`` is an empty cell.
        columns: the keys to show, in order (also the header).

    Returns:
        The table, one line per row after the header and separator, floats to three
        significant digits, ``|`` in text escaped.
    """
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ----- shared views of a trace (used by the exporters too) -----

def time_origin(trace: Trace) -> float:
    """The clock time that exports show as 0: the trace's start, or anything in the
    trace that came earlier."""
    return min([trace.start, *(t for t, _ in _times(trace))])


def trace_end(trace: Trace) -> float:
    """The latest time in the trace (its end, or anything later)."""
    return max([trace.end, *(t for _, t in _times(trace))])


def pool_ranks(trace: Trace) -> dict[str, int]:
    """Ranks per pool: the trace's pools, in order, then any pool or rank that only
    the spans name."""
    ranks = dict(trace.pools)
    for call in trace.calls:
        for span in call.ranks:
            ranks[span.pool] = max(ranks.get(span.pool, 0), span.rank + 1)
    return ranks


def role_order(trace: Trace) -> list[str]:
    """The roles: the trace's, in order, then any other its calls name."""
    roles = dict.fromkeys(trace.roles)
    roles.update(dict.fromkeys(c.role for c in trace.calls))
    return list(roles)


def _times(trace: Trace) -> Iterator[tuple[float, float]]:
    yield from ((s, s) for s in trace.steps)
    for call in trace.calls:
        yield call.submitted, call.finished
        yield call.started, call.finished
        for span in call.ranks:
            yield span.start, span.end
            yield from ((p.start, p.end) for p in span.pulls)


def _in_submission_order(trace: Trace) -> list[CallRecord]:
    # Role order is queue order: a stream's calls sit where the stream was queued.
    return sorted(trace.calls, key=lambda c: (c.place, c.submitted, c.call_id))


def _predecessors(calls: list[CallRecord]) -> dict[int, list[_Pred]]:
    """Each call's predecessors: what it read, every call of the previous step (the
    algorithm's loop awaited them before making this step's calls), and the calls
    of its role that the pool runs before it (in queue order; rank-local calls of a
    role may run side by side between two gang calls)."""
    ids = {c.call_id for c in calls}
    preds: dict[int, list[_Pred]] = {}
    last_gang: dict[str, int] = {}
    locals_since: dict[str, list[int]] = {}
    by_step: dict[int, list[int]] = {}
    for c in calls:
        by_step.setdefault(c.step, []).append(c.call_id)
    for c in calls:
        mine: list[_Pred] = [(d, None) for d in c.deps if d in ids]
        # The loop awaits a step's results before it makes the next step's calls.
        mine += [(d, None) for d in by_step.get(c.step - 1, ())]
        mine += [(d, k) for d, k in c.parts if d in ids]
        if c.role in last_gang:
            mine.append((last_gang[c.role], None))
        if c.rank_local:
            locals_since.setdefault(c.role, []).append(c.call_id)
        else:
            mine += [(d, None) for d in locals_since.pop(c.role, [])]
            last_gang[c.role] = c.call_id
        preds[c.call_id] = [p for p in mine if p[0] != c.call_id]
    return preds


def _topological(calls: list[CallRecord], preds: dict[int, list[_Pred]]) -> list[int]:
    waiting = {c.call_id: len(preds[c.call_id]) for c in calls}
    succs: dict[int, list[int]] = {c.call_id: [] for c in calls}
    for cid, ps in preds.items():
        for p, _ in ps:
            succs[p].append(cid)
    ready = deque(cid for cid, n in waiting.items() if n == 0)
    order: list[int] = []
    while ready:
        cid = ready.popleft()
        order.append(cid)
        for s in succs[cid]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if len(order) < len(calls):
        stuck = sorted(cid for cid, n in waiting.items() if n > 0)
        raise ValueError(f"the trace's call dependencies form a cycle among calls {stuck}")
    return order


def _longest_chain(calls: list[CallRecord]) -> tuple[float, list[str], dict[int, float]]:
    """Earliest finish of every call with unlimited resources; the latest one, the
    chain of calls that led to it, and every call's earliest finish."""
    by_id = {c.call_id: c for c in calls}
    preds = _predecessors(calls)
    finish: dict[int, float] = {}
    via: dict[int, int | None] = {}
    for cid in _topological(calls, preds):
        ready, before = 0.0, None
        for p, k in preds[cid]:
            t = _ready(by_id[p], finish[p], k)
            if t > ready:
                ready, before = t, p
        finish[cid] = ready + _seconds(by_id[cid])
        via[cid] = before
    if not finish:
        return 0.0, [], finish
    end_id = max(finish, key=lambda cid: (finish[cid], -cid))
    end = finish[end_id]
    last: int | None = end_id
    path: list[str] = []
    while last is not None:
        path.append(by_id[last].label)
        last = via[last]
    return end, path[::-1], finish


def _load_bound(calls: list[CallRecord], finish: dict[int, float]) -> float:
    """``TraceSummary.load_bound_s``: per step, per rank, head + busy + tail."""
    by_id = {c.call_id: c for c in calls}
    tail = _tails(calls)
    total = 0.0
    for step in sorted({c.step for c in calls}):
        mine = [c for c in calls if c.step == step]
        begin = min(finish[c.call_id] - _seconds(c) for c in mine)
        bound = max(finish[c.call_id] for c in mine) - begin
        ranks: dict[tuple[str, int], list[RankSpan]] = {}
        owner: dict[tuple[str, int], list[int]] = {}
        for c in mine:
            for span in c.ranks:
                ranks.setdefault((span.pool, span.rank), []).append(span)
                owner.setdefault((span.pool, span.rank), []).append(c.call_id)
        for key, spans in ranks.items():
            ids = owner[key]
            head = min(finish[i] - _seconds(by_id[i]) for i in ids) - begin
            bound = max(bound, head + sum(sp.seconds for sp in spans) + min(tail[i] for i in ids))
        total += bound
    return total


def _tails(calls: list[CallRecord]) -> dict[int, float]:
    """Per call, the longest chain of its step's calls that read its whole output
    (directly or not) or follow it in its role's order: what must run after it."""
    preds = _predecessors(calls)
    step = {c.call_id: c.step for c in calls}
    seconds = {c.call_id: _seconds(c) for c in calls}
    succs: dict[int, list[int]] = {c.call_id: [] for c in calls}
    for cid, ps in preds.items():
        for p, part in ps:
            if part is None and step[p] == step[cid]:
                succs[p].append(cid)
    tail: dict[int, float] = {}
    for cid in reversed(_topological(calls, preds)):
        tail[cid] = max((seconds[s] + tail[s] for s in succs[cid]), default=0.0)
    return tail


def _ready(producer: CallRecord, finish: float, part: int | None) -> float:
    """When ``producer``'s whole output (``part`` None) or micro-batch ``part`` is
    ready, given the producer's earliest finish."""
    if part is None or not 1 <= part <= len(producer.part_times):
        return finish
    seconds = _seconds(producer)
    after_start = min(max(producer.part_times[part - 1] - producer.started, 0.0), seconds)
    return finish - seconds + after_start


def _seconds(call: CallRecord) -> float:
    return max(call.seconds, 0.0)


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return _three_digits(value)
    return str(value).replace("|", "\\|")


def _three_digits(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    x = float(f"{x:.3g}")
    magnitude = math.floor(math.log10(abs(x)))
    if magnitude < -4:
        return f"{x:.2e}"
    return f"{x:.{max(0, 2 - magnitude)}f}"
