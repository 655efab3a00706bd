"""A worker process killed in the middle of a call surfaces as an error naming the
role and rank within seconds, and the pool refuses further calls instead of hanging."""

from __future__ import annotations

import asyncio
import os
import re
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


def test_a_lost_connection_is_reported_as_the_death_behind_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that reports a broken connection in gloo's words (its peer process
    died) before Ray reports that death fails its call with the death, naming the
    process that died; without a death, the same words stay the rank's own error."""
    monkeypatch.setattr("asyncflow.runtime._completion.DEATH_REPORT_GRACE_S", 30.0)
    reset = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer"

    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"peer": RoleSpec(cls=Sleeper, pool=ResourcePool(name="a", devices=1)),
                                         "gone": RoleSpec(cls=Sleeper, pool=ResourcePool(name="b", devices=1))})
            (pid,) = await roles.gone.pid()
            broken = roles.peer.raise_after(0.5, reset)
            await asyncio.sleep(0.2)  # the call runs
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(af.WorkerDiedError) as died:
                await asyncio.wait_for(broken, timeout=60)
            monkeypatch.setattr("asyncflow.runtime._completion.DEATH_REPORT_GRACE_S", 0.5)
            with pytest.raises(af.RemoteStageError) as own:
                await asyncio.wait_for(roles.peer.raise_after(0.0, reset), timeout=60)
            return died.value, own.value

    died, own = asyncio.run(main())
    assert (died.pool, died.rank) == ("b", 0)
    assert re.search(r"its worker process died, and peer\.raise_after#\d+'s rank 0 of pool 'a' lost its connection "
                     r"to it", str(died)), str(died)
    assert "Connection reset by peer" in str(died)
    assert not isinstance(own, af.WorkerDiedError)
    assert (own.role, own.method, own.pool) == ("peer", "raise_after", "a") and "Connection reset by peer" in own.cause


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
