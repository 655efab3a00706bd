"""A call's ``timeout_s`` on real Ray workers: a call that runs past it, or that
waits on a stalled producer for its rows, fails with :class:`CallTimeoutError`
naming the call, the rank and what it pulls, within moments of the timeout; its
pool then refuses calls instead of hanging, other pools go on, and the session
closes. Without ``timeout_s`` nothing is timed (a slow healthy rank is never
failed for being slow)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from support import Consumer, Producer, Sleeper, stop_process

GUARD_S = 120.0
"""Only guards against a hang."""

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's sessions


def test_a_call_past_its_timeout_fails_naming_it_and_breaks_only_its_pool() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"slow": RoleSpec(cls=Sleeper, pool=ResourcePool(name="a", devices=2)),
                                         "other": RoleSpec(cls=Sleeper, pool=ResourcePool(name="b", devices=1))})
            in_time = await roles.slow.work(0.2, timeout_s=30)  # finishes well within its timeout
            started = time.monotonic()
            with pytest.raises(af.CallTimeoutError) as info:
                await roles.slow.work(60.0, timeout_s=1.5)
            elapsed = time.monotonic() - started
            with pytest.raises(af.PoolBrokenError, match=r"slow\.work"):
                await roles.slow.pid()
            still = await roles.other.pid()
            return in_time, info.value, elapsed, still

    in_time, err, elapsed, still = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    assert len(in_time) == 2
    assert (err.role, err.method, err.pool, err.rank, err.timeout_s) == ("slow", "work", "a", 0, 1.5)
    assert "did not finish within 1.5 s (timeout_s) on ranks 0, 1" in str(err)
    assert 1.5 <= elapsed < 15
    assert len(still) == 1


def test_a_pull_from_a_stalled_producer_fails_naming_the_producer() -> None:
    """The producer's process is stopped (``SIGSTOP``) after making its rows: the
    consumer's pull never completes, and its ``timeout_s`` ends it."""
    async def main():
        # Workers of its own: a test that stops a process takes none another module
        # used (see test_weight_sync_stall_on_cpu.py).
        async with af.Session(cpu_slots=8, keep_workers=False) as session:
            roles = await session.spawn({
                "producer": RoleSpec(cls=Producer, pool=ResourcePool(name="prod", devices=1)),
                "consumer": RoleSpec(cls=Consumer, pool=ResourcePool(name="cons", devices=1))})
            src = await session.put({"idx": torch.arange(8)}, pool=roles.producer.pool)
            rows = roles.producer.produce(src, width=16)
            await rows
            pid, *_ = await session.worker("prod", 0).identity.remote()
            stop_process(pid)
            try:
                started = time.monotonic()
                with pytest.raises(af.CallTimeoutError) as info:
                    await roles.consumer.echo(rows, timeout_s=2.0)
                elapsed = time.monotonic() - started
                with pytest.raises(af.PoolBrokenError, match="pool 'cons'"):
                    await roles.consumer.echo(rows)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            return info.value, elapsed

    err, elapsed = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    assert (err.role, err.method, err.pool, err.rank) == ("consumer", "echo", "cons", 0)
    assert "it pulls rows of producer.produce from pool 'prod' rank 0" in str(err), str(err)
    assert 2.0 <= elapsed < 15


def test_a_bad_timeout_is_refused_at_the_call() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"s": RoleSpec(cls=Sleeper, pool=ResourcePool(name="a", devices=1))})
            for value in (0, -1.0, "5", True):
                with pytest.raises(af.ConfigError, match=r"s\.work: timeout_s must be a number of seconds > 0"):
                    roles.s.work(0.0, timeout_s=value)
            assert len(await roles.s.work(0.0, timeout_s=None)) == 1  # None: no limit

    asyncio.run(asyncio.wait_for(main(), GUARD_S))
