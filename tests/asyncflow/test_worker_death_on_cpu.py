"""A worker process killed in the middle of a call surfaces as an error naming the
role and rank within seconds, and the pool refuses further calls instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from support import Sleeper

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's sessions


def test_killed_worker_surfaces_quickly_naming_role_and_rank() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            pool = ResourcePool(name="a", devices=2)
            roles = await session.spawn({"slow": RoleSpec(cls=Sleeper, pool=pool),
                                         "other": RoleSpec(cls=Sleeper, pool=ResourcePool(name="b", devices=1))})
            pids = await roles.slow.pid()
            busy = roles.slow.work(60.0)
            await asyncio.sleep(1.0)  # the call is running on both ranks
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(af.WorkerDiedError) as info:
                await asyncio.wait_for(busy, timeout=30)
            elapsed = time.monotonic() - killed_at
            with pytest.raises(af.PoolBrokenError, match=r"slow\.work"):
                await asyncio.wait_for(roles.slow.pid(), timeout=10)
            still = await asyncio.wait_for(roles.other.pid(), timeout=30)  # other pools go on
            return info.value, elapsed, still

    err, elapsed, still = asyncio.run(main())
    assert (err.role, err.method, err.rank) == ("slow", "work", 1)
    assert "died" in str(err)
    assert elapsed < 30  # bounded by wait_for above; a hang would fail there
    assert len(still) == 1


def test_a_role_that_fails_to_start_is_named() -> None:
    from workers.roles import ReferenceConfig, ReferenceWorker

    async def main():
        async with af.Session(cpu_slots=8) as session:
            pool = ResourcePool(name="p", devices=1)
            with pytest.raises(af.ConfigError) as info:
                await session.spawn({"ref": RoleSpec(cls=ReferenceWorker, pool=pool,
                                                     config=ReferenceConfig(model_dir="/no/such/model"))})
            return info.value

    err = asyncio.run(asyncio.wait_for(main(), 120))
    assert "role 'ref' failed to start on rank 0 of pool 'p'" in str(err) and "/no/such/model" in str(err)


def test_a_dead_worker_under_the_drivers_own_rows_is_named() -> None:
    """``Session.put`` and ``fetch_rows`` on a pool whose rank died raise
    :class:`WorkerDiedError` naming pool and rank, as calls do (not the transport's
    internal error)."""
    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"s": RoleSpec(cls=Sleeper, pool=ResourcePool(name="a", devices=2))})
            kept = await session.put({"x": torch.arange(4).view(4, 1)})
            pids = await roles.s.pid()
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(af.WorkerDiedError) as put:
                await asyncio.wait_for(session.put({"x": torch.arange(2).view(2, 1)}), timeout=60)
            with pytest.raises(af.WorkerDiedError) as fetch:
                await asyncio.wait_for(kept.fetch(), timeout=60)
            return put.value, fetch.value

    put, fetch = asyncio.run(main())
    for err in (put, fetch):
        assert (err.pool, err.rank) == ("a", 1) and "rank 1 of pool 'a': its worker process died" in str(err)
