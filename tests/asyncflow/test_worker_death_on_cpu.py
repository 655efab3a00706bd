"""A worker process killed in the middle of a call surfaces as an error naming the
role and rank within seconds, and the pool refuses further calls instead of hanging.
Every error a death causes blames the call the process was serving, or none when
it died between calls: never a call queued behind it or sent to it afterwards."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time

import psutil
import pytest
import ray
import torch

import asyncflow as af
from asyncflow import OneToAll, ResourcePool, Role, RoleSpec, register
from asyncflow.train._failures import interrupted
from support import Sleeper

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's sessions

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Exiting(Role):
    """Ends its own process partway through a call."""

    @register(protocol=OneToAll())
    def exit_after(self, seconds: float, *, rank: int) -> None:
        """Sleeps, then ends the process on rank ``rank`` (as a crash in native code does)."""
        time.sleep(seconds)
        if self.ctx.rank == rank:
            os._exit(1)

    @register(protocol=OneToAll())
    def pid(self) -> int:
        return os.getpid()


class RankLocalExiting(Exiting):
    """:class:`Exiting` whose calls use no other rank: a second call is sent to a
    rank while the first still runs there (it waits in the worker)."""

    def rank_local(self) -> frozenset[str]:
        return frozenset({"exit_after", "pid"})


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


def _blamed(err: BaseException) -> tuple[str, str, int, str]:
    """Where a death was (``Trainer`` reports it so): role, method, rank, pool."""
    died = err.cause if isinstance(err, af.PoolBrokenError) else err
    assert isinstance(died, af.WorkerDiedError), err
    return died.role, died.method, died.rank, died.pool


def test_a_death_is_blamed_on_the_call_running_not_on_the_one_queued_behind_it() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            pool = ResourcePool(name="a", devices=2)
            roles = await session.spawn({"crash": RoleSpec(cls=Exiting, pool=pool),
                                         "s": RoleSpec(cls=Sleeper, pool=pool)})
            running = roles.crash.exit_after(0.5, rank=1)
            queued = roles.s.work(0.0)
            errors = []
            for fut in (running, queued):
                with pytest.raises(af.WorkerDiedError) as info:
                    await asyncio.wait_for(fut, timeout=60)
                errors.append(info.value)
            with pytest.raises(af.PoolBrokenError) as later:
                await asyncio.wait_for(roles.s.pid(), timeout=60)
            return *errors, later.value

    running, queued, later = asyncio.run(main())
    for err in (running, queued, later):
        assert _blamed(err) == ("crash", "exit_after", 1, "a"), str(err)
        assert "\n" not in str(err)
    assert re.search(r"its worker process died; s\.work#\d+ was not run$", str(queued)), str(queued)
    assert "(its worker process died during crash.exit_after)" in str(later)


def test_a_call_waiting_in_the_worker_behind_the_one_that_died_is_not_blamed() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"crash": RoleSpec(cls=RankLocalExiting,
                                                           pool=ResourcePool(name="a", devices=2))})
            running = roles.crash.exit_after(1.0, rank=1)
            behind = roles.crash.pid()  # sent to both ranks at once, runs after exit_after there
            errors = []
            for fut in (running, behind):
                with pytest.raises(af.WorkerDiedError) as info:
                    await asyncio.wait_for(fut, timeout=60)
                errors.append(info.value)
            return errors

    running, behind = asyncio.run(main())
    assert _blamed(running) == _blamed(behind) == ("crash", "exit_after", 1, "a")
    assert re.search(r"its worker process died; crash\.pid#\d+ did not finish$", str(behind)), str(behind)


def test_a_death_between_calls_blames_none_and_names_the_call_that_found_it(monkeypatch) -> None:
    """Ray reports the death only once the next call was sent (its watch is made
    silent here; by chance otherwise): the worker's connection, closed before that
    call was sent, says the process died between calls."""
    async def silent(self, worker: int) -> None:
        await asyncio.get_running_loop().create_future()

    monkeypatch.setattr("asyncflow.runtime._transport.RayTransport.watch", silent)

    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"s": RoleSpec(cls=Sleeper, pool=ResourcePool(name="a", devices=2))})
            pids = await roles.s.pid()
            os.kill(pids[1], signal.SIGKILL)
            psutil.Process(pids[1]).wait(timeout=30)  # blocks the loop: the driver learns nothing yet
            with pytest.raises(af.WorkerDiedError) as found:
                await asyncio.wait_for(roles.s.work(0.0), timeout=60)
            with pytest.raises(af.PoolBrokenError) as later:
                await asyncio.wait_for(roles.s.pid(), timeout=60)
            return found.value, later.value, str(interrupted(later.value, session, "last checkpoint: C"))

    found, later, line = asyncio.run(main())
    assert _blamed(found) == _blamed(later) == ("", "", 1, "a")
    assert re.fullmatch(r"the worker process of rank 1 in pool 'a' on node \w+ \(127\.0\.0\.1\) died between "
                        r"calls; last checkpoint: C", line), line  # asyncflow train's line
    assert re.fullmatch(r"rank 1 of pool 'a': its worker process died between calls; s\.work#\d+ found it dead",
                        str(found)), str(found)
    assert "lost rank 1 (its worker process died between calls;" in str(later)


def test_a_death_on_one_pool_leaves_the_call_running_on_another_alone() -> None:
    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({"crash": RoleSpec(cls=Exiting, pool=ResourcePool(name="a", devices=2)),
                                         "s": RoleSpec(cls=Sleeper, pool=ResourcePool(name="b", devices=1))})
            other = roles.s.work(2.0)
            with pytest.raises(af.WorkerDiedError) as info:
                await asyncio.wait_for(roles.crash.exit_after(0.5, rank=1), timeout=60)
            return info.value, await asyncio.wait_for(other, timeout=60)

    err, other = asyncio.run(main())
    assert _blamed(err) == ("crash", "exit_after", 1, "a")
    assert len(other) == 1 and other[0]["end"] - other[0]["start"] >= 2.0
