"""What tracing costs per call, off and on.

Run as ``python -m bench.tracing --json PATH``.

- ``off_hooks_us``: the driver-side work tracing adds to a call while off (the
  scheduler's five ``tracer is not None`` tests and the worker's ``spec.trace``
  test), timed in a tight loop;
- ``call_off_us`` / ``call_on_us``: a no-op call's round trip on Ray (one rank,
  awaited one after another), tracing off and on, alternating in one session
  (medians of ``--repeats`` batches of ``--calls`` calls); ``on_overhead_us`` is
  their difference;
- ``ray_call_us``: Ray's own actor round trip in the same run, the floor under
  ``call_off_us``: a no-op method of a plain Ray actor, awaited one call after
  another from the same event loop, in batches alternating with the others;
  ``call_off_over_ray`` is the ratio;
- ``pull_call_us`` / ``local_call_us``: a call whose one rank pulls its rows from
  two producer ranks of another pool (two transfers), and the same call on rows
  its rank holds, in the same batches; ``pull_over_local`` is the ratio.
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

import ray
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from bench._roles import Burner, Payload, Sink


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


class Plain:
    """A plain Ray actor: what a call costs Ray alone."""

    def noop(self) -> None:
        """Nothing."""


async def calls_us(*, calls: int, repeats: int) -> dict[str, Any]:
    """No-op call round trips with tracing off and on, and Ray's own, in one session."""
    times: dict[str, list[float]] = {"off": [], "on": [], "ray": [], "pull": [], "local": []}
    producers, consumer = ResourcePool(name="prod", devices=2), ResourcePool(name="p", devices=1)
    async with af.Session() as session:
        roles = await session.spawn({"burner": RoleSpec(cls=Burner, pool=consumer),
                                     "payload": RoleSpec(cls=Payload, pool=producers),
                                     "sink": RoleSpec(cls=Sink, pool=consumer)})
        plain: Any = ray.remote(Plain).options(num_cpus=0).remote()  # type: ignore[attr-defined]
        remote = roles.payload.produce(await session.put({"idx": torch.arange(16)}, pool=producers), width=64)
        local = await session.put({"x": torch.ones(16, 64)}, pool=consumer)
        for future in (remote, local):
            got = await roles.sink.take(future)
            if got["rows"] != 16:
                raise AssertionError(f"the sink got {got['rows']} rows of 16")
        for _ in range(20):
            await roles.burner.noop()
            await plain.noop.remote()
            await roles.sink.take(remote)
            await roles.sink.take(local)
        for _ in range(repeats):
            for mode in ("off", "on", "ray", "pull", "local"):
                if mode == "on":
                    await session.start_trace()
                start = time.perf_counter()
                for _ in range(calls):
                    if mode == "ray":
                        await plain.noop.remote()
                    elif mode == "pull":
                        await roles.sink.take(remote)
                    elif mode == "local":
                        await roles.sink.take(local)
                    else:
                        await roles.burner.noop()
                times[mode].append((time.perf_counter() - start) / calls * 1e6)
                if mode == "on":
                    session.stop_trace()
        ray.kill(plain)
    af.shutdown_ray()
    off, on, bare, pull, here = (statistics.median(times[m]) for m in ("off", "on", "ray", "pull", "local"))
    return {"call_off_us": off, "call_on_us": on, "on_overhead_us": on - off, "ray_call_us": bare,
            "call_off_over_ray": off / bare, "pull_call_us": pull, "local_call_us": here,
            "pull_over_local": pull / here, "runs_us": times}


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
