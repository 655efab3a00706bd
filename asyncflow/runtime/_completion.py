"""Waiting for the ranks of a running call, and turning what they report into
its result: rows collected into one future, or the one error worth reporting
(a rank's own error or a death before any peer failure; see ``_failures``); and
what a worker process's death does to its pool.

A rank whose peer process died often reports it first, as a broken connection
(gloo's "Connection reset by peer": the worker marks it a peer failure), before Ray
reports the death: a call whose ranks failed only that way waits up to
:data:`DEATH_REPORT_GRACE_S` for a death, and fails with the death
(:class:`WorkerDiedError`, naming the process that died) when one comes.

A death is blamed on the call the process was serving: the first call holding
its rank when the death is reported, unless the process's own connection to the
driver closed while no call written on it waited for an answer
(``Transport.on_disconnect``, read before Ray reports the death): then it died
between calls, and a call holding the rank was sent to it after. Every call the
death fails names that call (or none) and says what became of it. Where workers
have no such connection, a call sent in the moment between a death and Ray's
report of it is taken for the one the process served.

The scheduler (``_scheduler``) decides which call runs where and when; once a
call's ranks run, it hands them to :class:`CallCompletion`, which owns everything
after: results, failures, timeouts and deaths.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec

from asyncflow.runtime._calls import Call
from asyncflow.runtime._errors import CallTimeoutError, RemoteStageError, WorkerDiedError
from asyncflow.runtime._failures import peer_error, primary_error, producer_of, settle
from asyncflow.runtime._ledger import ShardLedger
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._transport import Transport, WorkerGone
from channels import Collected, Layout, RankResult

if TYPE_CHECKING:
    from asyncflow.runtime._lanes import PoolState
    from asyncflow.runtime._tracer import Tracer

logger = logging.getLogger(__name__)

DEATH_REPORT_GRACE_S = 5.0
"""How long a call whose ranks failed only because of a peer waits for Ray to report
the death of the process behind it (see the module docstring)."""


@dataclass(eq=False)
class _Ranks:
    """What the ranks of one running call reported so far."""

    results: dict[int, RankResult] = field(default_factory=dict)
    failures: dict[int, BaseException] = field(default_factory=dict)
    poisoned: set[int] = field(default_factory=set)


class CallCompletion:
    """Waits for the ranks of running calls and settles each call; breaks the pool
    of a worker process that died (see the module docstring).

    Args:
        transport: how the driver reaches the workers.
        ledger: frees the shards that no future names.
        where: per worker (session-wide index), its pool and its rank there; the
            scheduler fills it as it adds pools.
    """

    def __init__(self, transport: Transport, ledger: ShardLedger, where: Mapping[int, tuple[PoolState, int]]) -> None:
        self.transport = transport
        self.ledger = ledger
        self._where = where
        self.tracer: Tracer | None = None
        """Set while a trace is recording (the scheduler's ``tracer``)."""
        self.closed = False
        """The session is closing: deaths no longer break pools."""
        self._deaths: list[WorkerDiedError] = []
        """Each pool's death, in the order they were reported."""
        self._death_reported = asyncio.Event()
        """Set (and replaced) at each death: what a wait for the next one waits on."""
        self._met: dict[str, int | None] = {}
        """Per pool broken by a death, the call (id) that met it: the one its process
        was serving, or the one that found it dead after it died between calls."""
        self._closed_idle: set[int] = set()
        """Workers whose connection closed while no call sent on it waited."""
        transport.on_disconnect(self._disconnected)

    # ----- deaths -----

    async def watch(self, worker: int) -> None:
        """Wait for ``worker`` to die (its sentinel call fails), then break its pool.
        Ends when the transport goes away or the task is cancelled at close."""
        try:
            await self.transport.watch(worker)
        except WorkerGone as e:
            if not self.closed:
                self.worker_died(worker, e.detail)
        except Exception:  # the transport is going away
            logger.debug("watch of worker %d ended", worker, exc_info=True)

    def _disconnected(self, worker: int, busy: bool) -> None:
        if not busy:  # its process ended serving no call: one sent to it later never ran there
            self._closed_idle.add(worker)

    def worker_died(self, worker: int, detail: str) -> None:
        """Break the pool of ``worker``, naming the call its process was serving
        (see the module docstring); fail its running and queued calls."""
        if worker not in self._where or self.closed:
            return
        pool, rank = self._where[worker]
        if pool.died.done():
            return
        held = [pool.running[i] for i in pool.holders.get(rank, ()) if i in pool.running]
        served = held[0] if held and worker not in self._closed_idle else None
        if served is not None:
            err = WorkerDiedError(role=served.role, method=served.method, rank=rank, pool=pool.name,
                                  cause="its worker process died", detail=detail)
        else:
            found = f"; {held[0].label} found it dead" if held else ""
            err = WorkerDiedError(role="", method="", rank=rank, pool=pool.name,
                                  cause=f"its worker process died between calls{found}", detail=detail)
        self._met[pool.name] = held[0].call_id if held else None
        pool.died.set_result(err)
        self._deaths.append(err)
        self._death_reported.set()
        self._death_reported = asyncio.Event()
        for call in pool.calls():
            settle(call, self._death_seen_by(pool, call, err))
        pool.wake.set()

    def _death_seen_by(self, pool: PoolState, call: Call, death: WorkerDiedError) -> WorkerDiedError:
        """The error of ``call``, failed by ``death`` of a process of its pool: the
        death itself for the call that met it, else the death and what became of
        ``call``."""
        if call.call_id == self._met.get(pool.name):
            return WorkerDiedError(role=death.role, method=death.method, rank=death.rank, pool=death.pool,
                                   cause=death.cause, detail=death.detail)
        fate = "did not finish" if call.call_id in pool.running else "was not run"
        return WorkerDiedError(role=death.role, method=death.method, rank=death.rank, pool=death.pool,
                               cause=f"{death.cause}; {call.label} {fate}", detail=death.detail)

    # ----- waiting for the ranks -----

    async def await_ranks(self, pool: PoolState, call: Call, tasks: Sequence[asyncio.Future[RankResult]],
                          assignment: Any, lanes: Sequence[int], release: Callable[[int], None] | None,
                          stream: Any) -> None:
        """Wait for ``tasks`` (one per rank of ``call``, on ``pool``'s ranks ``lanes``)
        and settle ``call``; ``release(lane)`` gives a rank back as soon as it
        returned (a streamed call's), and ``stream`` hears each rank's result.
        Returns once every rank returned or the call failed, timed out or lost a
        worker."""
        ranks = _Ranks()
        deaths_before = len(self._deaths)
        rank_of: dict[asyncio.Future[Any], int] = {t: r for r, t in enumerate(tasks)}
        pending: set[asyncio.Future[Any]] = set(tasks)
        loop = asyncio.get_running_loop()
        deadline = None if call.timeout_s is None else loop.time() + call.timeout_s  # never set on a streamed call
        while pending:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                done, _ = await asyncio.wait(pending | {pool.died}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the driver gave up on the call: its ranks' results are seen later
                self._abandon(pending)
                raise
            if not done:  # the call's timeout_s passed with ranks still running
                self._timed_out(pool, call, sorted(lanes[rank_of[t]] for t in pending))
                self._abandon(pending)
                self._release(ranks.results.values())
                return
            if pool.died in done:  # one of this pool's processes died: nothing to heal
                settle(call, self._died_during(pool, call))
                self._abandon(pending)
                self._release(ranks.results.values())
                return
            for t in done:
                pending.discard(t)
                exc = t.exception()
                if exc is None:
                    ranks.results[rank_of[t]] = cast(RankResult, t.result())
                    if self.tracer is not None:
                        self.tracer.rank_returned(call, lanes[rank_of[t]], ranks.results[rank_of[t]])
                    if release is not None and not ranks.failures:
                        release(lanes[rank_of[t]])
                    if stream is not None:
                        stream.rank_returned(rank_of[t], ranks.results[rank_of[t]])
                else:
                    ranks.failures[rank_of[t]] = exc
            if ranks.failures:
                self._poison_finished(pool, ranks, lanes)
                primary = primary_error(call, pool.name, ranks.failures, self._gone_error(pool, call, lanes))
                if primary is not None and not call.result.done():
                    call.result.set_exception(primary)
        if not ranks.failures:
            if stream is None:
                # Protocols index results by position in the layout they ran on.
                results = [msgspec.structs.replace(ranks.results[i], rank=i) for i in range(len(tasks))]
                self._complete(call, results, assignment, Layout(d=len(lanes)) if call.rank_local else call.layout)
            return
        self._release(ranks.results.values())
        if not call.result.done():
            best = (primary_error(call, pool.name, ranks.failures, self._gone_error(pool, call, lanes))
                    or await self._death_behind(call, peer_error(call, pool.name, ranks.failures), deaths_before))
            if not call.result.done():
                call.result.set_exception(best)
        if pool.broken is None:
            pool.needs_heal = True

    async def _death_behind(self, call: Call, error: RemoteStageError, deaths_before: int) -> RemoteStageError:
        """``error`` (every rank of ``call`` failed because of a peer), or the death
        behind it: waits up to :data:`DEATH_REPORT_GRACE_S` for a death reported since
        the call started (``deaths_before`` were reported before), and becomes it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEATH_REPORT_GRACE_S
        while len(self._deaths) == deaths_before and not self.closed:
            reported = self._death_reported  # captured before the wait: no death goes unseen
            try:
                await asyncio.wait_for(reported.wait(), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                return error
        if len(self._deaths) == deaths_before:
            return error
        d = self._deaths[deaths_before]
        return WorkerDiedError(role=d.role, method=d.method, rank=d.rank, pool=d.pool,
                               cause=f"its worker process died, and {call.label}'s rank {error.rank} of pool "
                                     f"{error.pool!r} lost its connection to it ({error.cause.splitlines()[0]})",
                               detail=d.detail)

    def _poison_finished(self, pool: PoolState, ranks: _Ranks, lanes: Sequence[int]) -> None:
        # A rank that returned cannot be in a collective any more: dropping its
        # connections releases peers still blocked on it.
        for i in (set(ranks.results) | set(ranks.failures)) - ranks.poisoned:
            ranks.poisoned.add(i)
            fut = asyncio.ensure_future(self.transport.poison(pool.workers[lanes[i]]))
            fut.add_done_callback(_quiet)

    def _gone_error(self, pool: PoolState, call: Call, lanes: Sequence[int]
                    ) -> Callable[[int, WorkerGone], WorkerDiedError]:
        """Maps a rank's :class:`WorkerGone` to the public error (and breaks the dead
        worker's pool)."""
        return lambda i, exc: self._gone(pool, call, lanes[i], exc)

    def _gone(self, pool: PoolState, call: Call, rank: int, exc: WorkerGone) -> WorkerDiedError:
        self.worker_died(exc.worker, exc.detail)
        death = pool.broken
        if exc.worker == pool.workers[rank] and isinstance(death, WorkerDiedError) and death.rank == rank:
            return self._death_seen_by(pool, call, death)
        if exc.worker == pool.workers[rank] or exc.worker not in self._where:
            return WorkerDiedError(role=call.role, method=call.method, rank=rank, pool=pool.name,
                                   cause="its worker process died", detail=exc.detail)
        producer, prank = self._where[exc.worker]
        role, _, method = producer_of(call, exc.worker).partition(".")
        return WorkerDiedError(role=role, method=method.split("#")[0], rank=prank, pool=producer.name,
                               cause=f"its worker process died while {call.label} pulled rows from it",
                               detail=exc.detail)

    def driver_io_died(self, exc: WorkerGone, doing: str) -> WorkerDiedError:
        """The public error for a worker that died while the driver moved rows to or
        from it (``Session.put``, ``fetch_rows``); breaks its pool."""
        self.worker_died(exc.worker, exc.detail)
        pool, rank = self._where.get(exc.worker, (None, exc.worker))
        return WorkerDiedError(role="", method=doing, rank=rank, pool=pool.name if pool else "?",
                               cause="its worker process died", detail=exc.detail)

    def _died_during(self, pool: PoolState, call: Call) -> WorkerDiedError | CallTimeoutError:
        d = pool.died.result()
        if isinstance(d, CallTimeoutError):
            return CallTimeoutError(role=call.role, method=call.method, rank=d.rank, pool=pool.name,
                                    cause=f"rank {d.rank} is stuck in {d.role}.{d.method} ({d.cause})",
                                    timeout_s=d.timeout_s)
        return self._death_seen_by(pool, call, d)

    def _timed_out(self, pool: PoolState, call: Call, stuck: Sequence[int]) -> None:
        """``call`` ran past its ``timeout_s`` on ranks ``stuck``: fail it, naming the
        rows it was pulling, and break the pool (those ranks may still be running it)."""
        sources: dict[tuple[str, str], set[int]] = {}
        for r in (call.inputs or {}).values():
            for seg in _segments(r) if isinstance(r, Resolved) else ():
                where = self._where.get(seg.worker)
                if where is not None and where[0] is not pool:
                    sources.setdefault((seg.key.split("#")[0], where[0].name), set()).add(where[1])
        pulling = "".join(f"; it pulls rows of {label} from pool {name!r} rank{'s' if len(rs) > 1 else ''} "
                          f"{', '.join(map(str, sorted(rs)))}" for (label, name), rs in sorted(sources.items()))
        ranks = ", ".join(map(str, stuck))
        err = CallTimeoutError(role=call.role, method=call.method, rank=stuck[0], pool=pool.name,
                               cause=f"did not finish within {call.timeout_s:g} s (timeout_s) on rank"
                                     f"{'s' if len(stuck) > 1 else ''} {ranks}{pulling}",
                               timeout_s=call.timeout_s or 0.0)
        settle(call, err)
        if not pool.died.done():
            pool.died.set_result(err)
        pool.wake.set()

    def _complete(self, call: Call, results: list[RankResult], assignment: Any, layout: Layout) -> None:
        produced = {(r.worker, r.key) for r in results if r.key is not None}
        try:
            out = call.endpoint.spec.protocol.collect(results, layout, assignment)
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


def _segments(resolved: Resolved) -> list[Any]:
    return [s for g in resolved.meta.groups for s in g.segments]


def _quiet(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.debug("poisoning a rank's groups failed: %s", fut.exception())
