"""Typed channels across Ray processes: the receiving end, in any process.

``receive = open_receiver(address)`` opens the receiving end of a channel opened
with ``open_remote_channel`` in another process (its owner). ``receive()`` takes
items from a local cache that each round trip to the owner refills with up to a
batch of them; the owner keeps counting them against the channel's capacity
until ``receive()`` has handed them out (see ``channels._remote_buffer``).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any, Generic, Self, TypeVar

import msgspec
import ray
from ray.exceptions import RayActorError

from channels._errors import ClosedResourceError, ConfigError, EndOfStream, SenderDiedError
from channels._remote import ChannelAddress
from channels._remote_buffer import TakeReply

T = TypeVar("T")


def _fire(ref: Any) -> None:
    """Let a call run without waiting for it. Its failure (the owner died) is
    retrieved, so that Ray does not log it as an unhandled error."""
    fut: Future[Any] = ref.future()
    fut.add_done_callback(lambda f: f.exception())


def _sender_died(err: RayActorError) -> SenderDiedError:
    lines = str(err).strip().splitlines()
    return SenderDiedError("the process that owns this channel's buffer died: " + "\n".join(lines[:8]))


class RemoteReceiveChannel(Generic[T]):
    """The receiving end of a remote channel. Create with :func:`open_receiver`.

    Use it from one event loop (it is not thread-safe). ``async for item in
    receive`` receives until :class:`EndOfStream`; ``async with`` closes it.
    """

    def __init__(self, address: ChannelAddress[T], *, max_batch: int) -> None:
        self._address = address
        self._max_batch = max_batch
        self._id = uuid.uuid4().hex
        self._decoder = msgspec.msgpack.Decoder(address.item_type)
        self._cache: deque[tuple[int, bytes]] = deque()  # (delivery number, payload)
        self._acked = 0  # delivery number of the last item receive() handed out
        self._take_ids = itertools.count(1)
        self._taking = asyncio.Lock()  # one take in flight per handle
        self._pending: asyncio.Future[TakeReply] | None = None  # that take
        self._ended = False
        self._closed = False
        self._close_ref: Any = None
        self._clones: list[Any] = []  # their attach calls, which must run before our close
        ctx = ray.get_runtime_context()
        watcher_id = ctx.get_actor_id()
        watcher = ctx.current_actor if watcher_id is not None else None
        # Every later call of this handle names this one in its arguments: Ray runs
        # a call only once its ObjectRef arguments are ready.
        self._attached = address.owner.channel_attach.remote(address.channel_id, self._id, watcher, watcher_id)

    async def receive(self) -> T:
        """The next item, waiting while the channel is empty.

        Waits for an item; unblocked by a send, by the last send handle closing
        (raises :class:`EndOfStream` once every item was received), by this handle
        closing (raises :class:`ClosedResourceError`) or by the owner process
        dying (raises :class:`SenderDiedError`). Cancelled, it took nothing: an
        item the owner had already handed to this receive goes back to the
        channel, for any receiver.

        Raises:
            EndOfStream: every send handle closed and every item was received.
            ClosedResourceError: this handle was closed, or the channel's receive
                side had closed before this handle attached.
            SenderDiedError: the owner process died.
        """
        self._check_open()
        if self._cache:
            return self._pop()
        async with self._taking:  # behind another receive of this handle
            while not self._cache:
                self._check_open()
                if self._ended:
                    raise EndOfStream
                await self._take()
            return self._pop()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("this receive channel was closed")

    def _pop(self) -> T:
        delivery, payload = self._cache.popleft()
        self._acked = delivery
        if not self._cache:  # free the slots now, not at the next take
            a = self._address
            _fire(a.owner.channel_ack.remote(a.channel_id, self._id, delivery, self._attached))
        return self._decoder.decode(payload)

    async def _take(self) -> None:
        """One round trip to the owner: fill the cache or set ``_ended``."""
        a, take_id = self._address, next(self._take_ids)
        ref = a.owner.channel_take.remote(a.channel_id, self._id, take_id, self._acked,
                                          self._max_batch, self._attached)
        self._pending = asyncio.wrap_future(ref.future())
        try:
            reply = await self._pending
        except asyncio.CancelledError:
            _fire(a.owner.channel_abandon.remote(a.channel_id, self._id, take_id, self._acked, self._attached))
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise ClosedResourceError("this receive channel was closed while receiving") from None
            raise
        except RayActorError as e:
            raise _sender_died(e) from e
        finally:
            self._pending = None
        if reply.status == "items":
            self._cache.extend(reply.items)
        elif reply.status == "end":
            self._ended = True
        elif reply.status == "closed":
            raise ClosedResourceError(
                "this receive channel is not attached: every receive handle of the channel "
                "had closed (or died) before it opened"
            )

    def clone(self) -> RemoteReceiveChannel[T]:
        """Another receive handle in this process (each item goes to one of them).

        Raises:
            ClosedResourceError: this handle was closed.
        """
        self._check_open()
        twin = RemoteReceiveChannel(self._address, max_batch=self._max_batch)
        self._clones.append(twin._attached)
        return twin

    def close(self) -> None:
        """Close this handle (idempotent). Its waiting receive raises
        :class:`ClosedResourceError`; the items it had cached go back to the
        channel. Once every receive handle closed, senders get
        :class:`BrokenResourceError`. Does not wait for the owner: see :meth:`aclose`."""
        if self._closed:
            return
        self._closed = True
        self._cache.clear()
        if self._pending is not None:
            self._pending.cancel()
        a = self._address
        self._close_ref = a.owner.channel_close_receiver.remote(
            a.channel_id, self._id, self._acked, self._attached, *self._clones)
        _fire(self._close_ref)

    async def aclose(self) -> None:
        """Close this handle and wait until the owner has detached it (returns at
        once if the owner died)."""
        self.close()
        try:
            await self._close_ref
        except RayActorError:
            pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.receive()
            except EndOfStream:
                return


def open_receiver(address: ChannelAddress[T], *, max_batch: int = 16) -> RemoteReceiveChannel[T]:
    """Open the receiving end of a remote channel, in this process.

    The first open of an address takes the receive slot the channel was opened
    with; each further open (or ``clone()``) adds a receive handle. Inside an
    actor, the owner watches this process and closes its handles if it dies.
    Returns at once: attaching to the owner runs in the background, and the first
    ``receive()`` reports a failure.

    Args:
        address: from ``open_remote_channel`` in the owner process.
        max_batch: most items one round trip to the owner fetches (and keeps
            counted against capacity until received).

    Raises:
        ConfigError: ``max_batch`` < 1, Ray is not initialized, or called inside
            an actor whose class does not inherit ChannelHost (its death could not
            be watched).
    """
    if max_batch < 1:
        raise ConfigError(f"max_batch must be >= 1, got {max_batch!r}")
    if not ray.is_initialized():
        raise ConfigError("open_receiver needs Ray: call ray.init() first")
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is not None and not hasattr(ctx.current_actor, "channel_watch"):
        raise ConfigError(
            "open_receiver inside an actor needs the actor's class to inherit channels.ChannelHost "
            "(with CHANNEL_CONCURRENCY_GROUPS merged into its concurrency_groups), so that the "
            "channel's owner learns if this process dies"
        )
    return RemoteReceiveChannel(address, max_batch=max_batch)
