"""The shard ledger: which shards futures still name, and freeing the rest.

Every shard a call produced is held by :class:`Lease` objects (one per future's
metadata naming it). When the last lease goes, its finaliser runs, possibly in a
garbage-collection pass on any thread, even inside code that holds a lock; so the
finaliser only enqueues ``(worker, key)`` on a ``SimpleQueue`` (reentrant, no lock
of ours) and asks the event loop to flush. Nothing else runs in a finaliser.

A free costs a round trip to the worker, as much as the call that made the shard.
So the keys wait up to :data:`FREE_DELAY_S` for the next call to their worker,
which takes them along (:meth:`ShardLedger.take`, the ``free`` argument of the
transport's ``execute``); what no call took by then goes in one ``free`` per worker.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Free = Callable[[int, Sequence[str]], Awaitable[Any]]
"""Frees shards ``keys`` on worker ``worker``."""

FREE_DELAY_S = 0.02
"""How long released keys wait for a call to their worker to take them along."""


class Lease:
    """Keeps one shard alive; when the last reference goes, the shard is freed."""

    __slots__ = ("__weakref__", "key", "worker")

    def __init__(self, worker: int, key: str, ledger: ShardLedger) -> None:
        self.worker, self.key = worker, key
        weakref.finalize(self, ledger.release, worker, key)


class ShardLedger:
    """Frees shards once no lease names them.

    Args:
        free: the transport's free operation.
    """

    def __init__(self, free: Free) -> None:
        self._free = free
        self._queue: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._closed = False
        self._pending: set[asyncio.Future[Any]] = set()
        self._waiting: dict[int, list[str]] = {}  # released, drained from the queue, not yet sent

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Free on ``loop`` (the session's event loop)."""
        self._loop = loop

    def lease(self, worker: int, key: str) -> Lease:
        """A new lease on shard ``key`` of ``worker``."""
        return Lease(worker, key, self)

    def release(self, worker: int, key: str) -> None:
        """The last lease of a shard went. Safe from any thread and from finalisers:
        it only enqueues and wakes the loop."""
        self._queue.put((worker, key))
        if self._scheduled or self._closed or self._loop is None:
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._arm)
        except RuntimeError:  # the loop is closed: nothing left to free on
            pass

    def take(self, worker: int) -> list[str]:
        """The keys of ``worker`` released and not yet sent: the caller frees them
        with its next message to that worker (from the loop's thread)."""
        self._collect()
        return self._waiting.pop(worker, [])

    def release_now(self, shards: Iterable[tuple[int, str | None]]) -> None:
        """Free shards no future will ever name (from the loop's thread)."""
        for worker, key in shards:
            if key is not None:
                self.release(worker, key)

    def _arm(self) -> None:
        assert self._loop is not None
        self._loop.call_later(FREE_DELAY_S, self._flush)

    def _collect(self) -> None:
        while True:
            try:
                worker, key = self._queue.get_nowait()
            except queue.Empty:
                return
            self._waiting.setdefault(worker, []).append(key)

    def _flush(self) -> None:
        # Clear the flag before draining: a release that lands after the drain
        # started then schedules another flush instead of being missed.
        self._scheduled = False
        if self._closed:
            return
        self._collect()
        by_worker, self._waiting = self._waiting, {}
        for worker, keys in by_worker.items():
            fut = asyncio.ensure_future(self._free(worker, keys))
            self._pending.add(fut)
            fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:  # a dead worker's shards died with it
            logger.debug("freeing shards failed: %s", fut.exception())

    async def drain(self) -> None:
        """Wait until every shard released so far is freed on its worker."""
        self._flush()
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def close(self) -> None:
        """Stop freeing (the workers are going away)."""
        self._closed = True
        for fut in list(self._pending):
            fut.cancel()
