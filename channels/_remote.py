"""Typed channels across Ray processes: the owner side.

``send, address = open_remote_channel(Item, capacity)`` inside a Ray actor whose
class inherits :class:`ChannelHost` (the *owner*) opens a channel whose buffer
lives in that process; ``send`` is a :class:`BlockingSendChannel` for synchronous
code there, and ``address`` is a small picklable value to hand to another process,
where ``open_receiver(address)`` gives the asynchronous receiving end. The
contract is that of :func:`channels.open_channel`:

- the buffer holds at most ``capacity`` items, counting the items receivers
  claimed but have not received yet; ``send`` blocks while it is full;
- items come out in the order they went in (an item given back by a cancelled
  receive returns to the front);
- a receive either returns an item or is cancelled leaving the item in the
  channel, for any receiver in any process;
- ``clone()`` on either end; end of stream once every send handle closed and
  every item was received; :class:`BrokenResourceError` for senders once every
  receive handle closed (buffered items are then dropped).

Processes add two ways for a side to go. The death of a receiving actor process
closes its receive handles (the owner watches each such process with one
``channel_watch`` call); the items they had fetched and not acked go back to the
channel, so an item the dead process had received may be received again (at
least once). A receiver in the driver is not watched: Ray ends the actors with
their driver. The death of the owner makes receives raise
:class:`SenderDiedError`. How receives stay cancellation-safe is told in
``channels._remote_buffer``.
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import msgspec
import ray

from channels._channel import ChannelStatistics
from channels._errors import BrokenResourceError, ClosedResourceError, ConfigError, WouldBlock
from channels._remote_buffer import Buffer, TakeReply

T = TypeVar("T")

CHANNEL_CONCURRENCY_GROUPS: dict[str, int] = {"channels": 16, "channel_watch": 1}
"""Ray concurrency groups of the :class:`ChannelHost` methods; merge them into the
``concurrency_groups`` of an actor class that inherits it. Each receive handle
waiting for items holds a thread of ``channels``."""


@dataclass(frozen=True)
class ChannelAddress(Generic[T]):
    """Where a remote channel's buffer lives: pickle it to another process and open
    it there with ``open_receiver``. The first open takes the receive slot the
    channel was opened with; each further open adds a receive handle."""

    owner: Any
    """Handle of the owner actor (a :class:`ChannelHost`)."""
    channel_id: int
    """The channel's id within the owner process."""
    item_type: type[T]
    """The type of the items (a msgspec Struct, or any class msgspec decodes)."""


class _Host:
    """The channels owned by this process, and the receiving processes it watches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # never held while taking a channel's cond
        self._buffers: dict[int, Buffer] = {}
        self._ids = itertools.count(1)
        self._watched: dict[str, set[tuple[int, str]]] = {}  # actor id -> {(channel, receiver)}
        self.actor_id = ray.get_runtime_context().get_actor_id()

    def open(self, item_type: type, capacity: float) -> tuple[int, Buffer]:
        with self._lock:
            cid = next(self._ids)
            buf = Buffer(item_type, capacity, forget=lambda: self._forget(cid))
            self._buffers[cid] = buf
            return cid, buf

    def buffer(self, cid: int) -> Buffer | None:
        with self._lock:
            return self._buffers.get(cid)

    def _forget(self, cid: int) -> None:
        with self._lock:
            self._buffers.pop(cid, None)

    def watch(self, watcher: Any, watcher_id: str, cid: int, rid: str) -> None:
        """Close receiver ``rid`` of channel ``cid`` when actor ``watcher_id`` dies.

        One ``channel_watch`` call per process, however many handles it has: the
        call never returns while the process lives, and fails when it dies.
        """
        with self._lock:
            first = watcher_id not in self._watched
            self._watched.setdefault(watcher_id, set()).add((cid, rid))
        if first:
            fut: Future[None] = watcher.channel_watch.remote().future()
            fut.add_done_callback(lambda _: self._died(watcher_id))

    def unwatch(self, watcher_id: str, cid: int, rid: str) -> None:
        with self._lock:
            self._watched.get(watcher_id, set()).discard((cid, rid))

    def _died(self, watcher_id: str) -> None:
        with self._lock:
            handles = self._watched.pop(watcher_id, set())
        for cid, rid in handles:
            buf = self.buffer(cid)
            if buf is not None:
                with buf.cond:
                    buf.close_receiver(rid, acked_through=0)


_host: _Host | None = None
_host_lock = threading.Lock()


def _this_host() -> _Host:
    """The process's :class:`_Host`, made on first use (a Ray actor process hosts
    one actor, so the process is the owner)."""
    global _host
    with _host_lock:
        if _host is None:
            _host = _Host()
        return _host


class BlockingSendChannel(Generic[T]):
    """The sending end of a remote channel, for synchronous code in the owner
    process (a role method in the actor's compute thread). Thread-safe. Create
    with :func:`open_remote_channel`; ``with send: ...`` closes it at the end."""

    def __init__(self, buf: Buffer) -> None:
        self._buf = buf
        self._closed = False
        with buf.cond:
            buf.open_send += 1

    def send_nowait(self, item: T) -> None:
        """Put ``item`` in the buffer if it has room, and wake the waiting receivers.

        Raises:
            WouldBlock: the buffer holds ``capacity`` items (claimed ones included,
                until their receiver received them).
            BrokenResourceError: every receive handle closed, or its process died.
            ClosedResourceError: this handle was closed.
            TypeError: ``item`` is not an instance of the channel's item type.
        """
        self._put(item, block=False)

    def send(self, item: T) -> None:
        """Send ``item``, blocking this thread while the buffer is full.

        Waits for room in the buffer; unblocked by a receive, by every receive
        handle closing or its process dying (raises :class:`BrokenResourceError`)
        or by this handle closing, from another thread (raises
        :class:`ClosedResourceError`). Raises what :meth:`send_nowait` raises,
        except :class:`WouldBlock`.
        """
        self._put(item, block=True)

    def _put(self, item: T, *, block: bool) -> None:
        buf = self._buf
        if self._closed:
            raise ClosedResourceError("this send channel was closed")
        if not isinstance(item, buf.item_type):
            raise TypeError(f"this channel carries {buf.item_type.__name__}, got {type(item).__name__}")
        payload = msgspec.msgpack.encode(item)
        with buf.cond:
            while True:
                if self._closed:
                    raise ClosedResourceError("this send channel was closed")
                if buf.broken():
                    raise BrokenResourceError("every receive channel was closed (or its process died)")
                if buf.used() < buf.capacity:
                    buf.put(payload)
                    return
                if not block:
                    raise WouldBlock
                buf.waiting_send += 1
                try:
                    buf.cond.wait()
                finally:
                    buf.waiting_send -= 1

    def clone(self) -> BlockingSendChannel[T]:
        """Another send handle; end of stream waits for it to close too.

        Raises:
            ClosedResourceError: this handle was closed.
        """
        if self._closed:
            raise ClosedResourceError("cannot clone a closed send channel")
        return BlockingSendChannel(self._buf)

    def close(self) -> None:
        """Close this handle (idempotent); its blocked sends raise
        :class:`ClosedResourceError`. Once every send handle closed, receivers get
        :class:`EndOfStream` after the buffer is drained."""
        with self._buf.cond:
            if self._closed:
                return
            self._closed = True
            self._buf.close_sender()  # wakes this handle's blocked sends too

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's state: ``current_buffer_used`` counts the
        claimed items that receivers have not received yet; ``open_receive_channels``
        counts the address's receive slot until something attached;
        ``tasks_waiting_receive`` counts the takes waiting for items."""
        return self._buf.locked_statistics()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChannelHost:
    """Mixin for Ray actor classes (threaded, with concurrency groups) that own
    remote channels or receive from them. It needs no ``__init__`` call: its state
    is the process's, made on first use.

    Merge :data:`CHANNEL_CONCURRENCY_GROUPS` into the class's
    ``concurrency_groups``. The ``channel_*`` methods are the calls receive handles
    make to their owner, in group ``channels``; ``channel_watch``, in group
    ``channel_watch``, is how an owner learns that a receiving process died.
    Every receive handle's call names the handle's attach call among ``after``:
    Ray runs a call only once its ``ObjectRef`` arguments are ready, so the owner
    never sees a handle before it attached.
    """

    @ray.method(concurrency_group="channels")
    def channel_attach(self, channel_id: int, receiver_id: str, watcher: Any, watcher_id: str | None) -> bool:
        """Attach receive handle ``receiver_id``, watching its process (actor
        ``watcher``; None for the driver). False if every receive handle of the
        channel had already closed."""
        host = _this_host()
        buf = host.buffer(channel_id)
        if buf is None:
            return False
        with buf.cond:
            attached = buf.attach(receiver_id, watcher_id)
        if attached and watcher_id is not None and watcher_id != host.actor_id:
            host.watch(watcher, watcher_id, channel_id, receiver_id)
        return attached

    @ray.method(concurrency_group="channels")
    def channel_take(self, channel_id: int, receiver_id: str, take_id: int, acked_through: int,
                     max_items: int, *after: object) -> TakeReply:
        """Ack deliveries up to ``acked_through``, then claim up to ``max_items``
        items and return every claim of the handle not yet acked.

        Waits for an item; unblocked by a send, by the last send handle closing
        (``end`` once nothing is buffered or claimed), by an abandon of this take
        or a newer take (``stale``) or by the handle closing (``closed``).
        """
        buf = _this_host().buffer(channel_id)
        if buf is None:
            return TakeReply(status="closed")
        with buf.cond:
            return buf.take(receiver_id, take_id, acked_through, max_items)

    @ray.method(concurrency_group="channels")
    def channel_ack(self, channel_id: int, receiver_id: str, acked_through: int, *after: object) -> None:
        """The handle received every delivery up to ``acked_through``: free their slots."""
        buf = _this_host().buffer(channel_id)
        if buf is not None:
            with buf.cond:
                buf.ack(receiver_id, acked_through)

    @ray.method(concurrency_group="channels")
    def channel_abandon(self, channel_id: int, receiver_id: str, take_id: int, acked_through: int,
                        *after: object) -> None:
        """The receive that sent take ``take_id`` was cancelled: give its claims back
        to the channel (the take, if still waiting or not yet run, returns ``stale``)."""
        buf = _this_host().buffer(channel_id)
        if buf is not None:
            with buf.cond:
                buf.abandon(receiver_id, take_id, acked_through)

    @ray.method(concurrency_group="channels")
    def channel_close_receiver(self, channel_id: int, receiver_id: str, acked_through: int,
                               *after: object) -> None:
        """Detach a closed receive handle; its claims not acked go back. ``after``
        also names the attach calls of the handle's clones, so that they count
        before this handle stops counting."""
        host = _this_host()
        buf = host.buffer(channel_id)
        if buf is None:
            return
        with buf.cond:
            receiver = buf.close_receiver(receiver_id, acked_through)
        if receiver is not None and receiver.watcher_id is not None:
            host.unwatch(receiver.watcher_id, channel_id, receiver_id)

    @ray.method(concurrency_group="channel_watch")
    def channel_watch(self) -> None:
        """Never returns while this process lives: the call fails with
        ``RayActorError`` when it dies, which is how an owner learns of it."""
        threading.Event().wait()


def open_remote_channel(item_type: type[T], capacity: float) -> tuple[BlockingSendChannel[T], ChannelAddress[T]]:
    """Open a channel whose buffer lives in this actor process.

    Call it inside a Ray actor whose class inherits :class:`ChannelHost`. Hand
    ``address`` to the receiving process (the driver or another actor) and open it
    there with ``open_receiver``; until then the address's receive slot keeps the
    channel open for senders.

    Args:
        item_type: the class of the items (a msgspec Struct); ``send`` rejects
            other types.
        capacity: items buffered (or claimed and not yet received) before ``send``
            blocks: an integer >= 1, or ``math.inf``.

    Returns:
        ``(send, address)``.

    Raises:
        ConfigError: not called inside an actor, the actor's class does not
            inherit ChannelHost, ``item_type`` is not a class, or ``capacity`` is
            0, negative, NaN or a non-integer finite number.
    """
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        raise ConfigError(
            "open_remote_channel must be called inside a Ray actor (the buffer lives in the "
            "sending process); in the driver, use open_channel"
        )
    owner = ray.get_runtime_context().current_actor
    if not hasattr(owner, "channel_take"):
        raise ConfigError(
            "open_remote_channel: the actor's class must inherit channels.ChannelHost, with "
            "CHANNEL_CONCURRENCY_GROUPS merged into its concurrency_groups"
        )
    if not isinstance(item_type, type):
        raise ConfigError(f"item_type must be a class (a msgspec Struct), got {item_type!r}")
    if capacity == 0:
        raise ConfigError(
            "capacity=0 (a rendezvous channel) is not supported: a cancelled receive must "
            "leave its item in a buffer; use capacity=1"
        )
    if capacity != math.inf and (not float(capacity).is_integer() or capacity < 1):
        raise ConfigError(f"capacity must be an integer >= 1 or math.inf, got {capacity!r}")
    cid, buf = _this_host().open(item_type, capacity)
    return BlockingSendChannel(buf), ChannelAddress(owner=owner, channel_id=cid, item_type=item_type)
