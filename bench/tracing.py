"""What tracing costs per call, off and on.

Run as ``python -m bench.tracing --json PATH``.

- ``off_hooks_us``: the driver-side work tracing adds to a call while off (the
  scheduler's five ``tracer is not None`` tests and the worker's ``spec.trace``
  test), timed in a tight loop;
- ``call_off_us`` / ``call_on_us``: a no-op call's round trip on Ray (one rank,
  awaited one after another), tracing off and on, alternating in one session
  (medians of ``--repeats`` batches of ``--calls`` calls); ``on_overhead_us`` is
  their difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import timeit
from pathlib import Path
from typing import Any

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from bench._roles import Burner


def off_hooks_us(n: int = 1_000_000) -> float:
    """Microseconds per call of the checks tracing leaves in the call path when off."""

    class Scheduler:
        tracer = None

    class Spec:
        trace = False

    s, spec = Scheduler(), Spec()

    def hooks() -> None:
        for _ in range(5):
            if s.tracer is not None:
                raise AssertionError
        if spec.trace:
            raise AssertionError

    return timeit.timeit(hooks, number=n) / n * 1e6


async def calls_us(*, calls: int, repeats: int) -> dict[str, Any]:
    """No-op call round trips with tracing off and on, in one session."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    async with af.Session() as session:
        roles = await session.spawn({"burner": RoleSpec(cls=Burner, pool=ResourcePool(name="p", devices=1))})
        for _ in range(20):
            await roles.burner.compute(0)
        for _ in range(repeats):
            for mode in ("off", "on"):
                if mode == "on":
                    await session.start_trace()
                start = time.perf_counter()
                for _ in range(calls):
                    await roles.burner.compute(0)
                times[mode].append((time.perf_counter() - start) / calls * 1e6)
                if mode == "on":
                    session.stop_trace()
    af.shutdown_ray()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"call_off_us": off, "call_on_us": on, "on_overhead_us": on - off, "runs_us": times}


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.tracing``."""
    parser = argparse.ArgumentParser(prog="bench.tracing", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args(argv)
    record = {"off_hooks_us": off_hooks_us(), **asyncio.run(calls_us(calls=a.calls, repeats=a.repeats)),
              "load_avg": os.getloadavg()}
    print(json.dumps({k: v for k, v in record.items() if k != "runs_us"}, indent=2))
    if a.json is not None:
        a.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
