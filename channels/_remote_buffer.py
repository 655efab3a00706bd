"""The buffer of a remote channel at its owner, and the claim/ack protocol that
keeps receives cancellation-safe across processes.

An item stays in the buffer, counted against ``capacity``, until a receiver has
really received it. Receivers *claim* items with a long-poll take that returns up
to a batch of them (the receiver caches them) and *ack* them once ``receive()``
handed them out. A receive cancelled while its take is in flight *abandons* the
take: that take's claims go back to the front of the buffer, in the order they
were sent, for any receiver; closing a receive handle gives back all its claims.

Ray may run calls of a threaded concurrency group out of order, so:

- each receive handle numbers its takes; a take older than one already seen, or
  than an abandon (which may arrive first), returns ``stale`` and claims nothing;
- a take returns every claim of its handle not yet acked (a take sent after a
  cancelled one delivers that one's claims again), and an abandon gives back only
  the claims whose newest take is the abandoned one or older;
- each claim carries a delivery number, per handle, that only grows (a claim
  given back and claimed again gets a new one); an ack says "received every
  delivery up to N", so one that arrives late cannot drop an item the handle has
  not received.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from channels._channel import ChannelStatistics


class TakeReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The owner's answer to a take."""

    status: Literal["items", "end", "closed", "stale"]
    """``items``: the handle's claims; ``end``: end of stream; ``closed``: the handle
    is not (or no longer) attached; ``stale``: a newer take or an abandon replaced
    this one."""
    items: list[tuple[int, bytes]] = []
    """``(delivery number, msgpack-encoded item)`` of every claim of the handle not
    yet acked, oldest delivery first."""


@dataclass
class _Claim:
    seq: int  # order of sending
    payload: bytes
    delivery: int
    take_id: int  # the newest take that returned it


@dataclass
class Receiver:
    """A receive handle attached to a buffer."""

    watcher_id: str | None  # actor id of the receiving process; None for the driver
    claims: deque[_Claim] = field(default_factory=deque)  # in delivery order
    deliveries: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    newest_take: int = 0
    abandoned_through: int = 0  # takes with an id <= this were abandoned


class Buffer:
    """One channel at its owner. Every method but :meth:`locked_statistics` is
    called with ``cond`` held, which is notified on every change that a blocked
    send or a waiting take could be waiting for."""

    def __init__(self, item_type: type, capacity: float, forget: Callable[[], None]) -> None:
        self.cond = threading.Condition()
        self.item_type = item_type
        self.capacity = capacity
        self.items: deque[tuple[int, bytes]] = deque()  # (seq, payload), unclaimed, in seq order
        self.claimed = 0
        self.seqs = itertools.count()
        self.receivers: dict[str, Receiver] = {}
        self.slots = 1  # the address's receive slot, until something attaches
        self.open_send = 0
        self.waiting_send = 0
        self.waiting_take = 0
        self._forget = forget  # called once no handle of either end is left

    def used(self) -> int:
        return len(self.items) + self.claimed

    def broken(self) -> bool:
        return not self.receivers and self.slots == 0

    def put(self, payload: bytes) -> None:
        self.items.append((next(self.seqs), payload))
        self.cond.notify_all()

    def close_sender(self) -> None:
        self.open_send -= 1
        self.cond.notify_all()
        self._forget_if_finished()

    def attach(self, rid: str, watcher_id: str | None) -> bool:
        """Attach receive handle ``rid``; False if every receive handle had closed."""
        if rid in self.receivers:
            return True
        if self.broken():
            return False
        self.slots = max(0, self.slots - 1)
        self.receivers[rid] = Receiver(watcher_id=watcher_id)
        return True

    def ack(self, rid: str, through: int) -> None:
        """Drop the claims of ``rid`` with a delivery number up to ``through``."""
        r = self.receivers.get(rid)
        acked = 0
        while r is not None and r.claims and r.claims[0].delivery <= through:
            r.claims.popleft()
            acked += 1
        if acked:
            self.claimed -= acked
            self.cond.notify_all()

    def abandon(self, rid: str, take_id: int, acked_through: int) -> None:
        """Take ``take_id`` of ``rid`` was cancelled: it returns ``stale`` if it still
        waits or has not run yet, and its claims go back."""
        self.ack(rid, acked_through)
        r = self.receivers.get(rid)
        if r is None:
            return
        r.abandoned_through = max(r.abandoned_through, take_id)
        self._give_back(r, through_take=take_id)
        self.cond.notify_all()

    def close_receiver(self, rid: str, acked_through: int) -> Receiver | None:
        """Detach ``rid`` (its claims go back); the last one dropping the buffer."""
        self.ack(rid, acked_through)
        r = self.receivers.pop(rid, None)
        if r is None:
            return None
        self._give_back(r)
        if self.broken():
            self.items.clear()
        self.cond.notify_all()
        self._forget_if_finished()
        return r

    def take(self, rid: str, take_id: int, acked_through: int, max_items: int) -> TakeReply:
        """Ack, then wait for items, end of stream, or this take being replaced
        (a newer take or an abandon) or its handle closing."""
        self.ack(rid, acked_through)
        r = self.receivers.get(rid)
        while True:
            if r is None or self.receivers.get(rid) is not r:
                return TakeReply(status="closed")
            if take_id <= r.abandoned_through or take_id < r.newest_take:
                return TakeReply(status="stale")
            if take_id > r.newest_take:  # an older take still waiting was abandoned: free its thread
                r.newest_take = take_id
                self.cond.notify_all()
            if r.claims or self.items:
                return self._claim(r, take_id, max_items)
            if self.open_send == 0 and self.claimed == 0:  # others' claims may come back
                return TakeReply(status="end")
            self.waiting_take += 1
            try:
                self.cond.wait()
            finally:
                self.waiting_take -= 1

    def locked_statistics(self) -> ChannelStatistics:
        with self.cond:
            return ChannelStatistics(
                current_buffer_used=self.used(),
                max_buffer_size=self.capacity,
                open_send_channels=self.open_send,
                open_receive_channels=len(self.receivers) + self.slots,
                tasks_waiting_send=self.waiting_send,
                tasks_waiting_receive=self.waiting_take,
            )

    def _claim(self, r: Receiver, take_id: int, max_items: int) -> TakeReply:
        while self.items and len(r.claims) < max_items:
            seq, payload = self.items.popleft()
            r.claims.append(_Claim(seq=seq, payload=payload, delivery=next(r.deliveries), take_id=take_id))
            self.claimed += 1
        for c in r.claims:
            c.take_id = take_id
        return TakeReply(status="items", items=[(c.delivery, c.payload) for c in r.claims])

    def _give_back(self, r: Receiver, through_take: float = math.inf) -> None:
        """Put the claims last returned by takes up to ``through_take`` back at the
        front of the buffer, merged in sending order."""
        back = sorted((c for c in r.claims if c.take_id <= through_take), key=lambda c: c.seq)
        if not back:
            return
        r.claims = deque(c for c in r.claims if c.take_id > through_take)
        self.claimed -= len(back)
        merged = heapq.merge([(c.seq, c.payload) for c in back], self.items, key=lambda i: i[0])
        self.items = deque(merged)

    def _forget_if_finished(self) -> None:
        if self.open_send == 0 and self.broken():
            self._forget()
