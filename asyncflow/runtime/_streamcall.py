"""Running a streamed call: micro-batches become futures, and the long tail migrates.

Each rank of a streamed call (``roles.actor.generate(prompts, stream=True)``)
sends :class:`~channels.StreamItem` s through a typed channel whose buffer lives in
the rank's process; the driver receives them here. A ``"rows"`` item becomes a
:class:`DataFuture` of that micro-batch at once (its rows stay on the rank until a
consumer pulls them), pushed into the call's :class:`DataStream`.

Long-tail migration (RLHFuse's inter-stage fusion): every item carries how many
samples its rank still generates. When the total falls to the threshold, the
ranks with the most work left become *targets*; the others (*sources*) are told to
hand their unfinished samples off. A source sends them as a ``"tail"`` item (rows
in its store) and returns, which frees its rank for rank-local calls queued on the
pool (inference on finished micro-batches). Each target pulls its sources' tails
peer to peer, re-prefills them and finishes them with its own. Targets are told
how many tails to expect before any source is asked, so a target never finishes
while a tail is on its way; one that already finished refuses, and its sources are
left alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from asyncflow.runtime._future import DataFuture
from asyncflow.runtime._observed import StreamStats, auto_migration
from asyncflow.runtime._resolved import Resolved
from channels import Piece, RankResult, StreamItem

if TYPE_CHECKING:
    from asyncflow.runtime._calls import Call
    from asyncflow.runtime._lanes import PoolState
    from asyncflow.runtime._ledger import ShardLedger
    from asyncflow.runtime._observed import Observed
    from asyncflow.runtime._tracer import Tracer
    from asyncflow.runtime._transport import Transport


class Host(Protocol):
    """What a streamed call needs of the scheduler running it."""

    transport: Transport
    ledger: ShardLedger
    observed: Observed
    tracer: Tracer | None

    def task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task the scheduler owns; returns it."""
        ...

    def spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` as a task the scheduler owns."""
        ...

    async def execute(self, worker: int, spec: bytes, kwargs: Any, transforms: Any,
                      pieces: Sequence[Piece]) -> RankResult:
        """One rank's part of a call (with the frees waiting for ``worker``)."""
        ...


class StreamedCall:
    """The driver's side of one streamed call (see the module docstring)."""

    def __init__(self, scheduler: Host, pool: PoolState, call: Call, lanes: Sequence[int],
                 workers: Sequence[int]) -> None:
        self._sched, self._pool, self._call = scheduler, pool, call
        self._workers = list(workers)
        self._options = call.stream
        self._pumps: list[asyncio.Task[None]] = []
        self._pending: list[int | None] = [None] * len(workers)
        self._ended = [False] * len(workers)
        self._route: dict[int, int] | None = None
        self._delivered: set[int] = set()
        self._migrating = False
        self._count = 0
        self._started = time.monotonic()
        self.stats = StreamStats.for_ranks(len(workers))
        self._initial = self.stats.initial
        self._auto = (0, 1)
        if self._options.migrate == "auto":
            self._auto = auto_migration(scheduler.observed, pool=pool.name, role=call.role, method=call.method,
                                        ranks=len(workers), micro_batch=self._options.micro_batch)

    # ----- lifecycle -----

    async def start(self, specs: Sequence[tuple[bytes, list[Piece]]], transforms: Any
                    ) -> list[asyncio.Future[RankResult]]:
        """Open every rank's channel, start receiving, then submit the call."""
        t = self._sched.transport
        receivers = await asyncio.gather(*(t.open_stream(w, self._call.call_id, self._options.buffer)
                                           for w in self._workers))
        for i, r in enumerate(receivers):
            self._pumps.append(self._sched.task(self._pump(i, r), f"asyncflow-stream-{self._call.label}-{i}"))
        return [asyncio.ensure_future(self._sched.execute(w, spec, self._call.kwargs, transforms, pieces))
                for w, (spec, pieces) in zip(self._workers, specs, strict=True)]

    def rank_returned(self, i: int, result: RankResult) -> None:
        """Rank ``i``'s part of the call returned (with its step timings)."""
        self.stats.rank_done_s[i] = time.monotonic() - self._started
        value = result.value if isinstance(result.value, dict) else {}
        self.stats.step_s.extend((int(b), float(t)) for b, t in value.get("steps", ()))

    async def finish(self) -> None:
        """After the ranks settled: drain the channels (or drop them if the call
        failed), then end the stream with the call's outcome."""
        call = self._call
        if call.result.done() and not call.result.cancelled() and call.result.exception() is not None:
            for p in self._pumps:
                p.cancel()
        results = await asyncio.gather(*self._pumps, return_exceptions=True)
        if not call.result.done():
            errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
            if errors:
                call.result.set_exception(errors[0])
            else:
                self.stats.total_s = time.monotonic() - self._started
                self._sched.observed.record_stream(call.role, call.method, self.stats)
                call.result.set_result(self.stats)

    # ----- receiving -----

    async def _pump(self, i: int, receiver: Any) -> None:
        try:
            async for item in receiver:
                await self._on_item(i, item)
        finally:
            self._ended[i] = True
            await receiver.aclose()
            if self._route is not None and i in self._route and i not in self._delivered:
                await self._deliver(i, None)

    async def _on_item(self, i: int, item: StreamItem) -> None:
        if self._pending[i] is None:
            self._initial[i] = item.pending
        self._pending[i] = item.pending
        if item.kind == "rows" and item.key is not None:
            self._push(item)
        elif item.kind == "tail" and item.key is not None:
            self.stats.migrated += item.num_rows
            if self._route is not None and i in self._route:
                await self._deliver(i, item)
            else:  # nobody asked for it: cannot happen with a sound worker
                self._sched.ledger.release_now({(item.worker, item.key)})
        self._maybe_migrate()

    def _push(self, item: StreamItem) -> None:
        assert item.key is not None
        call, out = self._call, self._call.stream_out
        lease = self._sched.ledger.lease(item.worker, item.key)
        if item.row_lengths is not None:
            self.stats.lengths.extend(item.row_lengths)
        if call.result.done():  # failed or cancelled: nobody will consume it
            del lease
            return
        done = asyncio.get_running_loop().create_future()
        done.set_result(Resolved(meta=item.meta(), row_lengths=item.row_lengths, leases=(lease,)))
        self._count += 1
        fut: DataFuture[Any] = DataFuture(label=f"{call.label}[{self._count}]", fields=out.fields,
                                          origins=out._origins, owner=out._owner, source=done,
                                          call_id=call.call_id)
        fut._row_ids = item.row_ids
        fut._part = (call.call_id, self._count)
        if self._sched.tracer is not None:
            self._sched.tracer.part(call)
        out._push(fut)

    # ----- long-tail migration -----

    def threshold(self) -> int:
        """Samples left at which the tail migrates (0: never)."""
        return self._threshold()[0]

    def _threshold(self) -> tuple[int, int]:
        """``(threshold, targets)`` for this call (0: no migration)."""
        opts = self._options
        if opts.migrate == "auto":
            return self._auto
        threshold = opts.migrate or 0
        per_rank = max(max(self._initial), 1)
        return threshold, opts.targets or max(1, math.ceil(threshold / per_rank))

    def _maybe_migrate(self) -> None:
        if self._migrating or any(p is None for p in self._pending):
            return
        threshold, targets = self._threshold()
        self.stats.threshold = threshold
        active = [i for i, p in enumerate(self._pending) if not self._ended[i] and p]
        total = sum(self._pending[i] or 0 for i in active)
        if threshold <= 0 or total > threshold or len(active) <= targets:
            return
        self._migrating = True
        self.stats.migrated_at_s = time.monotonic() - self._started
        self._sched.spawn(self._migrate(active, targets), f"asyncflow-migrate-{self._call.label}")

    async def _migrate(self, active: list[int], k: int) -> None:
        t, cid = self._sched.transport, self._call.call_id
        order = sorted(active, key=lambda i: (-(self._pending[i] or 0), i))
        targets, sources = order[:k], order[k:]
        route = {s: targets[j % len(targets)] for j, s in enumerate(sources)}
        counts = Counter(route.values())
        accepted = await asyncio.gather(*(t.stream_control(self._workers[r], cid, "expect", counts[r])
                                          for r in targets), return_exceptions=True)
        refused = {r for r, ok in zip(targets, accepted, strict=True) if ok is not True}
        self._route = {s: r for s, r in route.items() if r not in refused}
        self.stats.targets = [r for r in targets if r not in refused]
        for s in list(self._route):
            if self._ended[s] and s not in self._delivered:
                await self._deliver(s, None)
        await asyncio.gather(*(t.stream_control(self._workers[s], cid, "handoff", 0) for s in self._route),
                             return_exceptions=True)

    async def _deliver(self, source: int, item: StreamItem | None) -> None:
        """Hand ``source``'s tail (or the news that it has none) to its target."""
        assert self._route is not None
        if source in self._delivered:
            return
        self._delivered.add(source)
        target = self._workers[self._route[source]]
        piece = None
        if item is not None and item.key is not None:
            piece = Piece(worker=item.worker, key=item.key, lo=0, hi=item.num_rows,
                          fields=tuple(f.name for f in item.fields))
        try:
            await self._sched.transport.stream_adopt(target, self._call.call_id, piece,
                                                     item.group_size if item is not None else 1)
        finally:
            if item is not None and item.key is not None:
                self._sched.ledger.release_now({(item.worker, item.key)})
