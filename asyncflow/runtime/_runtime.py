"""What a session does once its workers exist, whatever the transport: submit and
cancel calls, hand rows in and out of the driver, account for shards.

:class:`~asyncflow.Session` wires it to Ray; ``asyncflow.runtime._local.LocalSession``
wires it to in-process workers for unit tests of the scheduler without Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from asyncflow.runtime._calls import bind_call, output_fields
from asyncflow.runtime._datastream import DataStream, StreamOptions, template, zip_into
from asyncflow.runtime._errors import SessionClosedError
from asyncflow.runtime._future import DataFuture
from asyncflow.runtime._lanes import Slot
from asyncflow.runtime._ledger import ShardLedger
from asyncflow.runtime._pool import ResourcePool, RoleSpec
from asyncflow.runtime._proxy import RoleGroup, Roles
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._scheduler import Scheduler
from asyncflow.runtime._tracer import Tracer, tracer_for
from asyncflow.runtime._transport import Transport, WorkerGone
from asyncflow.tracing import Trace
from channels import (
    AllToAll,
    Batch,
    BatchMeta,
    ConfigError,
    Layout,
    StoreStats,
    assemble,
    plan_pull,
    split_rows,
)
from workers import Endpoint


class Runtime:
    """Calls, rows and shards of a session (see the module docstring)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: Scheduler | None = None
        self._ledger: ShardLedger | None = None
        self._transport: Transport | None = None
        self._roles: Roles | None = None
        self._closed = False
        self._puts = 0
        self._tracer: Tracer | None = None

    def _start(self, transport: Transport, pools: Mapping[str, list[int]], roles: Mapping[str, RoleSpec],
               layouts: Mapping[str, Layout], rank_local: Mapping[str, frozenset[str]] | None = None) -> Roles:
        """Start the call loops over ``transport`` and return the role proxies.

        ``rank_local``: per role, the methods that use no other rank (``Role.rank_local``)."""
        self._loop = asyncio.get_running_loop()
        self._transport = transport
        self._ledger = ShardLedger(transport.free)
        self._ledger.attach(self._loop)
        self._scheduler = Scheduler(transport, self._ledger)
        for name, workers in pools.items():
            self._scheduler.add_pool(name, workers)
        self._scheduler.start()
        local = rank_local or {}
        self._tracer = tracer_for(pools, roles)
        self._roles = Roles({n: RoleGroup(self._submit, n, s, layouts[n], local.get(n, frozenset()))
                             for n, s in roles.items()})
        return self._roles

    async def _stop(self) -> tuple[bool, bool]:
        """Settle every call and finish pending frees; returns whether a pool broke
        and whether a call was still running on workers."""
        broken = running = False
        if self._scheduler is not None:
            running = await self._scheduler.close()
            broken = any(p.broken is not None for p in self._scheduler.pools.values())
        if self._ledger is not None:
            try:  # let released shards' frees finish while the workers are still there
                await asyncio.wait_for(self._ledger.drain(), timeout=10)
            except TimeoutError:
                pass
            self._ledger.close()
        return broken, running

    @property
    def roles(self) -> Roles:
        """The spawned roles."""
        if self._roles is None:
            raise ConfigError("no roles yet: call `await session.spawn({...})` first")
        return self._roles

    @property
    def serial(self) -> bool:
        """Run one call at a time across every pool, in submission order, as if the
        driver awaited each call before making the next (no overlap at all): the
        baseline of the overlap benchmarks and of the planner's profiles, and a
        way to rule out concurrency when debugging. Off by default."""
        return self._scheduler is not None and self._scheduler.serial

    @serial.setter
    def serial(self, on: bool) -> None:
        if self._scheduler is None:
            raise ConfigError("no roles yet: call `await session.spawn({...})` first")
        self._scheduler.serial = bool(on)
        for pool in self._scheduler.pools.values():
            pool.wake.set()

    # ----- tracing -----

    async def start_trace(self) -> None:
        """Record every call submitted from now on, with one span per rank and
        per pull (see ``asyncflow.tracing``); :meth:`stop_trace` returns the trace.

        Aligns the workers' clocks with the driver's first (a few pings each).
        """
        if self._scheduler is None or self._tracer is None or self._transport is None:
            raise ConfigError("no roles yet: call `await session.spawn({...})` before tracing")
        await self._tracer.start(self._transport.clock)
        self._scheduler.tracer = self._tracer

    def mark_step(self) -> None:
        """The algorithm starts a new step: later calls count in it (and the
        timeline marks it). Does nothing while not tracing."""
        if self._tracer is not None and self._tracer.recording:
            self._tracer.mark_step()

    def stop_trace(self) -> Trace:
        """Stop recording; returns the calls that ended while recording.

        Raises:
            ConfigError: no trace was started.
        """
        if self._scheduler is None or self._tracer is None or not self._tracer.recording:
            raise ConfigError("no trace is recording: call `await session.start_trace()` first")
        self._scheduler.tracer = None
        return self._tracer.stop()

    # ----- calls -----

    def _submit(self, group: RoleGroup, endpoint: Endpoint[Any, Any], args: tuple[Any, ...],
                kwargs: Mapping[str, Any], *, slot: Slot | None = None) -> Any:
        if self._closed or self._scheduler is None or self._loop is None:
            raise SessionClosedError("the session is closed")
        kwargs = dict(kwargs)
        options = _stream_options(group, endpoint, kwargs)
        timeout_s = _timeout_option(group, endpoint, kwargs, streamed=options is not None)
        for value in (*args, *kwargs.values()):
            if isinstance(value, DataFuture | DataStream) and value._owner is not self:
                raise ConfigError(f"{group.name}: {value.label} belongs to another session")
        streams = [v for v in (*args, *kwargs.values()) if isinstance(v, DataStream)]
        if streams:
            if timeout_s is not None:
                raise ConfigError(f"{group.name}.{endpoint.spec.name}: timeout_s applies to a call on futures, "
                                  "not to calls on a stream")
            if options is not None:
                raise ConfigError(f"{group.name}.{endpoint.spec.name}: a streamed call takes futures, not "
                                  "streams; collect() the stream first")
            return self._submit_on_streams(group, endpoint, args, kwargs, streams)
        call = bind_call(role=group.name, config=group.config, endpoint=endpoint, layout=group.layout,
                         args=args, kwargs=kwargs, loop=self._loop,
                         rank_local=endpoint.spec.name in group.rank_local)
        call.timeout_s = timeout_s
        if options is not None:
            call.stream = options
            out: DataStream[Any] = DataStream(label=call.label, fields=output_fields(call), owner=self,
                                              spawn=self._spawn)
            call.stream_out = out
            out._report = call.result
            self._scheduler.submit(call, group.pool.name)
            return out
        self._scheduler.submit(call, group.pool.name, slot=slot)
        return DataFuture(label=call.label, fields=output_fields(call), owner=self, source=call.result,
                          call_id=call.call_id)

    def _submit_on_streams(self, group: RoleGroup, endpoint: Endpoint[Any, Any], args: tuple[Any, ...],
                           kwargs: Mapping[str, Any], streams: list[DataStream[Any]]) -> DataStream[Any]:
        """One call per micro-batch of ``streams`` (zipped), as their futures arrive."""
        assert self._loop is not None
        position = {id(s): i for i, s in enumerate(streams)}

        def substitute(futs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
            def one(v: Any) -> Any:
                return futs[position[id(v)]] if isinstance(v, DataStream) else v
            return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

        # Checked now, against the streams' fields, so a missing field fails at call time.
        probe_args, probe_kwargs = substitute([template(s) for s in streams])
        probe = bind_call(role=group.name, config=group.config, endpoint=endpoint, layout=group.layout,
                          args=probe_args, kwargs=probe_kwargs, loop=self._loop)
        label = f"{group.name}.{endpoint.spec.name}({', '.join(s.label for s in streams)})"
        out: DataStream[Any] = DataStream(label=label, fields=output_fields(probe), owner=self,
                                          spawn=self._spawn)
        assert self._scheduler is not None
        scheduler, pool = self._scheduler, group.pool.name
        # The per-micro-batch calls take this call's place in the pool's queue.
        slot = scheduler.open_slot(pool, group.name, rank_local=endpoint.spec.name in group.rank_local)

        def each(futs: Any) -> DataFuture[Any]:
            a, kw = substitute(futs)
            fut: DataFuture[Any] = self._submit(group, endpoint, a, kw, slot=slot)
            return fut

        async def feed() -> None:
            try:
                await zip_into(out, streams, each)
            finally:
                scheduler.close_slot(pool, slot)
        self._spawn(feed(), f"asyncflow-{label}")
        return out

    def _spawn(self, coro: Any, name: str) -> Any:
        if self._scheduler is None:
            coro.close()
            raise SessionClosedError("the session is closed")
        return self._scheduler.spawn(coro, name)

    def cancel(self, fut: DataFuture[Any]) -> bool:
        """Cancel ``fut`` and the calls depending on it (``DataFuture.cancel``)."""
        return self._scheduler.cancel(fut) if self._scheduler is not None else False

    # ----- rows in and out of the driver -----

    async def put(self, columns: Mapping[str, Any], *, pool: ResourcePool | str | None = None,
                  group_size: int | None = None) -> DataFuture[BatchMeta]:
        """Hand rows from the driver to a pool (split evenly over its ranks, groups
        kept whole) and return their future; e.g. a data set's prompts.

        Args:
            columns: a :class:`Batch` or a mapping of columns.
            pool: the pool (default: the first).
            group_size: consecutive rows that belong together (default: the
                Batch's own, or 1).

        Raises:
            ConfigError: unknown pool, or no roles spawned yet.
        """
        if self._scheduler is None or self._transport is None or self._ledger is None or self._loop is None:
            raise ConfigError("spawn roles before putting rows")
        batch = Batch(columns, group_size=group_size or int(getattr(columns, "group_size", 1)))
        name = next(iter(self._scheduler.pools)) if pool is None else getattr(pool, "name", pool)
        if name not in self._scheduler.pools:
            raise ConfigError(f"no pool {name!r}; pools are {sorted(self._scheduler.pools)}")
        workers = self._scheduler.pools[name].workers
        self._puts += 1
        key = f"put#{self._puts}"
        assignments = split_rows(batch.num_rows, len(workers), group_size=batch.group_size)
        try:
            results = await asyncio.gather(*(
                self._transport.put(w, key, (batch.slice(*runs[0]) if runs else batch.slice(0, 0)).to_dict(),
                                    batch.group_size)
                for w, runs in zip(workers, assignments, strict=True)))
        except WorkerGone as e:
            raise self._scheduler.completion.driver_io_died(e, "Session.put") from None
        out = AllToAll().collect(results, Layout(d=len(workers)), assignments)
        kept = out.meta.shard_keys()
        self._ledger.release_now({(r.worker, r.key) for r in results} - kept)
        leases = tuple(self._ledger.lease(w, k) for w, k in sorted(kept))
        done = self._loop.create_future()
        done.set_result(Resolved(meta=out.meta, row_lengths=None, leases=leases))
        return DataFuture(label=key, fields=frozenset(batch), owner=self, source=done)

    async def fetch_rows(self, meta: BatchMeta) -> Batch:
        """The rows of ``meta``, pulled to the driver."""
        assert self._transport is not None
        plan = plan_pull(meta, ((0, meta.num_rows),) if meta.num_rows else ())
        try:
            return assemble(plan, await self._transport.fetch(plan.pieces))
        except WorkerGone as e:
            assert self._scheduler is not None
            raise self._scheduler.completion.driver_io_died(e, "fetch_rows") from None

    # ----- shard lifetime -----

    async def drain(self) -> None:
        """Wait until every shard released so far is freed on its worker (calls
        that already returned finish their bookkeeping first, which may release more)."""
        await asyncio.sleep(0)
        if self._ledger is not None:
            await self._ledger.drain()

    async def store_stats(self) -> list[tuple[str, int, StoreStats]]:
        """``(pool, rank, stats)`` of every worker's shard store, after pending
        frees went through."""
        await self.drain()
        assert self._scheduler is not None and self._transport is not None
        out: list[tuple[str, int, StoreStats]] = []
        for pool in self._scheduler.pools.values():
            stats = await asyncio.gather(*(self._transport.stats(w) for w in pool.workers))
            out.extend((pool.name, rank, s) for rank, s in enumerate(stats))
        return out


def _timeout_option(group: RoleGroup, endpoint: Endpoint[Any, Any], kwargs: dict[str, Any], *,
                    streamed: bool) -> float | None:
    """Pop the driver-side ``timeout_s`` argument of a call (unless the method itself
    takes one): seconds the call may run once started, else it fails with
    :class:`CallTimeoutError` and breaks its pool."""
    if "timeout_s" in endpoint.spec.signature.parameters or "timeout_s" not in kwargs:
        return None
    value = kwargs.pop("timeout_s")
    where = f"{group.name}.{endpoint.spec.name}"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{where}: timeout_s must be a number of seconds > 0 or None, got {value!r}")
    if streamed:
        raise ConfigError(f"{where}: timeout_s applies to calls that return a future, not to streamed calls")
    return float(value)


def _stream_options(group: RoleGroup, endpoint: Endpoint[Any, Any], kwargs: dict[str, Any]) -> StreamOptions | None:
    """Pop the driver-side ``stream`` argument of a call (unless the method itself
    takes one) and check that the method can stream."""
    if "stream" in endpoint.spec.signature.parameters or "stream" not in kwargs:
        return None
    value = kwargs.pop("stream")
    if value is None or value is False:
        return None
    if not endpoint.spec.streams:
        raise ConfigError(f"{group.name}.{endpoint.spec.name} cannot stream: only generator methods "
                          "(that yield Chunk and Step) can; call it without stream=")
    if value is True:
        return StreamOptions()
    if not isinstance(value, StreamOptions):
        raise ConfigError(f"stream must be True, False or a StreamOptions, got {value!r}")
    return value
