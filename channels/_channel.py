"""Typed in-process channels, after trio's memory channels and anyio's memory
object streams.

``send, receive = open_channel[Item](capacity)`` gives the two ends of a bounded
FIFO. Contract:

- ``send`` waits while the buffer is full (backpressure) and is woken by a receive;
  ``receive`` waits while it is empty and is woken by a send or by the last sender
  closing (then it raises :class:`EndOfStream`).
- A cancelled ``send`` or ``receive`` leaves the channel as it was: no item is lost
  or duplicated.
- ``clone()`` makes another handle of the same end; end of stream comes only after
  every send handle closed, and senders see :class:`BrokenResourceError` once every
  receive handle closed.
- Using a handle after closing it raises :class:`ClosedResourceError`.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from channels._errors import (
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ChannelStatistics:
    """A snapshot of a channel's state."""

    current_buffer_used: int
    max_buffer_size: float
    open_send_channels: int
    open_receive_channels: int
    tasks_waiting_send: int
    tasks_waiting_receive: int


@dataclass(eq=False)
class _State:
    capacity: float
    item_type: type | None
    buffer: deque[Any] = field(default_factory=deque)
    senders: dict[asyncio.Future[None], Any] = field(default_factory=dict)
    receivers: deque[asyncio.Future[Any]] = field(default_factory=deque)
    open_send: int = 0
    open_receive: int = 0

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(
            current_buffer_used=len(self.buffer),
            max_buffer_size=self.capacity,
            open_send_channels=self.open_send,
            open_receive_channels=self.open_receive,
            tasks_waiting_send=len(self.senders),
            tasks_waiting_receive=len(self.receivers),
        )


class SendChannel(Generic[T]):
    """The sending end of a channel. Create with :class:`open_channel`."""

    def __init__(self, state: _State) -> None:
        self._state = state
        self._closed = False
        state.open_send += 1

    def send_nowait(self, item: T) -> None:
        """Send without waiting.

        Raises:
            WouldBlock: the buffer is full and no receiver waits.
            BrokenResourceError: every receiver closed.
            ClosedResourceError: this handle was closed.
            TypeError: ``item`` is not of the channel's item type.
        """
        st = self._state
        if self._closed:
            raise ClosedResourceError("this send channel was closed")
        if st.open_receive == 0:
            raise BrokenResourceError("every receive channel was closed")
        if st.item_type is not None and not isinstance(item, st.item_type):
            raise TypeError(f"this channel carries {st.item_type.__name__}, got {type(item).__name__}")
        while st.receivers:
            fut = st.receivers.popleft()
            if not fut.done():
                fut.set_result(item)
                return
        if len(st.buffer) < st.capacity:
            st.buffer.append(item)
            return
        raise WouldBlock

    async def send(self, item: T) -> None:
        """Send ``item``, waiting while the buffer is full.

        Waits for a receive to make room; unblocked by a receive, or by every
        receiver closing (then raises :class:`BrokenResourceError`).
        """
        try:
            self.send_nowait(item)
            return
        except WouldBlock:
            pass
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._state.senders[fut] = item
        try:
            await fut
        finally:
            # Whether woken, cancelled or broken, the waiter entry goes away. A
            # receiver that took the item already removed it and resolved fut.
            self._state.senders.pop(fut, None)

    def clone(self) -> SendChannel[T]:
        """Another send handle; end of stream waits for it to close too."""
        if self._closed:
            raise ClosedResourceError("cannot clone a closed send channel")
        return SendChannel(self._state)

    def close(self) -> None:
        """Close this handle (idempotent). After the last send handle closes,
        receivers get :class:`EndOfStream` once the buffer is drained."""
        if self._closed:
            return
        self._closed = True
        st = self._state
        st.open_send -= 1
        if st.open_send == 0:
            while st.receivers:
                fut = st.receivers.popleft()
                if not fut.done():
                    fut.set_exception(EndOfStream())

    async def aclose(self) -> None:
        """Async form of :meth:`close`."""
        self.close()

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's state."""
        return self._state.statistics()

    async def __aenter__(self) -> SendChannel[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ReceiveChannel(Generic[T]):
    """The receiving end of a channel. Create with :class:`open_channel`."""

    def __init__(self, state: _State) -> None:
        self._state = state
        self._closed = False
        state.open_receive += 1

    def receive_nowait(self) -> T:
        """Receive without waiting.

        Raises:
            WouldBlock: nothing is buffered and senders remain.
            EndOfStream: every sender closed and the buffer is empty.
            ClosedResourceError: this handle was closed.
        """
        st = self._state
        if self._closed:
            raise ClosedResourceError("this receive channel was closed")
        if st.buffer:
            item = st.buffer.popleft()
            self._refill()
            return item
        if st.senders:
            fut, item = next(iter(st.senders.items()))
            del st.senders[fut]
            fut.set_result(None)
            return item
        if st.open_send == 0:
            raise EndOfStream
        raise WouldBlock

    def _refill(self) -> None:
        st = self._state
        while st.senders and len(st.buffer) < st.capacity:
            fut, item = next(iter(st.senders.items()))
            del st.senders[fut]
            if not fut.done():
                fut.set_result(None)
                st.buffer.append(item)

    async def receive(self) -> T:
        """The next item, waiting while the channel is empty.

        Waits for a send; unblocked by a send or by the last sender closing (then
        raises :class:`EndOfStream`). Cancelled, it leaves the channel unchanged.
        """
        try:
            return self.receive_nowait()
        except WouldBlock:
            pass
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._state.receivers.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # An item was handed over just as we were cancelled: put it back first.
                self._state.buffer.appendleft(fut.result())
            else:
                try:
                    self._state.receivers.remove(fut)
                except ValueError:
                    pass
            raise

    def clone(self) -> ReceiveChannel[T]:
        """Another receive handle (items go to one of them)."""
        if self._closed:
            raise ClosedResourceError("cannot clone a closed receive channel")
        return ReceiveChannel(self._state)

    def close(self) -> None:
        """Close this handle (idempotent). After the last receive handle closes,
        senders get :class:`BrokenResourceError` and buffered items are dropped."""
        if self._closed:
            return
        self._closed = True
        st = self._state
        st.open_receive -= 1
        if st.open_receive == 0:
            st.buffer.clear()
            for fut in list(st.senders):
                if not fut.done():
                    fut.set_exception(BrokenResourceError("every receive channel was closed"))
            st.senders.clear()

    async def aclose(self) -> None:
        """Async form of :meth:`close`."""
        self.close()

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's state."""
        return self._state.statistics()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.receive()
            except EndOfStream:
                return

    async def __aenter__(self) -> ReceiveChannel[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class open_channel(tuple[SendChannel[T], ReceiveChannel[T]]):
    """Open a channel: ``send, receive = open_channel[Item](capacity)``.

    Args:
        capacity: items buffered before ``send`` waits; 0 makes every send a
            rendezvous, ``math.inf`` an unbounded queue.
        item_type: when given, ``send`` rejects items of other types.

    Raises:
        ValueError: ``capacity`` is negative or a non-integer finite number.
    """

    def __new__(cls, capacity: float, *, item_type: type | None = None) -> tuple[SendChannel[T], ReceiveChannel[T]]:  # type: ignore[misc]
        if capacity != math.inf and (not float(capacity).is_integer() or capacity < 0):
            raise ValueError(f"capacity must be a non-negative integer or math.inf, got {capacity!r}")
        state = _State(capacity=capacity, item_type=item_type)
        return SendChannel(state), ReceiveChannel(state)
