"""Running group calls: one dispatcher per pool, and what happens when something fails.

Every call to a role on a pool joins that pool's queue. A call runs on every rank
of the pool, in call order: once its inputs' metadata exist, the driver plans which
rows each rank pulls from which producer, submits the call to every rank and
collects. Pools have separate dispatchers, so calls on different pools overlap
while calls on one pool time-share it.

Ranks are lanes. A *rank-local* call (a method that uses no other rank,
``Role.rank_local``) may run on whichever ranks are free, its rows split over
them, and may pass queued calls of other roles; a streamed call gives each rank
back as soon as that rank is done (e.g. after handing its long tail to another
rank). So inference placed on the actor's pool runs on the ranks generation freed
while the tail finishes.

Failures are decided from facts, never from how long a rank takes:

- A rank whose method raises fails the call at once. It has poisoned its pool's
  groups on the way out, and the driver poisons every other rank as it finishes,
  so ranks blocked in a collective with it fail within moments too (their errors
  are *peer failures*, reported only when nothing better is known). Before the
  pool's next call that uses every rank, the ranks heal their groups.
- A worker process's death is known from Ray (a call to it, or its ``watch``
  sentinel, fails with an actor-death error). Its pool is broken: its running and
  queued calls fail with :class:`WorkerDiedError`, later ones with
  :class:`PoolBrokenError`, all naming the call the process was serving (none
  when it died between calls; see ``_completion``). A producer that dies while a
  consumer pulls from it is reported as the producer's death; the consumer's pool
  heals and goes on.

Every call settles: with its result, its error, a dependency's error, cancelled
(:meth:`Scheduler.cancel`), or :class:`SessionClosedError` at close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from asyncflow.runtime._calls import Call, pull_fields
from asyncflow.runtime._completion import CallCompletion
from asyncflow.runtime._errors import (
    CallTimeoutError,
    PoolBrokenError,
    SessionClosedError,
    WorkerDiedError,
)
from asyncflow.runtime._failures import settle
from asyncflow.runtime._future import DataFuture
from asyncflow.runtime._lanes import PoolState, Slot
from asyncflow.runtime._ledger import ShardLedger
from asyncflow.runtime._observed import Observed
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._streamcall import StreamedCall
from asyncflow.runtime._tracer import Tracer
from asyncflow.runtime._transport import Transport, WorkerGone
from channels import Layout, MissingFieldError, Piece, RankResult, plan_pull
from workers import CallSpec, DataArg, StreamSpec

logger = logging.getLogger(__name__)


class Scheduler:
    """The pools' dispatchers over a :class:`Transport`.

    Args:
        transport: how calls reach the workers.
        ledger: frees shards no future names.
    """

    def __init__(self, transport: Transport, ledger: ShardLedger) -> None:
        self.transport = transport
        self.ledger = ledger
        self.pools: dict[str, PoolState] = {}
        self._where: dict[int, tuple[PoolState, int]] = {}
        self.completion = CallCompletion(transport, ledger, self._where)
        """Waits for the ranks of each call it starts and settles the call."""
        self._tasks: list[asyncio.Task[None]] = []
        self._jobs: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.observed = Observed()
        self._places = 0
        self.serial = False
        """Run one call at a time across every pool, in submission order
        (``Runtime.serial``)."""

    @property
    def tracer(self) -> Tracer | None:
        """Set while a trace is recording (``Runtime.start_trace``)."""
        return self.completion.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self.completion.tracer = tracer

    # ----- set-up -----

    def add_pool(self, name: str, workers: Sequence[int]) -> None:
        """Register a pool whose ranks are ``workers`` (session-wide indices)."""
        died: asyncio.Future[WorkerDiedError | CallTimeoutError] = asyncio.get_running_loop().create_future()
        pool = PoolState(name=name, workers=list(workers), died=died,
                         holders={r: [] for r in range(len(workers))})
        self.pools[name] = pool
        for rank, w in enumerate(workers):
            self._where[w] = (pool, rank)

    def start(self) -> None:
        """Start every pool's dispatcher and every worker's death watch."""
        self._loop = asyncio.get_running_loop()
        for pool in self.pools.values():
            self._tasks.append(asyncio.create_task(self._pool_loop(pool), name=f"asyncflow-pool-{pool.name}"))
        for w in self._where:
            self._tasks.append(asyncio.create_task(self.completion.watch(w), name=f"asyncflow-watch-{w}"))

    def spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` as a task the scheduler owns (cancelled at close). Callable
        from any thread (proxies may be called off the session's loop)."""
        def now() -> None:
            if self._closed:
                coro.close()
                return
            self.task(coro, name)
        self._on_loop(now)

    def task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Like :meth:`spawn`, on the session's loop only; returns the task."""
        task = self._loop.create_task(coro, name=name)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the session's loop: now when called there, else soon."""
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    # ----- submitting, cancelling, closing -----

    def submit(self, call: Call, pool: str, *, slot: Slot | None = None) -> None:
        """Queue ``call`` on ``pool`` (at ``slot``'s place when given: see ``_lanes``).

        Raises:
            SessionClosedError: the session is closed.
        """
        if self._closed:
            raise SessionClosedError(f"{call.label}: the session is closed")
        state = self.pools[pool]

        def queue() -> None:
            self._places += 1
            if slot is not None and slot in state.pending:
                state.pending.insert(state.pending.index(slot), call)
                call.place = (slot.place, self._places)
            else:
                state.pending.append(call)
                call.place = (self._places, 0)
            if self.tracer is not None:
                self.tracer.submitted(call)
            self.spawn(self._resolve_inputs(state, call), f"asyncflow-inputs-{call.label}")
        self._on_loop(queue)

    def open_slot(self, pool: str, role: str, *, rank_local: bool) -> Slot:
        """Reserve the place in ``pool``'s queue of the calls a stream will make."""
        slot = Slot(role=role, rank_local=rank_local)

        def reserve() -> None:
            self._places += 1
            slot.place = self._places
            self.pools[pool].pending.append(slot)
        self._on_loop(reserve)
        return slot

    def close_slot(self, pool: str, slot: Slot) -> None:
        """The stream made its last call: its slot stops holding later calls back."""
        def close() -> None:
            slot.closed = True
            state = self.pools[pool]
            if slot in state.pending:
                state.pending.remove(slot)
            state.wake.set()
        self._on_loop(close)

    async def _resolve_inputs(self, pool: PoolState, call: Call) -> None:
        try:
            inputs = {name: await fut._resolve() for name, fut in call.data_args.items()}
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the session is closing
            call.result.cancel()  # an input was cancelled: so is this call
        except Exception as e:  # an input failed: this call fails with the same error
            settle(call, e)
        else:
            call.inputs = inputs
        finally:
            pool.wake.set()

    def cancel(self, fut: DataFuture[Any]) -> bool:
        """Cancel ``fut`` and every queued or running call that depends on it.

        Calls not started never run; a running one finishes and its rows are freed.
        """
        doomed_calls: set[int] = set()
        if fut._call_id is None:
            fut._mark_cancelled()  # a derived future: only the calls consuming it go
        else:
            doomed_calls.add(fut._call_id)
        doomed_futs = {id(fut)}
        for call in sorted(self._live(), key=lambda c: c.call_id):  # a call depends on earlier ones only
            if call.call_id in doomed_calls or call.depends_on(doomed_futs, doomed_calls):
                doomed_calls.add(call.call_id)
                call.result.cancel()
        for pool in self.pools.values():
            self._on_loop(pool.wake.set)
        return True

    def _live(self) -> Iterable[Call]:
        for pool in self.pools.values():
            yield from pool.calls()
            yield from pool.running.values()

    async def close(self) -> bool:
        """Stop the dispatchers; every call not finished fails with :class:`SessionClosedError`.
        Returns whether a call was still running on workers (False when closed already)."""
        if self._closed:
            return False
        self._closed = self.completion.closed = True
        running = any(pool.running for pool in self.pools.values())
        unsettled = list(self._live())
        tasks = [*self._tasks, *self._jobs]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for call in unsettled:
            if not call.result.done():
                call.result.set_exception(SessionClosedError(f"{call.label} did not finish: the session was closed"))
            self._end_stream(call)
        for pool in self.pools.values():
            pool.pending.clear()
            pool.running.clear()
        return running

    # ----- the dispatcher -----

    async def _pool_loop(self, pool: PoolState) -> None:
        while True:
            await pool.wake.wait()
            pool.wake.clear()
            self._dispatch(pool)

    def _dispatch(self, pool: PoolState) -> None:
        """Start every call that can start now (see the module docstring)."""
        earlier = False  # an earlier call is still waiting
        gang_ahead = False  # an earlier call that needs every rank is waiting
        blocked_roles: set[str] = set()
        held_by_gang = any(not c.rank_local for c in pool.running.values())
        turn = self._serial_turn() if self.serial else None
        for call in list(pool.pending):
            if isinstance(call, Slot):
                # Calls a stream will make: later whole-pool calls and later calls of
                # the slot's role wait for them. Rank-local calls of other roles may
                # pass: nothing of the slot's waits yet, so nothing starves.
                earlier = True
                blocked_roles.add(call.role)
                continue
            if call.result.done():  # cancelled, or failed by a death or an input
                pool.pending.remove(call)
                self._end_stream(call)
                continue
            if pool.broken is not None:
                pool.pending.remove(call)
                self._refuse(pool, call)
                continue
            startable = call.inputs is not None and not pool.healing and (not self.serial or call.call_id == turn)
            if not call.rank_local:
                if startable and not earlier and not pool.running:
                    if pool.needs_heal:
                        self._start_heal(pool)
                        return
                    self._start(pool, call, pool.free)
                    continue
                earlier = gang_ahead = True
                blocked_roles.add(call.role)
                continue
            lanes = pool.free or pool.stackable()
            # Lanes go to rank-local calls past a waiting whole-pool call only while a
            # whole-pool call holds ranks anyway (else the waiting one would starve).
            if startable and lanes and call.role not in blocked_roles and (not gang_ahead or held_by_gang):
                self._start(pool, call, lanes)
                continue
            earlier = True
            blocked_roles.add(call.role)

    def _serial_turn(self) -> int | None:
        """In serial mode, the one call that may start: the first waiting call of
        any pool in queue order (``Call.place``), once no call runs anywhere (None:
        none may; an open stream slot first in line holds every later call, and the
        calls made on it sit before it)."""
        if any(p.running for p in self.pools.values()):
            return None
        first: tuple[int, int] | None = None
        turn: int | None = None
        for pool in self.pools.values():
            for c in pool.pending:
                if isinstance(c, Slot):
                    place, who = (c.place, 1 << 62), None
                elif c.result.done():
                    continue
                else:
                    place, who = c.place, c.call_id
                if first is None or place < first:
                    first, turn = place, who
        return turn

    def _refuse(self, pool: PoolState, call: Call) -> None:
        broken = pool.broken
        assert broken is not None
        during = f" during {broken.role}.{broken.method}" if broken.role else ""
        settle(call, PoolBrokenError(
            f"{call.label} was not run: pool {pool.name!r} lost rank {broken.rank} ({broken.cause}{during})",
            pool=pool.name, cause=broken))
        self._end_stream(call)

    def _start(self, pool: PoolState, call: Call, lanes: list[int]) -> None:
        logger.debug("%.3f start %s on %s lanes %s", time.monotonic(), call.label, pool.name, lanes)
        pool.pending.remove(call)
        pool.running[call.call_id] = call
        if self.tracer is not None:
            self.tracer.started(call, pool.name)
        for r in lanes:
            pool.holders[r].append(call.call_id)
        self.spawn(self._run(pool, call, lanes), f"asyncflow-call-{call.label}")

    def _start_heal(self, pool: PoolState) -> None:
        pool.healing = True  # no call starts until the groups are back

        async def heal() -> None:
            try:
                await self._heal(pool)
            finally:
                pool.healing = pool.needs_heal = False
                pool.wake.set()
        self.spawn(heal(), f"asyncflow-heal-{pool.name}")

    def _end_stream(self, call: Call) -> None:
        if call.stream_out is not None and call.result.done():
            call.stream_out._finish(asyncio.CancelledError() if call.result.cancelled()
                                    else call.result.exception())

    # ----- running one call -----

    async def execute(self, worker: int, spec: bytes, kwargs: Any, transforms: Any,
                      pieces: Sequence[Piece]) -> RankResult:
        """One rank's part of a call, taking along the frees waiting for ``worker``;
        if the part fails or is cancelled, they are released again (a free of a key
        already gone is a no-op), so no shard is left behind."""
        free = self.ledger.take(worker)
        try:
            return await self.transport.execute(worker, spec, kwargs, transforms, pieces, free=free)
        except BaseException:
            self.ledger.release_now((worker, key) for key in free)
            raise

    async def _run(self, pool: PoolState, call: Call, lanes: list[int]) -> None:
        held = set(lanes)

        def release(rank: int) -> None:
            if rank in held:
                held.discard(rank)
                pool.holders[rank].remove(call.call_id)
                pool.wake.set()
        try:
            if call.result.done():
                return
            layout = call.layout if not call.rank_local else Layout(d=len(lanes))
            workers = [pool.workers[r] for r in lanes]
            run = None
            if call.stream is not None:
                run = StreamedCall(self, pool, call, lanes, workers)
            try:
                specs, assignment = self._plan(call, layout, workers, run.threshold() if run else 0)
            except Exception as e:
                settle(call, e)
                return
            transforms = {n: [(t.fn, t.kwargs) for t in r.transforms]
                          for n, r in (call.inputs or {}).items() if r.transforms}
            if run is not None:
                tasks = await run.start(specs, transforms)
                await self.completion.await_ranks(pool, call, tasks, assignment, lanes, release, run)
                await run.finish()
                return
            started = time.monotonic()
            tasks = [asyncio.ensure_future(self.execute(w, spec, call.kwargs, transforms, pieces))
                     for w, (spec, pieces) in zip(workers, specs, strict=True)]
            await self.completion.await_ranks(pool, call, tasks, assignment, lanes, None, None)
            if call.rank_local:
                self.observed.record_call(pool.name, call, len(lanes), time.monotonic() - started)
        finally:
            logger.debug("%.3f end %s", time.monotonic(), call.label)
            if self.tracer is not None:
                self.tracer.ended(call)
            pool.running.pop(call.call_id, None)
            call.inputs = None  # drop the inputs' leases as soon as the call is over
            for rank in list(held):
                release(rank)
            self._end_stream(call)
            for other in self.pools.values() if self.serial else (pool,):
                other.wake.set()

    def _plan(self, call: Call, layout: Layout, workers: Sequence[int], progress_below: int = 0
              ) -> tuple[list[tuple[bytes, list[Piece]]], Any]:
        inputs = call.inputs or {}
        for name, r in inputs.items():
            if not isinstance(r, Resolved):
                raise MissingFieldError(f"{call.label}: argument {name!r} ({call.data_args[name].label}) "
                                        "is a value, not rows")
        protocol = call.endpoint.spec.protocol
        pulls = {name: pull_fields(call, name, r) for name, r in inputs.items()}
        assignments = {name: protocol.distribute(r.meta, layout, r.row_lengths) for name, r in inputs.items()}
        stream = None if call.stream is None else StreamSpec(micro_batch=call.stream.micro_batch,
                                                             progress_below=progress_below)
        traced = self.tracer is not None and self.tracer.records(call)
        specs = []
        for rank in range(len(workers)):
            data_args: list[DataArg] = []
            pieces: list[Piece] = []
            for name, r in inputs.items():
                runs = assignments[name][rank]
                plan = None if runs is None else plan_pull(r.meta, runs, pulls[name])
                data_args.append(DataArg(name=name, plan=plan))
                pieces.extend(plan.pieces if plan is not None else ())
            cs = CallSpec(call_id=call.call_id, role=call.role, method=call.method, out_key=call.out_key,
                          data_args=tuple(data_args), stream=stream, trace=traced)
            specs.append((msgspec.msgpack.encode(cs), pieces))
        return specs, next(iter(assignments.values()), None)

    async def _heal(self, pool: PoolState) -> None:
        pool.epoch += 1
        results = await asyncio.gather(*(self.transport.heal(w, pool.epoch) for w in pool.workers),
                                       return_exceptions=True)
        for w, r in zip(pool.workers, results, strict=True):
            if isinstance(r, WorkerGone):
                self.completion.worker_died(r.worker, r.detail)
            elif isinstance(r, BaseException):
                self.completion.worker_died(w, f"reconnecting its process groups failed: {r}")
