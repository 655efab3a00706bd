"""Recording traces in the runtime, without Ray: in-process workers
(``asyncflow.runtime._local``), the real scheduler and worker loop.

``test_tracing_on_cpu.py`` records one on Ray and checks the exports."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from asyncflow import ConfigError, ResourcePool, RoleSpec, StreamOptions, collect, merge
from asyncflow.tracing import check_spans, summarise
from support import Consumer, Scorer, Ticker, run_local, x_of_value

T2 = ResourcePool(name="t2", devices=2)
C1 = ResourcePool(name="c1", devices=1)
SPECS = {
    "ticker": RoleSpec(cls=Ticker, pool=T2),
    "consumer": RoleSpec(cls=Consumer, pool=C1),
    "scorer": RoleSpec(cls=Scorer, pool=C1),
}
STEPS = [3, 1, 2, 9, 1, 1, 2, 4]


def run(main, timeout: float = 60):
    return run_local(SPECS, {"idx": torch.arange(len(STEPS)), "steps": torch.tensor(STEPS)}, T2, main, timeout)


def test_a_traced_call_has_a_span_per_rank_and_its_dependencies() -> None:
    async def main(session, roles, src):
        untraced = roles.ticker.tick(src, delay=0.001)
        await untraced
        await session.start_trace()
        session.mark_step()
        ticked = roles.ticker.tick(src, delay=0.001)
        echoed = roles.consumer.echo(ticked.map(x_of_value))
        await echoed
        session.mark_step()
        await roles.consumer.total(echoed)
        return session.stop_trace()

    trace = run(main)
    assert trace.pools == {"t2": 2, "c1": 1} and trace.roles["ticker"] == "t2"
    assert [(c.role, c.method, c.step) for c in trace.calls] == [
        ("ticker", "tick", 0), ("consumer", "echo", 0), ("consumer", "total", 1)]
    tick, echo, total = trace.calls
    assert sorted(s.rank for s in tick.ranks) == [0, 1] and sum(s.rows for s in tick.ranks) == len(STEPS)
    assert echo.deps == (tick.call_id,) and total.deps == (echo.call_id,)
    assert echo.ranks[0].rows_in == len(STEPS) and echo.ranks[0].pulls  # pulled both ticker ranks' rows
    assert {p.source for p in echo.ranks[0].pulls} == {s.worker for s in tick.ranks}
    for call in trace.calls:
        assert call.ok and call.submitted <= call.started <= call.finished
        for span in call.ranks:
            assert call.started - 0.05 <= span.start <= span.end <= call.finished + 0.05
    assert echo.started >= tick.finished
    assert len(trace.steps) == 2
    check_spans(trace)


def test_streamed_consumers_depend_on_micro_batches() -> None:
    async def main(session, roles, src):
        await session.start_trace()
        rollout = roles.ticker.tick(src, delay=0.002, stream=StreamOptions(micro_batch=2, migrate=None))
        scored = roles.scorer.score(rollout)
        await collect(merge(rollout, scored))
        await roles.consumer.echo(collect(rollout).map(x_of_value))
        return session.stop_trace()

    trace = run(main)
    tick = next(c for c in trace.calls if c.method == "tick")
    scores = [c for c in trace.calls if c.method == "score"]
    echo = next(c for c in trace.calls if c.method == "echo")
    assert len(tick.part_times) == len(scores) >= 2
    assert sorted(p for c in scores for p in c.parts) == [(tick.call_id, k) for k in range(1, len(scores) + 1)]
    assert all(c.deps == () for c in scores)
    # The collected stream depends on every micro-batch, learned when it resolved.
    assert {p for p in echo.parts} == {(tick.call_id, k) for k in range(1, len(scores) + 1)}
    summary = summarise(trace)
    assert 0 < summary.chain_s <= summary.wall_s + 1e-6


def test_nothing_is_recorded_unless_tracing() -> None:
    async def main(session, roles, src):
        await roles.ticker.tick(src)
        with pytest.raises(ConfigError, match="start_trace"):
            session.stop_trace()
        await session.start_trace()
        trace = session.stop_trace()
        await roles.ticker.tick(src)  # after the stop: not recorded
        session.mark_step()  # a no-op while not tracing
        return trace, session._scheduler.tracer

    trace, tracer = run(main)
    assert trace.calls == [] and tracer is None


def test_a_rank_local_stream_consumer_passes_a_gang_consumers_open_slot() -> None:
    async def main(session, roles, src):
        await session.start_trace()
        rollout = roles.ticker.tick(src, delay=0.03, stream=StreamOptions(micro_batch=1, migrate=None))
        echoed = roles.consumer.echo(rollout.map(x_of_value))  # whole-pool calls on c1; its slot is first
        scored = roles.scorer.score(rollout)  # rank-local, on c1 too
        await asyncio.gather(collect(echoed), collect(scored))
        return session.stop_trace()

    trace = run(main)
    tick = next(c for c in trace.calls if c.method == "tick")
    scores = [c for c in trace.calls if c.method == "score"]
    # The scorer's calls need not wait for the echo stream's end: they run as the
    # micro-batches come, between the echo calls.
    assert min(c.started for c in scores) < tick.finished
    check_spans(trace)


def test_serial_runs_one_call_at_a_time_across_pools() -> None:
    async def main(session, roles, src):
        session.serial = True
        await session.start_trace()
        a = roles.ticker.tick(src, delay=0.002)
        b = roles.consumer.echo(a.map(x_of_value))
        c = roles.scorer.score(a)  # another role on c1, independent of b
        d = roles.ticker.tick(src, delay=0.002)  # t2 is free while c1 works: serial keeps it waiting
        await asyncio.gather(b, c, d)
        trace = session.stop_trace()
        session.serial = False
        return trace

    trace = run(main)
    calls = sorted(trace.calls, key=lambda c: c.started)
    assert [c.call_id for c in calls] == sorted(c.call_id for c in calls)  # submission order
    for before, after in itertools.pairwise(calls):
        assert after.started >= before.finished


def test_the_chain_waits_for_the_previous_step() -> None:
    from asyncflow.tracing import CallRecord, Trace

    def call(cid, role, step, start, end):
        return CallRecord(call_id=cid, role=role, method="m", pool=role, rank_local=False, deps=(), step=step,
                          submitted=start, started=start, finished=end)

    trace = Trace(calls=[call(1, "a", 0, 0.0, 1.0), call(2, "b", 0, 0.0, 3.0), call(3, "a", 1, 3.0, 4.0)],
                  pools={"a": 1, "b": 1}, roles={"a": "a", "b": "b"}, start=0.0, end=4.0, steps=[0.0, 3.0])
    # Role order alone would let a's second call start at 1; the loop awaited b's call first.
    assert summarise(trace).chain_s == pytest.approx(4.0)


def test_the_bound_counts_a_pools_wait_for_its_first_input() -> None:
    from asyncflow.tracing import CallRecord, RankSpan, Trace

    def call(cid, role, pool, start, end, deps=()):
        span = RankSpan(pool=pool, rank=0, worker=0 if pool == "a" else 1, start=start, end=end, rows=1,
                        bytes_pulled=0)
        return CallRecord(call_id=cid, role=role, method="m", pool=pool, rank_local=False, deps=deps, step=0,
                          submitted=start, started=start, finished=end, ranks=(span,))

    # gen on a; values and scores (two roles) then the update on b, all after gen.
    trace = Trace(calls=[call(1, "gen", "a", 0.0, 1.0), call(2, "v", "b", 1.0, 2.0, deps=(1,)),
                         call(3, "r", "b", 2.0, 3.5, deps=(1,)), call(4, "u", "b", 3.5, 4.5, deps=(2, 3))],
                  pools={"a": 1, "b": 1}, roles={"gen": "a", "v": "b", "r": "b", "u": "b"}, start=0.0, end=4.5)
    s = summarise(trace)
    assert s.chain_s == pytest.approx(3.5) and s.busy_s["b"] == pytest.approx(3.5)
    # b cannot start before gen's 1 s, then has 3.5 s of work.
    assert s.load_bound_s == pytest.approx(4.5) and s.bound_s == pytest.approx(4.5)


def test_serial_mode_runs_streamed_calls_before_later_calls_that_need_them() -> None:
    async def main(session, roles, src):
        session.serial = True
        rollout = roles.ticker.tick(src, delay=0.001, stream=StreamOptions(micro_batch=2, migrate=None))
        scored = roles.scorer.score(rollout)  # made on the stream: sits in the stream's slot
        total = roles.consumer.total(collect(rollout).map(x_of_value))  # queued after the slot
        await collect(scored)
        return await total

    assert run(main, timeout=30)["sum"] == pytest.approx(sum(i * 10 + s for i, s in enumerate(STEPS)))
