"""What a worker process serves in its ``io`` concurrency group while it
computes: the rows of its rank's shard store (a consumer pulls rows this worker
produced while it runs the next call), and the controls of its streamed calls."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import ray
import torch

from channels import (
    Batch,
    ChannelAddress,
    Packed,
    Piece,
    RankResult,
    ShardStore,
    StoreStats,
    StreamItem,
    open_remote_channel,
    pack,
    unpack,
)
from workers.host._pulls import Pull, Sender, receive
from workers.host._rows import on_device
from workers.host._streaming import StreamControl, StreamSink

logger = logging.getLogger(__name__)


class RowServer:
    """Mixin of :class:`~workers.host._worker.WorkerProcess`: the ``io`` methods
    over its ``store`` (kept on ``store_device``)."""

    store: ShardStore
    store_device: torch.device
    sender: Sender
    rank: int
    index: int

    @ray.method(concurrency_group="io")
    def slice(self, key: str, lo: int, hi: int, fields: Sequence[str] | None) -> dict[str, torch.Tensor]:
        """Rows ``[lo, hi)`` of columns ``fields`` of shard ``key``. The driver calls
        it with ``tensor_transport`` set so the tensors go straight to the consumer."""
        return self.store.slice(key, lo, hi, fields)

    @ray.method(concurrency_group="io")
    def slice_to_host(self, key: str, lo: int, hi: int, fields: Sequence[str] | None) -> dict[str, torch.Tensor]:
        """Rows ``[lo, hi)`` of columns ``fields`` of shard ``key`` as CPU tensors:
        what the driver's ``fetch`` receives (through the object store)."""
        return {name: t.cpu() for name, t in self.store.slice(key, lo, hi, fields).items()}

    @ray.method(concurrency_group="io")
    def slices(self, pieces: Sequence[Piece]) -> tuple[Packed, dict[str, torch.Tensor]]:
        """Several pieces of this worker's shards, packed into one buffer per dtype
        (``channels.pack``): one transfer, a few tensors (see ``slice``)."""
        return self._packed(pieces)

    @ray.method(concurrency_group="io")
    def send_slices(self, dst: int, tag: int, pieces: Sequence[Piece]) -> None:
        """Post several pieces of this worker's shards, packed as ``slices``
        packs them, to worker ``dst`` over the session's process group
        (``workers.host._pulls``); returns once posted, not once received."""
        self.sender.send(dst, tag, lambda: self._packed(pieces))

    def _packed(self, pieces: Sequence[Piece]) -> tuple[Packed, dict[str, torch.Tensor]]:
        return pack([self.store.slice(p.key, p.lo, p.hi, p.fields) for p in pieces])

    @ray.method(concurrency_group="io")
    def drop_pulls(self, pulls: Sequence[Pull]) -> None:
        """Receive and drop the rows of a call that failed before it received
        them (those it began to receive are skipped), so that their senders'
        sends end."""
        try:
            receive(pulls, unless_begun=True)
        except Exception as e:  # a sender that died or could not send: nothing is left waiting
            logger.debug("dropping pulls: %s", e)

    @ray.method(concurrency_group="io")
    def pending_sends(self) -> int:
        """Sends of rows posted and not yet handed over."""
        return self.sender.pending()

    @ray.method(concurrency_group="io")
    def put(self, key: str, columns: Mapping[str, torch.Tensor], group_size: int = 1) -> RankResult:
        """Store rows handed in by the driver (``Session.put``), on the store device."""
        batch = on_device(Batch(columns, group_size=group_size), self.store_device)
        self.store.put(key, batch)
        return RankResult(rank=self.rank, worker=self.index, key=key, num_rows=batch.num_rows,
                          fields=batch.field_specs(), group_size=batch.group_size)

    @ray.method(concurrency_group="io")
    def free(self, keys: Sequence[str]) -> int:
        """Drop shards no future names any more."""
        return self.store.free(keys)

    @ray.method(concurrency_group="io")
    def stats(self) -> StoreStats:
        """The store's counters."""
        return self.store.stats()

    @ray.method(concurrency_group="io")
    def clock(self) -> float:
        """This process's ``time.time()``: the driver aligns traced spans with it."""
        return time.time()


class StreamEnds:
    """Mixin of :class:`~workers.host._worker.WorkerProcess`: the worker's ends of
    its streamed calls (``_streams``, by call id, under ``_streams_lock``)."""

    device: torch.device
    _streams: dict[int, tuple[StreamSink, StreamControl]]
    _streams_lock: threading.Lock

    @ray.method(concurrency_group="io")
    def open_stream(self, call_id: int, capacity: int) -> ChannelAddress[StreamItem]:
        """Open the channel of streamed call ``call_id`` (before it runs); the
        driver receives from the returned address."""
        send, address = open_remote_channel(StreamItem, capacity)
        self.attach_stream(call_id, send)
        return address

    def attach_stream(self, call_id: int, sink: StreamSink) -> None:
        """Send streamed call ``call_id``'s items to ``sink`` (in-process workers)."""
        with self._streams_lock:
            self._streams[call_id] = (sink, StreamControl())

    @ray.method(concurrency_group="io")
    def stream_control(self, call_id: int, action: str, count: int = 0) -> bool:
        """Long-tail migration of streamed call ``call_id``: ``"handoff"`` (give up
        the unfinished work) or ``"expect"`` (``count`` tails will be delivered).
        False: the call is over on this rank (or never streamed here)."""
        with self._streams_lock:
            entry = self._streams.get(call_id)
        if entry is None:
            return False
        control = entry[1]
        return control.handoff() if action == "handoff" else control.expect(count)

    @ray.method(concurrency_group="io")
    def stream_adopt(self, call_id: int, group_size: int, columns: Mapping[str, torch.Tensor] | Pull | None) -> None:
        """Deliver one announced tail (None: its source had nothing left), sent by
        Ray Direct Transport or by its source worker (a :class:`Pull`)."""
        if isinstance(columns, Pull):
            (packed, buffers), = receive([columns])
            columns = unpack(packed, buffers)[0]
        with self._streams_lock:
            entry = self._streams.get(call_id)
        if entry is not None:
            entry[1].deliver(None if columns is None else on_device(Batch(columns, group_size=group_size), self.device))
