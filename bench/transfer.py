"""Transfer benchmark: rows moving between worker groups peer to peer.

A producer group of 2 ranks feeds consumer groups of 2 and 3 ranks with 64 MB and
256 MB payloads (each consumer rank pulls exactly its rows straight from the
producers); one in-process memcpy of the same bytes gives the floor; the driver's
peak RSS growth shows that no payload passes through it; and two roles on two
pools show overlap: the same calls awaited one by one vs issued together.

    python -m bench.transfer --json bench-transfer.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time

import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from bench._roles import Burner, Payload, Sink

WIDTH = 4096  # float32 per row: 16 KiB rows


def memcpy_s(nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """Median times of one in-process copy of ``nbytes``: into fresh memory (what a
    receiver does: allocate, fault the pages in, copy) and into a warm buffer."""
    src = torch.ones(nbytes // 4)
    fresh, warm = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        dst = src.clone()
        fresh.append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - t)
        del dst
    return statistics.median(fresh), statistics.median(warm)


async def hop_s(session: af.Session, roles: af.Roles, consumer: str, nbytes: int, repeats: int) -> float:
    """Median wall time of a consumer call that pulls ``nbytes`` from the producers."""
    rows = nbytes // (4 * WIDTH)
    src = await session.put({"idx": torch.arange(rows)}, pool="producer")
    made = roles.producer.produce(src, width=WIDTH)
    await made
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = await getattr(roles, consumer).take(made)
        times.append(time.perf_counter() - t)
        assert int(got["rows"]) == rows and int(got["bytes"]) == rows * 4 * WIDTH
    return statistics.median(times)


async def overlap(roles: af.Roles, steps: int, calls: int) -> tuple[float, float]:
    """(sequential, concurrent) seconds for ``calls`` calls on each of two pools."""
    t = time.perf_counter()
    for _ in range(calls):
        await roles.burn_a.compute(steps)
        await roles.burn_b.compute(steps)
    sequential = time.perf_counter() - t
    t = time.perf_counter()
    futs = [f for _ in range(calls) for f in (roles.burn_a.compute(steps), roles.burn_b.compute(steps))]
    await af.gather(*futs)
    return sequential, time.perf_counter() - t


async def run(repeats: int, progress) -> dict[str, float]:
    async with af.Session() as session:
        roles = await session.spawn({
            "producer": RoleSpec(cls=Payload, pool=ResourcePool(name="producer", devices=2)),
            "to2": RoleSpec(cls=Sink, pool=ResourcePool(name="consumers2", devices=2)),
            "to3": RoleSpec(cls=Sink, pool=ResourcePool(name="consumers3", devices=3)),
            "burn_a": RoleSpec(cls=Burner, pool=ResourcePool(name="burn_a", devices=1)),
            "burn_b": RoleSpec(cls=Burner, pool=ResourcePool(name="burn_b", devices=1)),
        })
        progress(f"workers up; transport: {session.transport}")
        out: dict[str, float] = {}
        for mb in (64, 256):
            # Copies first: they allocate in this process, and the RSS measure below
            # must see only what the hops cost the driver.
            out[f"memcpy_{mb}mb_s"], out[f"memcpy_warm_{mb}mb_s"] = memcpy_s(mb * 2**20)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for mb in (64, 256):
            for consumer, n in (("to2", 2), ("to3", 3)):
                out[f"hop_{mb}mb_2to{n}_s"] = await hop_s(session, roles, consumer, mb * 2**20, repeats)
                progress(f"{mb} MB 2->{n}: {out[f'hop_{mb}mb_2to{n}_s']:.3f} s")
            out[f"hop_{mb}mb_s"] = max(out[f"hop_{mb}mb_2to2_s"], out[f"hop_{mb}mb_2to3_s"])
        out["driver_rss_growth_256mb_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        await roles.burn_a.compute(5)  # warm both
        await roles.burn_b.compute(5)
        seq, conc = await overlap(roles, steps=400, calls=3)
        out["overlap_sequential_s"], out["overlap_concurrent_s"] = seq, conc
        progress("overlap measured")
        return out


def table(r: dict[str, float]) -> str:
    """The results as a small text table."""
    lines = [f"{'measure':<34}{'value':>12}", "-" * 46]
    for k, v in r.items():
        unit = "MB" if k.endswith("_mb") else "s"
        lines.append(f"{k:<34}{v:>11.3f}{unit}")
    lines.append("-" * 46)
    lines.append(f"64 MB hop / memcpy: {r['hop_64mb_s'] / r['memcpy_64mb_s']:.1f}x   "
                 f"overlap speed-up: {r['overlap_sequential_s'] / r['overlap_concurrent_s']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as flat JSON here")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per hop (median)")
    args = parser.parse_args(argv)
    print(f"asyncflow transfer benchmark on {os.cpu_count()} CPU cores", flush=True)
    results = asyncio.run(run(args.repeats, lambda msg: print(f"  .. {msg}", flush=True)))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
