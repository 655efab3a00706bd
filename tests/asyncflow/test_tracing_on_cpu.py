"""A trace recorded on Ray: spans from worker processes, aligned clocks, exports."""

from __future__ import annotations

import json

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.tracing import check_spans, summarise, write_chrome_trace, write_timeline_png
from support import Consumer, Producer, Sleeper

pytestmark = pytest.mark.usefixtures("shared_ray")

P2 = ResourcePool(name="p2", devices=2)
C1 = ResourcePool(name="c1", devices=1)


def test_a_traced_run_exports_valid_trace_events(tmp_path, loop_thread) -> None:
    async def main():
        async with af.Session() as session:
            roles = await session.spawn({"producer": RoleSpec(cls=Producer, pool=P2),
                                         "consumer": RoleSpec(cls=Consumer, pool=C1),
                                         "sleeper": RoleSpec(cls=Sleeper, pool=P2)})
            src = await session.put({"idx": torch.arange(16)}, pool=P2)
            await session.start_trace()
            for _ in range(2):
                session.mark_step()
                x = roles.producer.produce(src, width=64)
                await roles.consumer.total(roles.consumer.echo(x))
                await roles.sleeper.work(0.05)
            await roles.sleeper.spin(0.05)
            return session.stop_trace()

    trace = loop_thread.run(main())
    check_spans(trace)  # no two spans overlap on one rank, pulls inside their spans
    assert len(trace.calls) == 9 and all(c.ok for c in trace.calls)
    # A span's CPU time is its calling thread's: a sleeping method's is near
    # nothing, a spinning one's what it spun (up to its span's length).
    slept = [s for c in trace.calls if c.method == "work" for s in c.ranks]
    spun = [s for c in trace.calls if c.method == "spin" for s in c.ranks]
    assert len(slept) == 4 and all(s.cpu_s < 0.5 * s.seconds for s in slept)
    assert len(spun) == 2 and all(0.05 <= s.cpu_s <= s.seconds + 1e-3 for s in spun)
    echo = next(c for c in trace.calls if c.method == "echo")
    assert echo.ranks[0].bytes_pulled > 0 and echo.ranks[0].rows_in == 16
    workers = {s.worker for c in trace.calls for s in c.ranks}
    assert len(workers) == 3
    summary = summarise(trace)
    assert summary.busy_s["p2"] > 0.09 and 0 <= summary.idle_fraction["c1"] <= 1
    assert summary.stage_cpu_s["sleeper.spin"] == pytest.approx(sum(s.cpu_s for s in spun))
    assert summary.stage_cpu_s["sleeper.spin"] >= 0.1 > summary.stage_cpu_s["sleeper.work"]
    assert summary.chain_s <= summary.wall_s + 0.01
    path = write_chrome_trace(trace, tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"producer.produce", "consumer.echo", "sleeper.work"}
    ranks_spun = [e for e in spans if e["name"] == "sleeper.spin" and e["cat"] == "sleeper"]
    assert len(ranks_spun) == 2 and all(e["args"]["cpu_ms"] >= 50 for e in ranks_spun)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    png = write_timeline_png(trace, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
