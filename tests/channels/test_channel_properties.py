"""Stateful property test of the channel contract under cancellation.

A hypothesis state machine drives one real channel on a real asyncio event loop,
stepped by hand: several send handles (each a sequential producer of numbered
items) and receive handles, random capacity, and rules that start sends and
receives, cancel pending ones, close handles and run the loop a little or until
it is idle. A reference model records what was sent and what came out; the
invariants compare the two after every step.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from channels import (
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    ReceiveChannel,
    SendChannel,
    WouldBlock,
    open_channel,
)

T = TypeVar("T")
Item = tuple[int, int]  # (sender index, sequence number of that sender)
MAX_RECEIVES = 6
PICK = st.integers(0, 5)  # which handle or task a rule acts on, modulo how many there are


class ChannelMachine(RuleBasedStateMachine):
    """One channel, its handles, the tasks in flight and the reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.senders: list[SendChannel[Item]] = []
        self.receivers: list[ReceiveChannel[Item]] = []
        self.send_closed: list[bool] = []
        self.receive_closed: list[bool] = []
        self.next_seq: list[int] = []
        self.sending: dict[int, asyncio.Task[Any]] = {}  # sender index -> its pending send
        self.item_of: dict[asyncio.Task[Any], Item] = {}
        self.receiving: dict[asyncio.Task[Any], int] = {}  # pending receive -> its handle
        self.cancel_requested: set[asyncio.Task[Any]] = set()
        self.attempted: set[Item] = set()
        self.sent: list[Item] = []        # sends that completed, in completion order
        self.delivered: list[Item] = []   # items received, in the order they left the channel
        self.unsent: set[Item] = set()    # sends that were cancelled or failed
        self.dropped: list[Item] = []     # buffered when the last receive handle closed

    # -- plumbing ------------------------------------------------------------

    @property
    def capacity(self) -> float:
        return self.senders[0].statistics().max_buffer_size

    def buffered(self) -> int:
        return self.senders[0].statistics().current_buffer_used

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self.loop.create_task(coro, name=name)

    def run_rounds(self, rounds: int) -> None:
        for _ in range(rounds):
            self.loop.run_until_complete(asyncio.sleep(0))
        self.harvest()

    def run_until_idle(self) -> None:
        # Every link of a wake-up chain finishes a task or leaves it parked, so a
        # few rounds per pending task are enough to reach a state where none is ready.
        self.run_rounds(2 * (len(self.sending) + len(self.receiving)) + 4)

    def harvest(self) -> None:
        """Take finished tasks off the pending lists and check how they ended."""
        for i, task in list(self.sending.items()):
            if task.done():
                del self.sending[i]
                self.check_outcome(task, self.send_closed[i], BrokenResourceError)
                if task.cancelled() or task.exception() is not None:
                    self.unsent.add(self.item_of[task])
        for task, j in list(self.receiving.items()):
            if task.done():
                del self.receiving[task]
                self.check_outcome(task, self.receive_closed[j], EndOfStream)

    def check_outcome(self, task: asyncio.Task[Any], handle_closed: bool, other_end_gone: type) -> None:
        if task in self.cancel_requested:
            assert task.cancelled(), "a cancelled call completed"
            return
        assert not task.cancelled()
        exc = task.exception()
        if isinstance(exc, ClosedResourceError):
            assert handle_closed, "ClosedResourceError on an open handle"
        elif isinstance(exc, BrokenResourceError):
            assert other_end_gone is BrokenResourceError and not self.open_receivers()
        elif exc is not None and not isinstance(exc, other_end_gone):  # EndOfStream: see _receive
            raise exc

    async def _send(self, i: int, item: Item) -> None:
        await self.senders[i].send(item)
        self.sent.append(item)  # no await since the item entered the buffer
        assert self.buffered() <= self.capacity

    async def _receive(self, receiver: ReceiveChannel[Item]) -> Item:
        try:
            item = await receiver.receive()
        except EndOfStream:
            self.check_end_of_stream()
            raise
        self.delivered.append(item)  # no await since the item left the buffer
        return item

    def check_end_of_stream(self) -> None:
        assert all(self.send_closed), "EndOfStream while a send handle is open"
        assert self.buffered() == 0, "EndOfStream with items buffered"

    def new_item(self, i: int) -> Item:
        item = (i, self.next_seq[i])
        self.next_seq[i] += 1
        self.attempted.add(item)
        return item

    def idle_senders(self) -> list[int]:
        return [i for i, closed in enumerate(self.send_closed) if not closed and i not in self.sending]

    def open_receivers(self) -> list[int]:
        return [j for j, closed in enumerate(self.receive_closed) if not closed]

    def pending(self) -> list[asyncio.Task[Any]]:
        return [*self.sending.values(), *self.receiving]

    def cancel_task(self, task: asyncio.Task[Any]) -> None:
        task.cancel()
        self.cancel_requested.add(task)

    def close_handle(self, end: str, k: int) -> None:
        if end == "send":
            self.send_closed[k] = True
            self.senders[k].close()
            return
        self.receive_closed[k] = True
        if not self.open_receivers():
            self.dropped = self.sent[len(self.delivered):]
        self.receivers[k].close()

    # -- rules -----------------------------------------------------------------

    @initialize(
        capacity=st.sampled_from([1, 2, 3, math.inf]),
        n_senders=st.integers(1, 3),
        n_receivers=st.integers(1, 3),
    )
    def open(self, capacity: float, n_senders: int, n_receivers: int) -> None:
        send, receive = open_channel[Item](capacity, item_type=tuple)
        self.senders = [send, *(send.clone() for _ in range(n_senders - 1))]
        self.receivers = [receive, *(receive.clone() for _ in range(n_receivers - 1))]
        self.send_closed = [False] * n_senders
        self.receive_closed = [False] * n_receivers
        self.next_seq = [0] * n_senders

    @precondition(lambda self: self.idle_senders())
    @rule(pick=PICK, tasks=st.integers(0, 2))
    def send(self, pick: int, tasks: int) -> None:
        """Start a ``send`` of their next item on ``tasks`` idle senders and let them
        run until they wait; with ``tasks=0``, ``send_nowait`` on one."""
        idle = self.idle_senders()
        if tasks == 0:
            self.send_nowait(_pick(idle, pick))
            return
        for k in range(min(tasks, len(idle))):
            i = _pick(idle, pick + k)
            item = self.new_item(i)
            self.sending[i] = self.spawn(self._send(i, item), name=f"send{item}")
            self.item_of[self.sending[i]] = item
        self.run_rounds(1)

    @precondition(lambda self: self.open_receivers() and len(self.receiving) < MAX_RECEIVES)
    @rule(pick=PICK, tasks=st.integers(0, 2))
    def receive(self, pick: int, tasks: int) -> None:
        """Start ``tasks`` receives, on successive open handles, and let them run
        until they wait; with ``tasks=0``, ``receive_nowait`` on one handle."""
        handles = self.open_receivers()
        if tasks == 0:
            self.receive_nowait(_pick(handles, pick))
            return
        for k in range(tasks):
            j = _pick(handles, pick + k)
            self.receiving[self.spawn(self._receive(self.receivers[j]), name=f"receive{j}")] = j
        self.run_rounds(1)

    def send_nowait(self, i: int) -> None:
        item = self.new_item(i)
        try:
            self.senders[i].send_nowait(item)
        except WouldBlock:  # only a full buffer refuses, and only while someone can receive
            assert self.open_receivers(), "WouldBlock after every receive handle closed"
            assert self.buffered() == self.capacity, "WouldBlock with room in the buffer"
            self.unsent.add(item)
            return
        except BrokenResourceError:
            assert not self.open_receivers(), "BrokenResourceError with a receive handle open"
            self.unsent.add(item)
            return
        assert self.open_receivers(), "an item was accepted after every receive handle closed"
        self.sent.append(item)

    def receive_nowait(self, j: int) -> None:
        try:
            self.delivered.append(self.receivers[j].receive_nowait())
        except WouldBlock:
            assert self.buffered() == 0
        except EndOfStream:
            self.check_end_of_stream()

    @precondition(lambda self: self.pending())
    @rule(pick=PICK)
    def cancel(self, pick: int) -> None:
        self.cancel_task(_pick(self.pending(), pick))

    @precondition(lambda self: not all(self.send_closed) or self.open_receivers())
    @rule(pick=PICK)
    def close(self, pick: int) -> None:
        """Close an open send or receive handle."""
        handles = [("send", i) for i, c in enumerate(self.send_closed) if not c]
        handles += [("receive", j) for j in self.open_receivers()]
        self.close_handle(*_pick(handles, pick))

    @precondition(lambda self: (self.receiving and self.idle_senders()) or (self.sending and self.open_receivers()))
    @rule(pick=PICK, by_closing=st.booleans(), settle=st.booleans())
    def wake_a_waiter_and_interrupt_it(self, pick: int, by_closing: bool, settle: bool) -> None:
        """Steer towards the race that matters: make an item (or a free slot)
        available, which wakes a waiting receive (or send), then cancel the oldest
        waiter or close its handle before it runs; ``settle`` checks the outcome at
        once, before a later step can hide a lost wake-up."""
        wake_receiver = bool(self.receiving and self.idle_senders())
        wake_sender = bool(self.sending and self.open_receivers())
        task: asyncio.Task[Any]
        if wake_receiver and not (wake_sender and pick % 2):
            self.send_nowait(_pick(self.idle_senders(), pick))
            task, j = next(iter(self.receiving.items()))  # the oldest
            handle = ("receive", j)
        else:
            self.receive_nowait(_pick(self.open_receivers(), pick))
            i, task = next(iter(self.sending.items()))
            handle = ("send", i)
        if by_closing:
            self.close_handle(*handle)
        else:
            self.cancel_task(task)
        if settle:
            self.run_until_idle_and_check_nobody_waits_in_vain()

    @rule(rounds=st.integers(1, 3))
    def run_a_little(self, rounds: int) -> None:
        self.run_rounds(rounds)

    @rule()
    def run_until_idle_and_check_nobody_waits_in_vain(self) -> None:
        self.run_until_idle()
        assert not any(t in self.cancel_requested for t in self.pending()), "cancelled task still pending"
        if self.receiving:  # a receive waits only for an item that is not there
            assert self.buffered() == 0 and not all(self.send_closed)
        if self.sending:  # a send waits only for room that is not there
            assert self.buffered() == self.capacity and self.open_receivers()
        assert all(not self.send_closed[i] for i in self.sending)
        assert all(not self.receive_closed[j] for j in self.receiving.values())

    # -- invariants ------------------------------------------------------------

    @invariant()
    def items_leave_once_in_order(self) -> None:
        if not self.senders:
            return
        assert len(set(self.delivered)) == len(self.delivered), "an item was delivered twice"
        assert set(self.sent) <= self.attempted and not set(self.sent) & self.unsent
        # One FIFO: the k-th item out is the k-th item in (hence per-sender order too).
        assert self.delivered == self.sent[: len(self.delivered)]
        for i in range(len(self.senders)):
            seqs = [seq for s, seq in self.delivered if s == i]
            assert seqs == sorted(seqs)

    @invariant()
    def buffer_holds_exactly_the_sent_undelivered_items(self) -> None:
        if not self.senders:
            return
        assert self.buffered() <= self.capacity
        expected = len(self.sent) - len(self.delivered) if self.open_receivers() else 0
        assert self.buffered() == expected

    def teardown(self) -> None:
        try:
            if self.senders:
                self.drain()
        finally:
            for task in self.pending():
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

    def drain(self) -> None:
        """Close every sender; then each completed send was received exactly once."""
        self.run_until_idle_and_check_nobody_waits_in_vain()
        for i, sender in enumerate(self.senders):
            self.send_closed[i] = True
            sender.close()
        self.run_until_idle()
        assert not self.pending(), "a task still waits after every sender closed"
        for j in self.open_receivers():
            while True:
                try:
                    self.delivered.append(self.receivers[j].receive_nowait())
                except EndOfStream:
                    break
        self.items_leave_once_in_order()
        assert sorted(self.delivered + self.dropped) == sorted(self.sent)


def _pick(options: list[T], pick: int) -> T:
    return options[pick % len(options)]


# Short runs, many of them: a lost wake-up is hidden by the next item sent, so the
# checks at the end of a run (and ``settle``) find more than long runs do. ~5 s on
# the 2-core CI machine.
ChannelMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=20, deadline=None)
TestChannelStateMachine = ChannelMachine.TestCase
