"""The per-worker shard store: rows a worker produced, kept until every future that
names them is dropped.

Thread-safe: a worker serves slices from its I/O threads while its compute thread
adds shards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec
import torch

from channels._batch import Batch
from channels._errors import TransportError


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one store's counters."""

    shards: int
    """Shards held now."""
    bytes_held: int
    """Payload bytes held now."""
    bytes_served: int
    """Bytes handed out by :meth:`ShardStore.slice` since start."""
    bytes_received: int
    """Bytes this worker pulled from other workers since start (recorded by the worker)."""
    shards_freed: int
    """Shards dropped since start."""


class ShardStore:
    """Shards by key; each shard is a :class:`Batch`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[str, Batch] = {}
        self._served = 0
        self._received = 0
        self._freed = 0

    def put(self, key: str, batch: Batch) -> None:
        """Store ``batch`` under ``key`` (keys are unique per worker)."""
        with self._lock:
            if key in self._shards:
                raise TransportError(f"shard {key!r} already exists")
            self._shards[key] = batch

    def get(self, key: str) -> Batch:
        """The whole shard ``key``."""
        with self._lock:
            try:
                return self._shards[key]
            except KeyError:
                raise TransportError(
                    f"shard {key!r} is not in this worker's store (freed, or never produced)"
                ) from None

    def slice(self, key: str, start: int, stop: int, fields: Iterable[str] | None) -> dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` of columns ``fields`` (all when None) of shard ``key``,
        as contiguous tensors ready to send."""
        shard = self.get(key)
        names = list(shard) if fields is None else list(fields)
        out = {n: shard[n][start:stop].contiguous() for n in names}
        with self._lock:
            self._served += sum(t.numel() * t.element_size() for t in out.values())
        return out

    def free(self, keys: Iterable[str]) -> int:
        """Drop shards ``keys`` (unknown keys are ignored); returns how many went."""
        n = 0
        with self._lock:
            for k in keys:
                if self._shards.pop(k, None) is not None:
                    n += 1
            self._freed += n
        return n

    def record_received(self, nbytes: int) -> None:
        """Count bytes this worker pulled from peers."""
        with self._lock:
            self._received += nbytes

    def stats(self) -> StoreStats:
        """Current counters."""
        with self._lock:
            return StoreStats(
                shards=len(self._shards),
                bytes_held=sum(b.nbytes for b in self._shards.values()),
                bytes_served=self._served,
                bytes_received=self._received,
                shards_freed=self._freed,
            )
