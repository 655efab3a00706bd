"""The scheduler, futures and proxies without Ray: in-process workers
(``asyncflow.runtime._local``), real role objects, the real data plane and scheduler.

Failures, cancellation, closing, death (simulated by the local transport), field
contracts and shard accounting are tested here quickly; ``*_on_cpu`` tests repeat
the essential ones on real Ray workers."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.runtime._local import LocalSession
from channels import reduce_metrics
from support import Carrier, Consumer, Faulty, Producer, Sleeper, Slow, expected_x

P4 = ResourcePool(name="p4", devices=4)
C2 = ResourcePool(name="c2", devices=2)
C3 = ResourcePool(name="c3", devices=3)

SPECS = {
    "producer": RoleSpec(cls=Producer, pool=P4),
    "consumer2": RoleSpec(cls=Consumer, pool=C2),
    "consumer3": RoleSpec(cls=Consumer, pool=C3),
    "sleeper2": RoleSpec(cls=Sleeper, pool=C2),
    "sleeper3": RoleSpec(cls=Sleeper, pool=C3),
    "faulty": RoleSpec(cls=Faulty, pool=C3),
    "slow": RoleSpec(cls=Slow, pool=C2),
    "carrier": RoleSpec(cls=Carrier, pool=C2),
}


def run(main, timeout: float = 60):
    async def wrapped():
        async with LocalSession() as session:
            roles = await session.spawn(SPECS)
            return await asyncio.wait_for(main(session, roles), timeout)
    return asyncio.run(wrapped())


async def _made(session, roles, n=10, width=4):
    src = await session.put({"idx": torch.arange(n)}, pool=P4)
    return roles.producer.produce(src, width=width)


def test_rows_go_from_4_to_3_ranks_in_order() -> None:
    async def main(session, roles):
        return await roles.consumer3.echo(await _made(session, roles, 22, 8)).fetch()

    out = run(main)
    assert torch.equal(out["idx"], torch.arange(22))
    assert torch.equal(out["x"].double(), expected_x(torch.arange(22), 8))
    assert sorted(set(out["rank"].tolist())) == [0, 1, 2]


def test_raising_rank_fails_the_call_at_once_names_it_and_the_pool_heals() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 9)
        bad = roles.faulty.boom(made, on_rank=1)
        dependent = roles.consumer2.total(bad)  # another pool, reads what boom writes
        with pytest.raises(af.RemoteStageError) as info:
            await bad
        with pytest.raises(af.RemoteStageError) as dep:
            await dependent
        after = await roles.consumer3.echo(made)  # the same pool takes the next call
        return info.value, dep.value, after, list(session.local.log)

    err, dep, after, log = run(main)
    assert (err.role, err.method, err.rank, err.pool) == ("faulty", "boom", 1, "c3")
    assert "bad row block on rank 1" in str(err) and "ValueError" in err.remote_traceback
    assert dep is err
    assert after.num_rows == 9
    c3 = [6, 7, 8]  # workers of pool c3 (p4 is 0-3, c2 is 4-5)
    assert {w for op, w in log if op == "poison"} == set(c3)
    assert {w for op, w in log if op == "heal"} == set(c3)


def test_a_slow_rank_is_not_a_failure() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 8)
        return await roles.slow.lag(made, rank=1, seconds=3.0).fetch()

    out = run(main)
    assert torch.equal(out["rank"], torch.tensor([0] * 4 + [1] * 4))


def test_close_settles_queued_and_running_calls() -> None:
    async def main():
        session = LocalSession()
        roles = await session.spawn(SPECS)
        running = roles.sleeper2.work(2.0)
        queued = roles.sleeper2.work(0.1)
        waiter = asyncio.ensure_future(asyncio.wait_for(asyncio.gather(queued), 30))
        await asyncio.sleep(0.3)
        await session.close()
        results = []
        for fut in (running, queued):
            with pytest.raises(af.SessionClosedError):
                await fut
            results.append(True)
        with pytest.raises(af.SessionClosedError):
            await waiter
        with pytest.raises(af.SessionClosedError):
            roles.sleeper2.work(0.1)
        return results

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [True, True]


def test_cancel_a_queued_call_cancels_its_dependents_and_allocates_nothing() -> None:
    async def main(session, roles):
        src = await session.put({"idx": torch.arange(8)}, pool=P4)
        blocker = roles.sleeper2.work(1.0)           # c2 is busy
        first = roles.consumer2.echo(roles.producer.produce(src, width=4))  # queued behind it
        second = roles.consumer3.total(first)      # depends on first, on another pool
        other = roles.consumer3.echo(roles.producer.produce(src, width=4))  # independent
        assert first.cancel() and first.cancelled()
        assert second.cancelled()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await second
        assert (await other).num_rows == 8
        assert not first.cancel()  # already done
        executed = [w for op, w in session.local.log if op == "execute"]
        del src, blocker, other
        gc.collect()
        return executed, await session.store_stats()

    executed, stats = run(main)
    # produce x2 on p4 (4 ranks each), work on c2, echo on c3: never the cancelled echo/total
    assert executed.count(4) == 1 and executed.count(5) == 1
    assert [s.shards for _, _, s in stats] == [0] * len(stats)


def test_cancel_a_running_call_frees_its_rows_when_it_finishes() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 8)
        await made
        running = roles.slow.lag(made, rank=0, seconds=0.5)
        await asyncio.sleep(0.1)
        running.cancel()
        del made
        await asyncio.sleep(1.0)
        gc.collect()
        return await session.store_stats()

    stats = run(main)
    assert [s.shards for _, _, s in stats] == [0] * len(stats)


def test_killed_worker_fails_running_and_queued_calls_then_the_pool_refuses() -> None:
    async def main(session, roles):
        running = roles.sleeper2.work(5.0)
        queued = roles.sleeper2.work(0.1)
        await asyncio.sleep(0.3)
        session.local.kill(5)  # rank 1 of c2
        with pytest.raises(af.WorkerDiedError) as run_err:
            await running
        with pytest.raises(af.WorkerDiedError) as queued_err:
            await queued
        with pytest.raises(af.PoolBrokenError) as later:
            await roles.sleeper2.work(0.1)
        still = await roles.sleeper3.work(0.0)  # other pools go on
        return run_err.value, queued_err.value, later.value, still

    run_err, queued_err, later, still = run(main)
    assert (run_err.pool, run_err.rank, run_err.role, run_err.method) == ("c2", 1, "sleeper2", "work")
    assert (queued_err.pool, queued_err.rank) == ("c2", 1)
    assert "lost rank 1" in str(later) and "\n" not in str(later)
    assert len(still) == 3


def test_a_producer_dying_is_reported_as_the_producers_death() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 8)
        await made
        session.local.kill(2)  # rank 2 of the producer pool
        with pytest.raises(af.WorkerDiedError) as info:
            await roles.consumer2.echo(made)
        await asyncio.sleep(0.1)
        return info.value, await roles.sleeper2.work(0.0)  # the consumer's pool still works

    err, after = run(main)
    assert (err.pool, err.rank, err.role, err.method) == ("p4", 2, "producer", "produce")
    assert "consumer2.echo" in err.cause
    assert len(after) == 2


def test_field_contracts_are_checked_at_submit() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 6)
        with pytest.raises(af.MissingFieldError, match="'adv'"):
            roles.consumer2.needs_adv(made)
        doubled = roles.carrier.double(made)  # carries the input's columns
        assert doubled.fields == {"idx", "x", "mask", "y"}
        with pytest.raises(af.MissingFieldError, match="'weight'"):
            roles.carrier.total(made, weighted=True)  # reads computed from the arguments
        plain = await roles.carrier.total(made, weighted=False)
        rows = await doubled.fetch()
        return plain, rows

    plain, rows = run(main)
    assert plain["rows"] == 3  # mean over the 2 ranks, weighted by their rows
    assert torch.equal(rows["y"], rows["x"] * 2) and set(rows) == {"idx", "x", "mask", "y"}


def test_merge_refuses_two_columns_with_one_name_and_accepts_the_same_column() -> None:
    @af.transform(reads=("x",), writes=("adv",))
    def centre(batch):
        return {"adv": batch["x"] - batch["x"].mean()}

    async def main(session, roles):
        made = await _made(session, roles, 6)
        echoed = roles.consumer2.echo(made)  # writes idx and x again: different columns
        with pytest.raises(af.ConfigError, match=r"field '(idx|x)' comes from both"):
            af.merge(made, echoed)
        same = af.merge(made, made.map(centre))  # made's columns twice: fine
        ok = af.merge(made, echoed.rename(idx="idx2", x="x2"))
        return await same.fetch(), await ok.fetch()

    same, ok = run(main)
    assert set(same) == {"idx", "x", "mask", "adv"}
    assert set(ok) == {"idx", "x", "mask", "idx2", "x2", "rank"}


def test_a_transforms_optional_field_is_pulled_where_the_rows_have_it() -> None:
    @af.transform(reads=("x",), optional=("w",), writes=("adv",))
    def weighted(batch):
        w = batch.get("w")
        return {"adv": batch["x"].sum(dim=1) * (1.0 if w is None else w)}

    async def main(session, roles):
        made = await _made(session, roles, 6)
        with_w = af.merge(made, (await session.put({"w": torch.full((6,), 2.0)}, pool=P4)))
        return (await roles.consumer2.needs_adv(made.map(weighted)).fetch(),
                await roles.consumer2.needs_adv(with_w.map(weighted)).fetch())

    plain, doubled = run(main)
    torch.testing.assert_close(doubled["adv"], 2 * plain["adv"])


def test_put_keeps_groups_whole() -> None:
    async def main(session, roles):
        src = await session.put({"idx": torch.arange(12), "x": torch.zeros(12, 2)}, pool=C3, group_size=4)
        meta = await src
        return meta, await roles.consumer3.echo(src).fetch()

    meta, out = run(main)
    assert meta.group_size == 4
    assert torch.equal(out["rank"], torch.tensor([0] * 4 + [1] * 4 + [2] * 4))


def test_300_calls_with_30_failing_leave_no_shard_behind() -> None:
    async def main(session, roles):
        src = await session.put({"idx": torch.arange(6)}, pool=P4)
        for i in range(300):
            made = roles.producer.produce(src, width=4)
            if i % 10 == 0:
                with pytest.raises(af.RemoteStageError):
                    await roles.faulty.boom(made.rename(x="x"), on_rank=0)
            else:
                await roles.consumer2.echo(made)
        del src, made
        gc.collect()
        return await session.store_stats()

    stats = run(main, timeout=600)
    assert [s.shards for _, _, s in stats] == [0] * len(stats)


def test_leases_released_from_other_threads_and_finalisers_are_freed() -> None:
    async def main(session, roles):
        made = await _made(session, roles, 8)
        await made
        holder = [made]
        t = threading.Thread(target=lambda: (holder.clear(), gc.collect()))
        del made
        t.start()
        t.join()
        await asyncio.sleep(0.1)
        return await session.store_stats()

    stats = run(main)
    assert [s.shards for _, _, s in stats] == [0] * len(stats)


def test_metrics_are_weighted_by_the_rows_each_rank_had() -> None:
    dicts = [{"loss": 1.0, "n": 3}, {"loss": 4.0, "n": 1}, {"n": 0}]
    out = reduce_metrics(dicts, {"n": "sum"}, weights=[3, 1, 0])
    assert out == {"loss": (3 * 1.0 + 1 * 4.0) / 4, "n": 4.0}
