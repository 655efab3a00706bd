"""Typed in-process channels, after trio's memory channels and anyio's memory
object streams.

``send, receive = open_channel[Item](capacity)`` gives the two ends of a bounded
FIFO. Contract:

- The buffer holds at most ``capacity`` items (an integer >= 1, or ``math.inf``).
  ``send`` waits while it is full (backpressure) and is woken by a receive;
  ``receive`` waits while it is empty and is woken by a send or by the last sender
  closing (then it raises :class:`EndOfStream` once the buffer is drained).
- Items come out in the order they went in; waiting tasks are woken first come,
  first served (a ``*_nowait`` call may still take an item or a free slot first).
- Cancellation-safe: a cancelled ``receive`` took no item and a cancelled ``send``
  sent none; the channel is as if the call never happened. No item is lost or
  duplicated.
- ``clone()`` makes another handle of the same end; end of stream comes only after
  every send handle closed, and senders see :class:`BrokenResourceError` once every
  receive handle closed (buffered items are then dropped).
- Using a handle after closing it raises :class:`ClosedResourceError`, and so do
  the calls waiting on that handle when it closes.

How cancellation-safety is kept: on asyncio, resolving a waiter's future and
cancelling the waiting task cannot be made atomic, so a suspended task never takes
part in a transfer. Waiters park on a wake-up future; whoever makes an item (or a
free slot) available wakes one; the woken task, once it runs, moves the item
itself with no ``await`` in between. A waiter cancelled or closed after its wake-up
passes the wake-up on. This is why ``capacity=0`` (a rendezvous) is not offered.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from channels._errors import (
    BrokenResourceError,
    ClosedResourceError,
    ConfigError,
    EndOfStream,
    WouldBlock,
)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ChannelStatistics:
    """A snapshot of a channel's state. A task that was woken but has not run yet no
    longer counts as waiting."""

    current_buffer_used: int
    max_buffer_size: float
    open_send_channels: int
    open_receive_channels: int
    tasks_waiting_send: int
    tasks_waiting_receive: int


def _woken(fut: asyncio.Future[None]) -> bool:
    """Whether ``fut`` carries a wake-up (not a cancellation or a close)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


class _Waiters:
    """Tasks parked in ``send`` (or ``receive``), woken first come, first served.

    A woken waiter leaves the queue; it acts when it runs, or if it cannot act
    (cancelled, or its handle closed) it hands the wake-up to the next waiter.
    """

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._queue: deque[asyncio.Future[None]] = deque()
        self._ready = ready  # whether a woken waiter would find what it waits for

    def waiting(self) -> int:
        return sum(1 for fut in self._queue if not fut.done())

    def wake_one(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():  # a cancelled one is still queued until its task runs
                fut.set_result(None)
                return

    def wake_all(self) -> None:
        while self._queue:
            self.wake_one()

    def pass_on(self) -> None:
        """Give a wake-up that will not be used to the next waiter, if it is still good."""
        if self._ready():
            self.wake_one()

    async def park(self, mine: set[asyncio.Future[None]], *, front: bool) -> None:
        """Wait for a wake-up; ``front`` re-queues a waiter that was woken for nothing."""
        fut = asyncio.get_running_loop().create_future()
        (self._queue.appendleft if front else self._queue.append)(fut)
        mine.add(fut)
        try:
            await fut
        except BaseException:
            if _woken(fut):
                self.pass_on()
            else:
                with suppress(ValueError):  # already gone if its handle closed it
                    self._queue.remove(fut)
            raise
        finally:
            mine.discard(fut)

    def close_handle(self, mine: set[asyncio.Future[None]], what: str) -> None:
        """Fail the waiters of a handle that closed; wake-ups they got go on."""
        woken = [fut for fut in mine if _woken(fut)]
        for fut in mine:
            if not fut.done():
                self._queue.remove(fut)
                fut.set_exception(ClosedResourceError(f"this {what} channel was closed"))
        for _ in woken:
            self.pass_on()


class _State:
    """What the handles of one channel share."""

    def __init__(self, capacity: float, item_type: type | None) -> None:
        self.capacity = capacity
        self.item_type = item_type
        self.buffer: deque[Any] = deque()
        self.open_send = 0
        self.open_receive = 0
        self.receivers = _Waiters(ready=lambda: bool(self.buffer))
        self.senders = _Waiters(ready=lambda: len(self.buffer) < self.capacity)

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(
            current_buffer_used=len(self.buffer),
            max_buffer_size=self.capacity,
            open_send_channels=self.open_send,
            open_receive_channels=self.open_receive,
            tasks_waiting_send=self.senders.waiting(),
            tasks_waiting_receive=self.receivers.waiting(),
        )


class _Handle:
    """What both ends have: closing, statistics, ``async with``."""

    def __init__(self, state: _State) -> None:
        self._state = state
        self._closed = False
        self._waiting: set[asyncio.Future[None]] = set()  # of the tasks parked on this handle

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Async form of :meth:`close`."""
        self.close()

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's state."""
        return self._state.statistics()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class SendChannel(_Handle, Generic[T]):
    """The sending end of a channel. Create with :class:`open_channel`."""

    def __init__(self, state: _State) -> None:
        super().__init__(state)
        state.open_send += 1

    def send_nowait(self, item: T) -> None:
        """Put ``item`` in the buffer if it has room, and wake one waiting receiver.

        Raises:
            WouldBlock: the buffer is full.
            BrokenResourceError: every receive handle closed.
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
        if len(st.buffer) >= st.capacity:
            raise WouldBlock
        st.buffer.append(item)
        st.receivers.wake_one()

    async def send(self, item: T) -> None:
        """Send ``item``, waiting while the buffer is full.

        Waits for room in the buffer; unblocked by a receive, by every receive
        handle closing (raises :class:`BrokenResourceError`) or by this handle
        closing (raises :class:`ClosedResourceError`). Cancelled, it sent nothing.
        Raises what :meth:`send_nowait` raises, except :class:`WouldBlock`.
        """
        requeued = False
        while True:
            try:
                self.send_nowait(item)
                return
            except WouldBlock:
                pass
            await self._state.senders.park(self._waiting, front=requeued)
            requeued = True

    def clone(self) -> SendChannel[T]:
        """Another send handle; end of stream waits for it to close too.

        Raises:
            ClosedResourceError: this handle was closed.
        """
        if self._closed:
            raise ClosedResourceError("cannot clone a closed send channel")
        return SendChannel(self._state)

    def close(self) -> None:
        """Close this handle (idempotent); its waiting sends raise
        :class:`ClosedResourceError`. Once the last send handle closed, every
        waiting receiver is woken and gets :class:`EndOfStream` when the buffer is
        drained."""
        if self._closed:
            return
        self._closed = True
        st = self._state
        st.open_send -= 1
        st.senders.close_handle(self._waiting, "send")
        if st.open_send == 0:
            st.receivers.wake_all()


class ReceiveChannel(_Handle, Generic[T]):
    """The receiving end of a channel. Create with :class:`open_channel`.

    ``async for item in receive`` receives until :class:`EndOfStream`.
    """

    def __init__(self, state: _State) -> None:
        super().__init__(state)
        state.open_receive += 1

    def receive_nowait(self) -> T:
        """Take the oldest buffered item, and wake one waiting sender.

        Raises:
            WouldBlock: nothing is buffered and a send handle is open.
            EndOfStream: every send handle closed and the buffer is empty.
            ClosedResourceError: this handle was closed.
        """
        st = self._state
        if self._closed:
            raise ClosedResourceError("this receive channel was closed")
        if st.buffer:
            item = st.buffer.popleft()
            st.senders.wake_one()
            return item
        if st.open_send == 0:
            raise EndOfStream
        raise WouldBlock

    async def receive(self) -> T:
        """The next item, waiting while the channel is empty.

        Waits for an item; unblocked by a send, by the last send handle closing
        (raises :class:`EndOfStream` once the buffer is drained) or by this handle
        closing (raises :class:`ClosedResourceError`). Cancelled, it took nothing.
        """
        requeued = False
        while True:
            try:
                return self.receive_nowait()
            except WouldBlock:
                pass
            await self._state.receivers.park(self._waiting, front=requeued)
            requeued = True

    def clone(self) -> ReceiveChannel[T]:
        """Another receive handle (each item goes to one of them).

        Raises:
            ClosedResourceError: this handle was closed.
        """
        if self._closed:
            raise ClosedResourceError("cannot clone a closed receive channel")
        return ReceiveChannel(self._state)

    def close(self) -> None:
        """Close this handle (idempotent); its waiting receives raise
        :class:`ClosedResourceError`. Once the last receive handle closed,
        buffered items are dropped and every waiting sender is woken and gets
        :class:`BrokenResourceError`."""
        if self._closed:
            return
        self._closed = True
        st = self._state
        st.open_receive -= 1
        st.receivers.close_handle(self._waiting, "receive")
        if st.open_receive == 0:
            st.buffer.clear()
            st.senders.wake_all()

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.receive()
            except EndOfStream:
                return


class open_channel(tuple[SendChannel[T], ReceiveChannel[T]]):
    """Open a channel: ``send, receive = open_channel[Item](capacity)``.

    Args:
        capacity: items buffered before ``send`` waits: an integer >= 1, or
            ``math.inf`` for an unbounded queue.
        item_type: when given, ``send`` rejects items of other types.

    Raises:
        ConfigError: (a ValueError) ``capacity`` is 0, negative, NaN or a
            non-integer finite number.
    """

    def __new__(cls, capacity: float, *, item_type: type | None = None) -> tuple[SendChannel[T], ReceiveChannel[T]]:  # type: ignore[misc]
        if capacity == 0:
            raise ConfigError(
                "capacity=0 (a rendezvous channel) is not supported: on asyncio a hand-off "
                "to a waiting task cannot be made atomic with that task's cancellation, so "
                "it cannot be cancellation-safe; use capacity=1"
            )
        if capacity != math.inf and (not float(capacity).is_integer() or capacity < 1):
            raise ConfigError(f"capacity must be an integer >= 1 or math.inf, got {capacity!r}")
        state = _State(capacity=capacity, item_type=item_type)
        return SendChannel(state), ReceiveChannel(state)
