"""Running group calls: one loop per pool, and what happens when something fails.

Every call to a role on a pool goes into that pool's channel; the pool's loop runs
the calls one at a time in call order: wait for the inputs' metadata, plan which
rows each rank pulls from which producer, submit the call to every rank, collect.
Pools have separate loops, so calls on different pools overlap while calls on one
pool time-share it.

Failures are decided from facts, never from how long a rank takes:

- A rank whose method raises fails the call at once. It has poisoned its pool's
  groups on the way out, and the driver poisons every other rank as it finishes,
  so ranks blocked in a collective with it fail within moments too (their errors
  are *peer failures*, reported only when nothing better is known). Once every
  rank returned, the ranks heal their groups and the pool takes the next call.
- A worker process's death is known from Ray (a call to it, or its ``watch``
  sentinel, fails with an actor-death error). Its pool is broken: its running and
  queued calls fail with :class:`WorkerDiedError`, later ones with
  :class:`PoolBrokenError`. A producer that dies while a consumer pulls from it is
  reported as the producer's death; the consumer's pool heals and goes on.

Every call settles: with its result, its error, a dependency's error, cancelled
(:meth:`Scheduler.cancel`), or :class:`SessionClosedError` at close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from asyncflow._calls import Call, pull_fields
from asyncflow._errors import PoolBrokenError, SessionClosedError, WorkerDiedError
from asyncflow._failures import peer_error, primary_error, producer_of, settle
from asyncflow._future import DataFuture, Resolved
from asyncflow._ledger import ShardLedger
from asyncflow._transport import Transport, WorkerGone
from channels import (
    Collected,
    MissingFieldError,
    Piece,
    RankResult,
    ReceiveChannel,
    SendChannel,
    open_channel,
    plan_pull,
)
from workers import CallSpec, DataArg

logger = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class PoolState:
    """A pool's workers, its call channel and whether it can still take calls."""

    name: str
    workers: list[int]
    """Session-wide worker index of each rank."""
    send: SendChannel[Call]
    receive: ReceiveChannel[Call]
    died: asyncio.Future[WorkerDiedError]
    """Resolved when one of the pool's worker processes died."""
    epoch: int = 0
    """How many times the pool's groups were healed."""
    running: Call | None = None
    queued: dict[int, Call] = field(default_factory=dict)

    @property
    def broken(self) -> WorkerDiedError | None:
        """The death that broke the pool, if any."""
        return self.died.result() if self.died.done() else None


@dataclass(eq=False)
class _Ranks:
    """What the ranks of one running call reported so far."""

    results: dict[int, RankResult] = field(default_factory=dict)
    failures: dict[int, BaseException] = field(default_factory=dict)
    poisoned: set[int] = field(default_factory=set)


class Scheduler:
    """The pools' call loops over a :class:`Transport`.

    Args:
        transport: how calls reach the workers.
        ledger: frees shards no future names.
    """

    def __init__(self, transport: Transport, ledger: ShardLedger) -> None:
        self.transport = transport
        self.ledger = ledger
        self.pools: dict[str, PoolState] = {}
        self._where: dict[int, tuple[PoolState, int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ----- set-up -----

    def add_pool(self, name: str, workers: Sequence[int]) -> None:
        """Register a pool whose ranks are ``workers`` (session-wide indices)."""
        send, receive = open_channel[Call](float("inf"))
        died: asyncio.Future[WorkerDiedError] = asyncio.get_running_loop().create_future()
        pool = PoolState(name=name, workers=list(workers), send=send, receive=receive, died=died)
        self.pools[name] = pool
        for rank, w in enumerate(workers):
            self._where[w] = (pool, rank)

    def start(self) -> None:
        """Start every pool's loop and every worker's death watch."""
        for pool in self.pools.values():
            self._tasks.append(asyncio.create_task(self._pool_loop(pool), name=f"asyncflow-pool-{pool.name}"))
        for w in self._where:
            self._tasks.append(asyncio.create_task(self._watch(w), name=f"asyncflow-watch-{w}"))

    # ----- submitting, cancelling, closing -----

    def submit(self, call: Call, pool: str) -> None:
        """Queue ``call`` on ``pool``.

        Raises:
            SessionClosedError: the session is closed.
        """
        if self._closed:
            raise SessionClosedError(f"{call.label}: the session is closed")
        state = self.pools[pool]
        state.queued[call.call_id] = call
        state.send.send_nowait(call)

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
        return True

    def _live(self) -> Iterable[Call]:
        for pool in self.pools.values():
            yield from pool.queued.values()
            if pool.running is not None:
                yield pool.running

    async def close(self) -> None:
        """Stop the loops; every call not finished fails with :class:`SessionClosedError`."""
        if self._closed:
            return
        self._closed = True
        unsettled = list(self._live())
        for pool in self.pools.values():
            pool.send.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for call in unsettled:
            if not call.result.done():
                call.result.set_exception(SessionClosedError(f"{call.label} did not finish: the session was closed"))
        for pool in self.pools.values():
            pool.queued.clear()

    # ----- the pool loop -----

    async def _pool_loop(self, pool: PoolState) -> None:
        async with pool.receive:
            async for call in pool.receive:
                try:
                    await self._serve(pool, call)
                finally:
                    del call  # drop the inputs' leases as soon as the call is over

    async def _serve(self, pool: PoolState, call: Call) -> None:
        if call.result.done():  # cancelled, or failed by a death while queued
            pool.queued.pop(call.call_id, None)
            return
        broken = pool.broken
        if broken is not None:
            pool.queued.pop(call.call_id, None)
            during = f" during {broken.role}.{broken.method}" if broken.role else ""
            call.result.set_exception(PoolBrokenError(
                f"{call.label} was not run: pool {pool.name!r} lost rank {broken.rank} ({broken.cause}{during})",
                pool=pool.name, cause=broken))
            return
        pool.running = pool.queued.pop(call.call_id, call)
        try:
            await self._run(pool, call)
        finally:
            pool.running = None

    async def _run(self, pool: PoolState, call: Call) -> None:
        try:
            inputs = {name: await fut._resolve() for name, fut in call.data_args.items()}
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the session is closing
            call.result.cancel()  # an input was cancelled: so is this call
            return
        except Exception as e:  # an input failed: this call fails with the same error
            settle(call, e)
            return
        if call.result.done():
            return
        try:
            specs, assignment = self._plan(pool, call, inputs)
        except Exception as e:
            settle(call, e)
            return
        transforms = {n: [(t.fn, t.kwargs) for t in r.transforms] for n, r in inputs.items() if r.transforms}
        tasks = [asyncio.ensure_future(self.transport.execute(w, spec, call.kwargs, transforms, pieces))
                 for w, (spec, pieces) in zip(pool.workers, specs, strict=True)]
        await self._await_ranks(pool, call, tasks, assignment)

    def _plan(self, pool: PoolState, call: Call, inputs: Mapping[str, Any]
              ) -> tuple[list[tuple[bytes, list[Piece]]], Any]:
        for name, r in inputs.items():
            if not isinstance(r, Resolved):
                raise MissingFieldError(f"{call.label}: argument {name!r} ({call.data_args[name].label}) "
                                        "is a value, not rows")
        protocol = call.endpoint.spec.protocol
        pulls = {name: pull_fields(call, name, r) for name, r in inputs.items()}
        assignments = {name: protocol.distribute(r.meta, call.layout, r.row_lengths) for name, r in inputs.items()}
        specs = []
        for rank in range(len(pool.workers)):
            data_args: list[DataArg] = []
            pieces: list[Piece] = []
            for name, r in inputs.items():
                runs = assignments[name][rank]
                plan = None if runs is None else plan_pull(r.meta, runs, pulls[name])
                data_args.append(DataArg(name=name, plan=plan))
                pieces.extend(plan.pieces if plan is not None else ())
            cs = CallSpec(call_id=call.call_id, role=call.role, method=call.method, out_key=call.out_key,
                          data_args=tuple(data_args))
            specs.append((msgspec.msgpack.encode(cs), pieces))
        return specs, next(iter(assignments.values()), None)

    # ----- waiting for the ranks -----

    async def _await_ranks(self, pool: PoolState, call: Call, tasks: Sequence[asyncio.Future[RankResult]],
                           assignment: Any) -> None:
        ranks = _Ranks()
        rank_of: dict[asyncio.Future[Any], int] = {t: r for r, t in enumerate(tasks)}
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, _ = await asyncio.wait(pending | {pool.died}, return_when=asyncio.FIRST_COMPLETED)
            if pool.died in done:  # one of this pool's processes died: nothing to heal
                settle(call, self._died_during(pool, call))
                self._abandon(pending)
                self._release(ranks.results.values())
                return
            for t in done:
                pending.discard(t)
                exc = t.exception()
                if exc is None:
                    result = cast(RankResult, t.result())
                    ranks.results[rank_of[t]] = result
                else:
                    ranks.failures[rank_of[t]] = exc
            if ranks.failures:
                self._poison_finished(pool, ranks)
                primary = primary_error(call, pool.name, ranks.failures, self._gone_error(pool, call))
                if primary is not None and not call.result.done():
                    call.result.set_exception(primary)
        if not ranks.failures:
            self._complete(call, [ranks.results[r] for r in range(len(tasks))], assignment)
            return
        self._release(ranks.results.values())
        if not call.result.done():
            best = (primary_error(call, pool.name, ranks.failures, self._gone_error(pool, call))
                    or peer_error(call, pool.name, ranks.failures))
            call.result.set_exception(best)
        if pool.broken is None:
            await self._heal(pool)

    def _poison_finished(self, pool: PoolState, ranks: _Ranks) -> None:
        # A rank that returned cannot be in a collective any more: dropping its
        # connections releases peers still blocked on it.
        for rank in (set(ranks.results) | set(ranks.failures)) - ranks.poisoned:
            ranks.poisoned.add(rank)
            fut = asyncio.ensure_future(self.transport.poison(pool.workers[rank]))
            fut.add_done_callback(_quiet)

    def _gone_error(self, pool: PoolState, call: Call) -> Callable[[int, WorkerGone], WorkerDiedError]:
        """Maps a rank's :class:`WorkerGone` to the public error (and breaks the dead
        worker's pool)."""
        return lambda rank, exc: self._gone(pool, call, rank, exc)

    def _gone(self, pool: PoolState, call: Call, rank: int, exc: WorkerGone) -> WorkerDiedError:
        self._worker_died(exc.worker, exc.detail)
        if exc.worker == pool.workers[rank] or exc.worker not in self._where:
            return WorkerDiedError(role=call.role, method=call.method, rank=rank, pool=pool.name,
                                   cause="its worker process died", detail=exc.detail)
        producer, prank = self._where[exc.worker]
        role, _, method = producer_of(call, exc.worker).partition(".")
        return WorkerDiedError(role=role, method=method.split("#")[0], rank=prank, pool=producer.name,
                               cause=f"its worker process died while {call.label} pulled rows from it",
                               detail=exc.detail)

    def _died_during(self, pool: PoolState, call: Call) -> WorkerDiedError:
        d = pool.died.result()
        return WorkerDiedError(role=call.role, method=call.method, rank=d.rank, pool=pool.name,
                               cause=d.cause, detail=d.detail)

    def _complete(self, call: Call, results: list[RankResult], assignment: Any) -> None:
        produced = {(r.worker, r.key) for r in results if r.key is not None}
        try:
            out = call.endpoint.spec.protocol.collect(results, call.layout, assignment)
        except Exception as e:
            self.ledger.release_now(produced)
            settle(call, e)
            return
        if not isinstance(out, Collected):
            self.ledger.release_now(produced)
            if not call.result.done():
                call.result.set_result(out)
            return
        kept = out.meta.shard_keys()
        self.ledger.release_now(produced - kept)
        leases = tuple(self.ledger.lease(w, k) for w, k in sorted(kept))
        if not call.result.done():  # else cancelled while running: the leases go now
            call.result.set_result(Resolved(meta=out.meta, row_lengths=out.row_lengths, leases=leases))

    def _release(self, results: Iterable[RankResult]) -> None:
        self.ledger.release_now({(r.worker, r.key) for r in results if r.key is not None})

    def _abandon(self, pending: Iterable[asyncio.Future[Any]]) -> None:
        def late(t: asyncio.Future[Any]) -> None:
            if not t.cancelled() and t.exception() is None and t.result().key is not None:
                self.ledger.release_now({(t.result().worker, t.result().key)})
        for t in pending:
            t.add_done_callback(late)

    async def _heal(self, pool: PoolState) -> None:
        pool.epoch += 1
        results = await asyncio.gather(*(self.transport.heal(w, pool.epoch) for w in pool.workers),
                                       return_exceptions=True)
        for w, r in zip(pool.workers, results, strict=True):
            if isinstance(r, WorkerGone):
                self._worker_died(r.worker, r.detail)
            elif isinstance(r, BaseException):
                self._worker_died(w, f"reconnecting its process groups failed: {r}")

    # ----- deaths -----

    async def _watch(self, worker: int) -> None:
        try:
            await self.transport.watch(worker)
        except WorkerGone as e:
            if not self._closed:
                self._worker_died(worker, e.detail)
        except Exception:  # the transport is going away
            logger.debug("watch of worker %d ended", worker, exc_info=True)

    def _worker_died(self, worker: int, detail: str) -> None:
        """Break the pool of ``worker``; fail its running and queued calls."""
        if worker not in self._where or self._closed:
            return
        pool, rank = self._where[worker]
        if pool.died.done():
            return
        running = pool.running
        err = WorkerDiedError(role=running.role if running else "", method=running.method if running else "",
                              rank=rank, pool=pool.name, cause="its worker process died", detail=detail)
        pool.died.set_result(err)
        for call in list(pool.queued.values()):
            settle(call, WorkerDiedError(role=call.role, method=call.method, rank=rank, pool=pool.name,
                                          cause=f"rank {rank}'s worker process died before the call ran",
                                          detail=detail))


def _quiet(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.debug("poisoning a rank's groups failed: %s", fut.exception())
