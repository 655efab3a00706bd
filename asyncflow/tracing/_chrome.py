"""A trace as Chrome / Perfetto trace events (open it in ``ui.perfetto.dev``).

The JSON object format: ``{"traceEvents": [...], "displayTimeUnit": "ms",
"otherData": {...}}``, times in integer microseconds from the trace's origin
(:func:`~asyncflow.tracing._analysis.time_origin`). The layout:

- one process per pool ("pool <name>") with one thread per rank ("rank <r> (worker
  <w>)"): each rank's part of each call is a complete event named
  ``role.method``, and each piece of input the rank assembled is an event nested
  inside it ("pull from worker <w>");
- a "driver" process (pid 0): a "steps" lane with an instant event at each step's
  start, and per role one lane or more with each call from its dispatch to its
  completion as the driver saw it (input transfer included). Calls of one role
  that overlap (rank-local calls on different ranks) go on extra lanes
  ("<role> (driver) 2", ...), so that no lane holds overlapping events.

Integer microseconds keep nesting exact: a span that starts before the previous
one on its rank ended (rounding, clock-offset jitter) is shown starting at that
end, and pulls are clamped into their span; :func:`check_spans` is the place to
catch spans that really overlap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncflow.tracing._analysis import pool_ranks, role_order, time_origin
from asyncflow.tracing._records import CallRecord, RankSpan, Trace

Event = dict[str, Any]

DRIVER_PID = 0
STEPS_TID = 0


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome trace-event JSON object (see the module docstring).

    Args:
        trace: the recorded trace.

    Returns:
        A JSON-serialisable dict, the same for the same trace.
    """
    origin = time_origin(trace)
    ranks = pool_ranks(trace)
    pids = {pool: i + 1 for i, pool in enumerate(ranks)}
    meta, timed = _driver_events(trace, origin)
    for pool, n in ranks.items():
        pool_meta, pool_timed = _pool_events(trace, origin, pool, pids[pool], n)
        meta += pool_meta
        timed += pool_timed
    timed.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0), e["name"]))
    return {
        "traceEvents": meta + timed,
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_s": origin,
            "start_s": trace.start,
            "end_s": trace.end,
            "pools": ranks,
            "roles": dict(trace.roles),
            "calls": len(trace.calls),
            "steps": len(trace.steps),
        },
    }


def write_chrome_trace(trace: Trace, path: str | Path) -> Path:
    """Write :func:`chrome_trace` of ``trace`` to ``path`` (parent folders made).

    Returns:
        The path written.

    Raises:
        ValueError: the trace holds a NaN or infinite time.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump(chrome_trace(trace), f, allow_nan=False)
    return path


def _us(t: float, origin: float) -> int:
    return round((t - origin) * 1e6)


def _meta(kind: str, pid: int, tid: int, value: str | int) -> Event:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _complete(name: str, cat: str, pid: int, tid: int, start: int, end: int, args: dict[str, Any]) -> Event:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start, "dur": end - start,
            "args": args}


def _pool_events(trace: Trace, origin: float, pool: str, pid: int, n: int) -> tuple[list[Event], list[Event]]:
    """Metadata and span events of one pool's ranks."""
    lanes: dict[int, list[tuple[RankSpan, CallRecord]]] = {r: [] for r in range(n)}
    for call in trace.calls:
        for span in call.ranks:
            if span.pool == pool:
                lanes[span.rank].append((span, call))
    meta = [_meta("process_name", pid, 0, f"pool {pool}"), _meta("process_sort_index", pid, 0, pid)]
    timed: list[Event] = []
    for rank, spans in lanes.items():
        spans.sort(key=lambda sc: (sc[0].start, sc[0].end, sc[1].call_id))
        workers = sorted({s.worker for s, _ in spans})
        who = f" (worker {workers[0]})" if len(workers) == 1 else (
            f" (workers {', '.join(map(str, workers))})" if workers else "")
        meta += [_meta("thread_name", pid, rank, f"rank {rank}{who}"), _meta("thread_sort_index", pid, rank, rank)]
        free = 0  # the end of the rank's previous span
        for span, call in spans:
            start = max(_us(span.start, origin), free)
            end = max(_us(span.end, origin), start)
            free = end
            timed.append(_complete(f"{call.role}.{call.method}", call.role, pid, rank, start, end,
                                   _span_args(span, call)))
            timed += _pull_events(span, call, origin, pid, start, end)
    return meta, timed


def _span_args(span: RankSpan, call: CallRecord) -> dict[str, Any]:
    args: dict[str, Any] = {"call_id": call.call_id, "rows": span.rows}
    if span.rows_in:
        args["rows_in"] = span.rows_in
    args.update(bytes_pulled=span.bytes_pulled, step=call.step, cpu_ms=round(1000 * span.cpu_s, 3))
    if not call.ok:
        args["ok"] = False
    return args


def _pull_events(span: RankSpan, call: CallRecord, origin: float, pid: int, lo: int, hi: int) -> list[Event]:
    """A span's pulls, clamped into ``[lo, hi]`` and one after another."""
    events = []
    free = lo
    for pull in sorted(span.pulls, key=lambda p: (p.start, p.end)):
        start = min(max(_us(pull.start, origin), free), hi)
        end = min(max(_us(pull.end, origin), start), hi)
        free = end
        events.append(_complete(f"pull from worker {pull.source}", "pull", pid, span.rank, start, end,
                                {"call_id": call.call_id, "rows": pull.rows, "bytes": pull.bytes}))
    return events


def _driver_events(trace: Trace, origin: float) -> tuple[list[Event], list[Event]]:
    """The driver process: step marks, then each role's calls on as few lanes as
    keep every lane free of overlaps (greedy interval colouring)."""
    meta = [_meta("process_name", DRIVER_PID, 0, "driver"), _meta("process_sort_index", DRIVER_PID, 0, 0),
            _meta("thread_name", DRIVER_PID, STEPS_TID, "steps"),
            _meta("thread_sort_index", DRIVER_PID, STEPS_TID, STEPS_TID)]
    timed: list[Event] = [
        {"name": f"step {k}", "cat": "step", "ph": "i", "s": "g", "pid": DRIVER_PID, "tid": STEPS_TID,
         "ts": _us(t, origin)} for k, t in enumerate(trace.steps)]
    tid = STEPS_TID
    for role in role_order(trace):
        calls = sorted((c for c in trace.calls if c.role == role), key=lambda c: (c.started, c.finished, c.call_id))
        lane_ends: list[int] = []
        for call in calls:
            start = _us(call.started, origin)
            end = max(_us(call.finished, origin), start)
            lane = next((i for i, free in enumerate(lane_ends) if free <= start), len(lane_ends))
            if lane == len(lane_ends):
                lane_ends.append(end)
                name = f"{role} (driver)" + (f" {lane + 1}" if lane else "")
                meta += [_meta("thread_name", DRIVER_PID, tid + lane + 1, name),
                         _meta("thread_sort_index", DRIVER_PID, tid + lane + 1, tid + lane + 1)]
            lane_ends[lane] = end
            timed.append(_complete(f"{call.role}.{call.method}" + ("" if call.ok else " (failed)"), "driver",
                                   DRIVER_PID, tid + lane + 1, start, end, _driver_args(call)))
        tid += len(lane_ends)
    return meta, timed


def _driver_args(call: CallRecord) -> dict[str, Any]:
    return {"call_id": call.call_id, "step": call.step, "ok": call.ok, "rank_local": call.rank_local,
            "deps": list(call.deps), "parts": [list(p) for p in call.parts],
            "queued_ms": round((call.started - call.submitted) * 1e3, 3),
            "micro_batches": len(call.part_times)}
