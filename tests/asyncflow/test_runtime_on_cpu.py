"""The runtime on real Ray workers and real gloo groups (CPU).

One session serves the module: a producer pool of 4 ranks and consumer pools of 2
and 3 ranks, with more roles sharing those pools.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import resource
import time

import psutil
import pytest
import ray
import torch
from ray.util.state import list_objects

import asyncflow as af
from asyncflow import Layout, ResourcePool, RoleSpec
from asyncflow.runtime import CallArgumentError, start_fork_server
from support import (
    Collective,
    Consumer,
    Faulty,
    Producer,
    Sleeper,
    expected_x,
    probe_with_tcpstore_clients,
    tcp_listeners,
)

P4 = ResourcePool(name="p4", devices=4)
C2 = ResourcePool(name="c2", devices=2)
C3 = ResourcePool(name="c3", devices=3)


@pytest.fixture(scope="module")
def env(loop_thread, no_shared_ray):
    # The dashboard serves ray.util.state, which the object-store check reads. Its
    # nine workers are forks of a server that imported torch once (as start_ray's).
    server = start_fork_server()
    ray.init(address="local", num_cpus=2, resources={af.CPU_SLOT: 32}, include_dashboard=True, log_to_driver=False,
             runtime_env=server.runtime_env() if server is not None else None,
             _system_config=server.system_config() if server is not None else None)
    session = af.Session()
    roles = loop_thread.run(_start(session))
    yield loop_thread, session, roles
    loop_thread.run(session.close())
    af.shutdown_ray()


async def _start(session: af.Session) -> af.Roles:
    await session.__aenter__()
    return await session.spawn({
        "producer": RoleSpec(cls=Producer, pool=P4),
        "consumer2": RoleSpec(cls=Consumer, pool=C2),
        "consumer3": RoleSpec(cls=Consumer, pool=C3),
        "sleeper2": RoleSpec(cls=Sleeper, pool=C2),
        "sleeper2b": RoleSpec(cls=Sleeper, pool=C2),
        "sleeper3": RoleSpec(cls=Sleeper, pool=C3),
        "faulty": RoleSpec(cls=Faulty, pool=C3),
        "tp": RoleSpec(cls=Collective, pool=P4, layout=Layout(t=2, d=2)),
    })


def _received(stats, pool):
    return [s.bytes_received for p, _, s in stats if p == pool]


def test_rows_move_over_gloo(env) -> None:
    _, session, _ = env
    assert session.transport == "gloo"


@pytest.mark.parametrize("consumer,ranks", [("consumer2", 2), ("consumer3", 3)])
def test_reshard_4_to_n_keeps_order_values_and_moves_only_needed_bytes(env, consumer, ranks) -> None:
    lt, session, roles = env
    n, width = 22, 16

    async def main():
        before = await session.store_stats()
        src = await session.put({"idx": torch.arange(n)}, pool=P4)
        made = roles.producer.produce(src, width=width)
        meta = await made
        assert len({s.worker for s in meta.groups[0].segments}) == 4  # rows live on 4 producer ranks
        echoed = getattr(roles, consumer).echo(made)
        out = await echoed.fetch()
        after = await session.store_stats()
        return before, out, after

    before, out, after = lt.run(main())
    assert torch.equal(out["idx"], torch.arange(n))
    assert torch.equal(out["x"].double(), expected_x(torch.arange(n), width))
    # Each consumer rank pulled exactly its rows of the two columns it reads.
    pool = consumer.replace("consumer", "c")
    moved = [a - b for a, b in zip(_received(after, pool), _received(before, pool), strict=True)]
    rows = [r.stop - r.start for r in [range(*x[0]) for x in af.AllToAll().distribute(
        af.BatchMeta(num_rows=n), Layout(d=ranks), None)]]
    row_bytes = 8 + 4 * width  # idx int64 + x float32[width]
    assert moved == [k * row_bytes for k in rows]
    assert torch.equal(out["rank"], torch.repeat_interleave(torch.arange(ranks), torch.tensor(rows)))


def _fail_to_load() -> None:
    raise RuntimeError("this argument does not load on a worker")


class _Unloadable:
    """An argument that pickles on the driver and fails to unpickle on a worker
    (by reference to this module, which this module's workers cannot import; or
    where they can, by raising)."""

    def __reduce__(self):
        return (_fail_to_load, ())


def test_a_call_whose_arguments_do_not_load_leaves_no_send_waiting(env) -> None:
    """The consumer never ran, so never received the rows sent to it: it takes
    them afterwards, every producer's sends end, and the next pull works."""
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(12)}, pool=P4)
        made = roles.producer.produce(src, width=8)
        with pytest.raises(af.RemoteStageError, match=r"faulty\.boom failed on rank \d of pool 'c3'"):
            await roles.faulty.boom(made, on_rank=_Unloadable())
        deadline = time.monotonic() + 60
        while sum(await asyncio.gather(*(session.worker("p4", r).pending_sends.remote() for r in range(4)))):
            assert time.monotonic() < deadline, "a producer's send still waits for its receiver"
            await asyncio.sleep(0.1)
        return await roles.consumer3.echo(made).fetch()

    out = lt.run(main())
    assert torch.equal(out["idx"], torch.arange(12))


@pytest.mark.parametrize(("how", "raised"), [("exit", "SystemExit: 3"), ("interrupt", "KeyboardInterrupt")])
def test_a_method_that_exits_fails_its_call_and_the_rank_goes_on(env, how: str, raised: str) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(9)}, pool=P4)
        made = roles.producer.produce(src, width=4)
        with pytest.raises(af.RemoteStageError) as info:  # not a call left unanswered
            await asyncio.wait_for(roles.faulty.boom(made, on_rank=1, how=how), 120)
        return info.value, await asyncio.wait_for(roles.faulty.boom(made, on_rank=-1), 120)

    err, after = lt.run(main())
    assert (err.role, err.method, err.rank) == ("faulty", "boom", 1)
    assert raised in str(err), str(err)
    assert after.num_rows == 9  # the rank's compute thread lives on


def test_a_method_that_returns_no_rows_for_its_writes_fails_naming_them(env) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(9)}, pool=P4)
        with pytest.raises(af.RemoteStageError) as info:  # not a future of no rows
            await asyncio.wait_for(roles.faulty.boom(roles.producer.produce(src, width=4), on_rank=1, how="none"), 120)
        return info.value

    err = lt.run(main())
    assert (err.role, err.method, err.rank) == ("faulty", "boom", 1)
    assert "faulty.boom declares writes=['x'] but returned None, not rows; return a Batch" in str(err), str(err)


def test_token_balanced_split_keeps_groups_and_returns_rows_in_order(env) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(24)}, pool=P4)
        return await roles.consumer3.echo_balanced(roles.producer.produce(src, width=8)).fetch()

    out = lt.run(main())
    assert torch.equal(out["idx"], torch.arange(24))
    ranks = out["rank"].view(12, 2)
    assert torch.equal(ranks[:, 0], ranks[:, 1])  # pairs stay on one rank
    assert set(out["rank"].tolist()) == {0, 1, 2}


def test_metrics_merge_and_map(env) -> None:
    lt, session, roles = env

    @af.transform(reads=("x",), writes=("adv",))
    def centre(batch, *, scale):
        return {"adv": (batch["x"] - batch["x"].mean()) * scale}

    async def main():
        src = await session.put({"idx": torch.arange(10)}, pool=P4)
        made = roles.producer.produce(src, width=4)
        total = await roles.consumer2.total(made)
        extra = roles.consumer3.echo(made)
        with pytest.raises(af.ConfigError, match="comes from both"):
            af.merge(made, extra)  # both have their own idx and x: say which
        merged = af.merge(made, extra.rename(idx="idx3", x="x3"))  # columns of both, rows aligned
        adv = await roles.consumer2.needs_adv(merged.map(centre, scale=2.0)).fetch()
        return total, await merged.fetch(), adv

    total, merged, adv = lt.run(main())
    assert total["sum"] == pytest.approx(float(expected_x(torch.arange(10), 4).sum()) / 2)  # mean of 2 ranks
    assert set(merged) == {"idx", "x", "mask", "idx3", "x3", "rank"}
    assert torch.equal(merged["idx"], merged["idx3"])
    assert adv["adv"].shape == (10, 4)


def test_missing_field_fails_at_call_time_naming_it(env) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(4)}, pool=P4)
        made = roles.producer.produce(src, width=4)
        with pytest.raises(af.MissingFieldError, match="'adv'") as info:
            roles.consumer2.needs_adv(made)  # raises before anything runs
        return str(info.value)

    msg = lt.run(main())
    assert "consumer2.needs_adv" in msg and "producer.produce" in msg


def test_bad_arguments_fail_at_call_time(env) -> None:
    _, _, roles = env
    with pytest.raises(TypeError, match="width"):
        roles.producer.produce(None, widht=3)
    with pytest.raises(AttributeError, match="has no registered method"):
        roles.producer.nope()
    for rows in (torch.arange(3), {"idx": torch.arange(3)}):  # rows never go through the driver in a call
        with pytest.raises(CallArgumentError, match=rf"consumer3\.echo: batch is a data argument \(annotated "
                                                      rf"Batch\), so it takes a DataFuture .* not a {type(rows).__name__}"):
            roles.consumer3.echo(rows)


def test_roles_on_different_pools_overlap_and_on_one_pool_never(env) -> None:
    lt, _, roles = env

    async def main():
        a = roles.sleeper2.work(1.5)   # pool c2
        b = roles.sleeper3.work(1.5)   # pool c3: runs beside a
        c = roles.sleeper2b.work(0.5)  # pool c2 again: queued behind a
        return await af.gather(a, b, c)

    a, b, c = lt.run(main())
    a0, a1 = min(x["start"] for x in a), max(x["end"] for x in a)
    b0, b1 = min(x["start"] for x in b), max(x["end"] for x in b)
    c0 = min(x["start"] for x in c)
    assert max(a0, b0) < min(a1, b1), "different pools did not overlap"
    assert c0 >= a1, "two roles on one pool ran at the same time"
    assert {x["pid"] for x in a} == {x["pid"] for x in c}  # same processes host both roles


def test_role_mesh_groups_are_real_process_groups(env) -> None:
    lt, _, roles = env
    sums = lt.run(_await(roles.tp.dp_sum()))
    # Layout(t=2, d=2): dp groups are ranks {0, 2} and {1, 3}.
    assert sums == [4.0, 6.0, 4.0, 6.0]


async def _await(fut):
    return await fut


def test_raising_method_names_role_method_rank_and_cancels_dependents(env) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put({"idx": torch.arange(9)}, pool=P4)
        made = roles.producer.produce(src, width=4)
        bad = roles.faulty.boom(made, on_rank=1)
        dependent = roles.consumer2.total(bad)  # another pool, reads what boom writes
        with pytest.raises(af.RemoteStageError) as info:
            await bad
        with pytest.raises(af.RemoteStageError) as dep_info:
            await dependent
        after = await roles.consumer3.echo(made)  # the pool is still usable
        return info.value, dep_info.value, after

    err, dep_err, after = lt.run(main())
    assert (err.role, err.method, err.rank) == ("faulty", "boom", 1)
    assert "bad row block on rank 1" in str(err) and "ValueError" in err.remote_traceback
    assert dep_err is err
    assert after.num_rows == 9


def _stored_objects() -> list:
    """The cluster's objects but actor handles (a pending call's return counts 0 bytes)."""
    address = ray.get_runtime_context().gcs_address  # this test's cluster, whatever else runs here
    return [o for o in list_objects(address=address, limit=10_000, raise_on_missing_output=False)
            if o.reference_type != "ACTOR_HANDLE"]


def _bytes(objects: list) -> int:
    return sum(max(o.object_size or 0, 0) for o in objects)


def _settled_objects(lt, session, limit: list | None = None) -> list:
    """The objects once our frees went through (Ray frees a dropped ref's object
    a moment later). Waits at most 120 s for no more than ``limit``'s objects
    and bytes."""
    deadline = time.monotonic() + 120
    while True:
        gc.collect()
        lt.run(session.drain())
        now = _stored_objects()
        if limit is None or time.monotonic() > deadline or (
                len(now) <= len(limit) and _bytes(now) <= _bytes(limit)):
            return now
        time.sleep(0.5)


def test_200_iterations_leave_stores_empty_and_object_store_at_baseline(env) -> None:
    lt, session, roles = env

    async def iterate(k):
        for _ in range(k):
            src = await session.put({"idx": torch.arange(12)}, pool=P4)
            made = roles.producer.produce(src, width=64)
            await roles.consumer3.echo(made)
            del src, made

    lt.run(iterate(1))
    time.sleep(2)
    baseline = _settled_objects(lt, session)
    lt.run(iterate(200))  # each iteration stores 12 x 64 int64s: a leak would show
    settled = _settled_objects(lt, session, limit=baseline)
    shown = [(o.object_size, o.reference_type, o.type, o.task_status) for o in settled]
    assert len(settled) <= len(baseline), f"{len(settled)} objects, was {len(baseline)}: {shown}"
    assert _bytes(settled) <= _bytes(baseline), shown
    stats = lt.run(session.store_stats())
    assert [s.shards for _, _, s in stats] == [0] * len(stats)


def test_driver_rss_grows_less_than_a_tenth_of_a_256mb_payload(env) -> None:
    lt, session, roles = env
    width = 1024
    n = 256 * 2**20 // (4 * width)

    async def main():
        src = await session.put({"idx": torch.arange(n)}, pool=P4)
        made = roles.producer.produce(src, width=width)
        await made
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        total = await roles.consumer3.total(made)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        return total, grown

    total, grown_kb = lt.run(main())
    assert total["rows"] == pytest.approx(n / 3)
    assert grown_kb * 1024 < 0.10 * 256 * 2**20


@pytest.mark.slow
def test_1000_calls_between_two_pools_with_100_failing_leak_nothing(env) -> None:
    """Every store's shard count returns to zero and the driver's memory stays flat."""
    lt, session, roles = env

    async def iterate(k):
        src = await session.put({"idx": torch.arange(12)}, pool=P4)
        for i in range(k):
            made = roles.producer.produce(src, width=64)
            if i % 10 == 0:
                try:
                    await roles.faulty.boom(made, on_rank=i % 3)
                except af.RemoteStageError:
                    pass
                else:
                    raise AssertionError("boom did not fail")
            else:
                await roles.consumer3.echo(made)
            del made

    lt.run(iterate(50))  # warm up caches and Ray's bookkeeping
    gc.collect()
    rss = psutil.Process().memory_info().rss
    lt.run(iterate(1000), timeout=900)
    gc.collect()
    grown = psutil.Process().memory_info().rss - rss
    print(f"driver RSS growth over 1000 calls: {grown / 2**20:.1f} MB")
    stats = lt.run(session.store_stats())
    assert [s.shards for _, _, s in stats] == [0] * len(stats)
    assert grown < 20 * 2**20, f"driver RSS grew {grown / 2**20:.1f} MB"


def test_no_listener_of_the_session_serves_a_tcpstore_client(env) -> None:
    """Every TCP listener of the session's processes (this driver, Ray's daemons,
    the workers and the rendezvous store's actor) is on the loopback interface, and
    none answers as a TCPStore (the unauthenticated rendezvous of before); a real
    TCPStore, started after the listeners are listed, is probed alongside to show
    the probe would notice one."""
    lt, _, roles = env
    lt.run(_await(roles.tp.dp_sum()))  # every group is up
    me = psutil.Process()
    listeners = set()
    for proc in [me, *me.children(recursive=True)]:
        try:
            listeners |= tcp_listeners(proc.pid)
        except psutil.NoSuchProcess:
            continue
    assert listeners
    exposed = sorted(x for x in listeners if not ipaddress.ip_address(x[0]).is_loopback)
    assert exposed == [], f"listening beyond loopback: {exposed}"
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = ("127.0.0.1", store.port)
    assert control not in listeners
    served = probe_with_tcpstore_clients([*sorted(listeners), control], "127.0.0.1")
    assert served == [f"SERVED {control[0]} {control[1]}"], f"served a TCPStore client: {served}"
