"""The trace exporters and analysis (``asyncflow.tracing``) on hand-built traces."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from asyncflow.tracing import (
    CallRecord,
    PullSpan,
    RankSpan,
    Trace,
    check_spans,
    chrome_trace,
    markdown_table,
    summarise,
    write_chrome_trace,
    write_timeline_png,
)

T0 = 1000.0
WORKERS = {("gen", 0): 0, ("gen", 1): 1, ("train", 0): 2, ("train", 1): 3}


def _span(pool: str, rank: int, start: float, end: float, *, pulls: Iterable[PullSpan] = (),
          bytes_pulled: int = 0, rows_in: int = 0) -> RankSpan:
    return RankSpan(pool=pool, rank=rank, worker=WORKERS[(pool, rank)], start=T0 + start, end=T0 + end, rows=4,
                    rows_in=rows_in, bytes_pulled=bytes_pulled, pulls=tuple(pulls))


def _pull(source: int, start: float, end: float, nbytes: int) -> PullSpan:
    return PullSpan(start=T0 + start, end=T0 + end, source=source, rows=2, bytes=nbytes)


def _call(call_id: int, role: str, method: str, started: float, finished: float, *spans: RankSpan,
          rank_local: bool = False, deps: tuple[int, ...] = (), parts: tuple[tuple[int, int], ...] = (),
          part_times: tuple[float, ...] = (), ok: bool = True, step: int = 0) -> CallRecord:
    pool = "gen" if role == "rollout" else "train"
    return CallRecord(call_id=call_id, role=role, method=method, pool=pool, rank_local=rank_local, deps=deps,
                      parts=parts, step=step, submitted=T0 + call_id * 0.01, started=T0 + started,
                      finished=T0 + finished, ok=ok, ranks=spans, part_times=tuple(T0 + t for t in part_times))


def _trace(calls: list[CallRecord], *, end: float = 10.0, steps: Iterable[float] = ()) -> Trace:
    return Trace(calls=calls, pools={"gen": 2, "train": 2}, roles={"rollout": "gen", "ref": "train", "actor": "train"},
                 start=T0, end=T0 + end, steps=[T0 + s for s in steps])


def pipeline_trace() -> Trace:
    """A streamed rollout (#1), rank-local ref calls reading its micro-batches
    (#2, #3 overlapping on two ranks, #4 reading a micro-batch it never streamed),
    a gang ref call (#5), another rank-local one (#6), actor updates (#7, #9) and a
    failed one (#8)."""
    return _trace([
        _call(1, "rollout", "generate", 0.0, 4.0, _span("gen", 0, 0.0, 4.0), _span("gen", 1, 0.0, 3.5),
              part_times=(1.0, 2.5, 4.0)),
        _call(2, "ref", "log_prob", 1.0, 2.0,
              _span("train", 0, 1.1, 1.9, pulls=[_pull(0, 1.1, 1.3, 100)], bytes_pulled=100, rows_in=2),
              rank_local=True, parts=((1, 1),)),
        # the first pull starts 0.4 ms before the span (clock offsets): shown clamped
        _call(3, "ref", "log_prob", 1.5, 3.5,
              _span("train", 1, 1.6, 3.4, pulls=[_pull(3, 1.5996, 1.62, 0), _pull(1, 1.62, 1.7, 50)],
                    bytes_pulled=50),
              rank_local=True, parts=((1, 2),)),
        _call(4, "ref", "log_prob", 4.0, 5.0, _span("train", 0, 4.1, 4.9), rank_local=True, parts=((1, 5),)),
        _call(5, "ref", "sync", 5.0, 5.5, _span("train", 0, 5.0, 5.5), _span("train", 1, 5.0, 5.5), step=1),
        _call(6, "ref", "log_prob", 5.5, 6.5, _span("train", 1, 5.6, 6.3), rank_local=True, step=1),
        _call(7, "actor", "update", 6.5, 8.5, _span("train", 0, 6.5, 8.5), _span("train", 1, 6.5, 8.5),
              deps=(6, 99), step=1),
        _call(8, "actor", "update", 8.5, 8.6, ok=False, step=1),
        _call(9, "actor", "update", 8.6, 9.6, _span("train", 0, 8.6, 9.6), _span("train", 1, 8.6, 9.6),
              deps=(8,), step=1),
    ], steps=(0.0, 5.0))


# ----- Chrome trace events -----

def _x_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _assert_nested_or_disjoint(events: list[dict[str, Any]]) -> None:
    lanes: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for e in events:
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for lane, spans in lanes.items():
        for i, (a, b, n1) in enumerate(spans):
            for c, d, n2 in spans[i + 1:]:
                disjoint = b <= c or d <= a
                nested = (a <= c and d <= b) or (c <= a and b <= d)
                assert disjoint or nested, f"{lane}: {n1} [{a}, {b}] and {n2} [{c}, {d}] overlap"


def _names(doc: dict[str, Any], kind: str, pid: int | None = None) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == kind and (pid is None or e["pid"] == pid)}


def test_chrome_trace_round_trips_and_nests(tmp_path: Path) -> None:
    trace = pipeline_trace()
    doc = chrome_trace(trace)
    path = write_chrome_trace(trace, tmp_path / "sub" / "trace.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc, allow_nan=False))
    assert doc["displayTimeUnit"] == "ms"
    xs = _x_events(doc)
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["ts"] >= 0 and e["dur"] >= 0
    _assert_nested_or_disjoint(xs)
    # every rank span, every pull and one driver event per call
    pulls = [e for e in xs if e["cat"] == "pull"]
    assert len(pulls) == 3
    assert len([e for e in xs if e["cat"] == "driver"]) == len(trace.calls)
    assert len(xs) - len(pulls) - len(trace.calls) == sum(len(c.ranks) for c in trace.calls)


def test_chrome_trace_lanes_and_names() -> None:
    doc = chrome_trace(pipeline_trace())
    processes = _names(doc, "process_name")
    assert processes == {(0, 0): "driver", (1, 0): "pool gen", (2, 0): "pool train"}
    assert _names(doc, "thread_name", pid=2) == {(2, 0): "rank 0 (worker 2)", (2, 1): "rank 1 (worker 3)"}
    driver_lanes = set(_names(doc, "thread_name", pid=0).values())
    # #2 and #3 overlap in driver time: #3 goes on a second ref lane
    assert driver_lanes == {"steps", "rollout (driver)", "ref (driver)", "ref (driver) 2", "actor (driver)"}
    steps = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], e["s"], e["ts"]) for e in steps] == [("step 0", "g", 0), ("step 1", "g", 5_000_000)]
    generate = next(e for e in _x_events(doc) if e["pid"] == 1 and e["tid"] == 0)
    assert (generate["name"], generate["cat"], generate["ts"], generate["dur"]) == (
        "rollout.generate", "rollout", 0, 4_000_000)
    first = next(e for e in _x_events(doc) if e["cat"] == "ref" and e["args"]["call_id"] == 2)
    assert first["args"] == {"call_id": 2, "rows": 4, "rows_in": 2, "bytes_pulled": 100, "step": 0,
                             "cpu_ms": 0.0}


def test_chrome_trace_pulls_lie_in_their_spans() -> None:
    doc = chrome_trace(pipeline_trace())
    xs = _x_events(doc)
    spans = {(e["pid"], e["tid"], e["args"]["call_id"]): e for e in xs if e["cat"] in ("rollout", "ref", "actor")}
    for pull in (e for e in xs if e["cat"] == "pull"):
        span = spans[(pull["pid"], pull["tid"], pull["args"]["call_id"])]
        assert span["ts"] <= pull["ts"] and pull["ts"] + pull["dur"] <= span["ts"] + span["dur"]
    clamped = next(e for e in xs if e["name"] == "pull from worker 3")
    assert clamped["ts"] == spans[(2, 1, 3)]["ts"]
    assert clamped["args"] == {"call_id": 3, "rows": 2, "bytes": 0}


def test_chrome_trace_is_deterministic_and_keeps_rank_lanes_apart() -> None:
    trace = pipeline_trace()
    shuffled = _trace(trace.calls[::-1], steps=(0.0, 5.0))
    assert json.dumps(chrome_trace(trace)) == json.dumps(chrome_trace(shuffled))
    # spans overlapping by 0.9 us (clock rounding): shown one after the other
    jitter = _trace([_call(1, "ref", "a", 0.0, 1.0, _span("train", 0, 0.0, 1.0000009), rank_local=True),
                     _call(2, "ref", "b", 1.0, 2.0, _span("train", 0, 1.0, 2.0), rank_local=True)])
    _assert_nested_or_disjoint(_x_events(chrome_trace(jitter)))


# ----- timeline -----

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_timeline_png(tmp_path: Path) -> None:
    path = write_timeline_png(pipeline_trace(), tmp_path / "t" / "timeline.png", title="pipeline")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1024


def test_timeline_png_many_spans_and_empty(tmp_path: Path) -> None:
    calls = [_call(i + 1, "ref", "log_prob", 0.05 * i, 0.05 * i + 0.04,
                   _span("train", i % 2, 0.05 * i, 0.05 * i + 0.04, pulls=[_pull(0, 0.05 * i, 0.05 * i + 0.01, 8)]),
                   rank_local=True) for i in range(300)]
    big = write_timeline_png(_trace(calls, end=15.0, steps=range(15)), tmp_path / "big.png").read_bytes()
    empty = write_timeline_png(Trace(), tmp_path / "empty.png").read_bytes()
    for data in (big, empty):
        assert data[:8] == PNG_MAGIC and len(data) > 1024


# ----- summary -----

def test_summarise_chain_busy_and_idle() -> None:
    s = summarise(pipeline_trace())
    # EF: #1 4; #2 1+1 (micro-batch 1 at 1 s); #3 2.5+2 (micro-batch 2); #4 4+1 (micro-batch 5 was never
    # streamed: the whole output); #5 gang after rank-local #2-#4: 5+0.5; #6 rank-local after gang #5:
    # 5.5+1; #7 after #6 (#99 is not in the trace): 6.5+2; #8 failed: skipped; #9 after #7 (role order;
    # its dep on #8 is ignored): 8.5+1
    assert s.chain_s == pytest.approx(9.5)
    assert s.critical_path == ["rollout.generate#1", "ref.log_prob#4", "ref.sync#5", "ref.log_prob#6",
                               "actor.update#7", "actor.update#9"]
    assert s.wall_s == pytest.approx(9.6 - 0.01)
    assert s.rank_busy_s["gen"] == pytest.approx([4.0, 3.5])
    assert s.rank_busy_s["train"] == pytest.approx([0.8 + 0.8 + 0.5 + 2.0 + 1.0, 1.8 + 0.5 + 0.7 + 2.0 + 1.0])
    assert s.busy_s == pytest.approx({"gen": 4.0, "train": 6.0})
    assert s.idle_fraction == pytest.approx({"gen": 1 - 7.5 / (2 * 9.59), "train": 1 - 11.1 / (2 * 9.59)})
    assert s.stage_busy_s == pytest.approx({"rollout.generate": 7.5, "ref.log_prob": 4.1, "ref.sync": 1.0,
                                            "actor.update": 6.0})
    assert s.bound_s == pytest.approx(9.5)
    assert (s.bytes_pulled, s.calls, s.failed) == (150, 8, 1)


def test_summarise_orders_by_submission_not_by_list() -> None:
    trace = pipeline_trace()
    assert summarise(_trace(trace.calls[::-1])) == summarise(_trace(trace.calls))


def test_summarise_streamed_part_is_ready_before_its_producer_ends() -> None:
    producer = _call(1, "rollout", "generate", 0.0, 4.0, part_times=(1.0, 2.5, 4.0))
    by_part = summarise(_trace([producer, _call(2, "ref", "log_prob", 2.5, 5.5, parts=((1, 2),))]))
    by_whole = summarise(_trace([producer, _call(2, "ref", "log_prob", 4.0, 7.0, deps=(1,))]))
    assert by_part.chain_s == pytest.approx(2.5 + 3.0)
    assert by_whole.chain_s == pytest.approx(4.0 + 3.0)
    assert by_part.critical_path == ["rollout.generate#1", "ref.log_prob#2"]


def test_summarise_bound_is_busy_when_rank_local_calls_queue_on_one_rank() -> None:
    # rank-local calls of one role have no order among themselves: the chain is one call long
    calls = [_call(i, "ref", "log_prob", i - 1.0, float(i), _span("train", 0, i - 1.0, float(i)), rank_local=True)
             for i in (1, 2, 3)]
    s = summarise(_trace(calls))
    assert s.chain_s == pytest.approx(1.0)
    assert s.busy_s["train"] == pytest.approx(3.0)
    assert s.bound_s == pytest.approx(3.0)
    assert s.idle_fraction["gen"] == pytest.approx(1.0)


def test_empty_trace() -> None:
    trace = Trace(pools={"gen": 1}, roles={"rollout": "gen"}, start=T0, end=T0 + 2.0)
    s = summarise(trace)
    assert (s.wall_s, s.chain_s, s.bound_s, s.critical_path, s.bytes_pulled) == (2.0, 0.0, 0.0, [], 0)
    assert (s.busy_s, s.rank_busy_s, s.idle_fraction) == ({"gen": 0.0}, {"gen": [0.0]}, {"gen": 1.0})
    check_spans(trace)
    doc = json.loads(json.dumps(chrome_trace(trace), allow_nan=False))
    assert _x_events(doc) == []
    assert summarise(Trace()).wall_s == 0.0


# ----- checks and tables -----

def test_check_spans_accepts_a_consistent_trace() -> None:
    check_spans(pipeline_trace())


def test_check_spans_names_overlapping_calls() -> None:
    trace = _trace([_call(1, "ref", "a", 0.0, 1.0, _span("train", 1, 0.0, 1.0), rank_local=True),
                    _call(2, "ref", "b", 0.5, 2.0, _span("train", 1, 0.9, 2.0), rank_local=True)])
    with pytest.raises(ValueError, match=r"pool train rank 1: ref\.a#1 .* overlaps ref\.b#2"):
        check_spans(trace)


def test_check_spans_rejects_a_pull_outside_its_span() -> None:
    trace = _trace([_call(1, "ref", "a", 0.0, 1.0, _span("train", 0, 0.1, 1.0, pulls=[_pull(1, 0.095, 0.2, 8)]))])
    with pytest.raises(ValueError, match=r"rank 0: ref\.a#1's pull from worker 1"):
        check_spans(trace)


def test_markdown_table() -> None:
    rows: list[dict[str, object]] = [{"name": "a|b", "s": 1234.5, "n": 3}, {"name": "c", "s": 0.0012345}]
    assert markdown_table(rows, ["name", "s", "n"]).splitlines() == [
        "| name | s | n |", "|---|---|---|", "| a\\|b | 1230 | 3 |", "| c | 0.00123 |  |"]
