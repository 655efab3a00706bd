"""Streaming role methods: reporting rows as they finish, and moving unfinished work.

A role method registered with ``@register`` may be written as a generator. It then
yields, as it goes:

- :class:`Chunk`: rows that are finished (whole groups), with their row ids
  (``channels.row_id(rank, index)``, index = the row's position among this rank's
  outputs);
- :class:`Step`: a step boundary, with how many samples are still in progress.
  The value sent back is a control from the driver: None (go on),
  :class:`Handoff` (yield a :class:`Tail` of everything unfinished, then return),
  :class:`Adopt` (continue these rows handed off by another rank too) or, only
  after ``Step(pending=0)``, :class:`Finish` (return).

Called without ``stream``, the worker runs the generator to the end and returns
the chunks' rows in row-id order, which is what the method returns as a plain
method; streamed, each micro-batch of chunks goes to the driver as soon as it is
complete. :class:`StreamControl` carries the driver's controls from the worker's
io threads to the method's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from channels import Batch, StreamItem

__all__ = ["Adopt", "Chunk", "Finish", "Handoff", "Step", "StreamControl", "StreamSink", "Tail"]


class StreamSink(Protocol):
    """Where a streamed call's items go (a channel's send end)."""

    def send(self, item: StreamItem) -> None:
        """Send ``item``, waiting while the receiver is behind."""
        ...

    def close(self) -> None:
        """End of stream."""
        ...


@dataclass(frozen=True, eq=False)
class Chunk:
    """Finished rows of a streaming method and their row ids (same length)."""

    rows: Batch
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """A step boundary: the method can take a control now."""

    pending: int
    """Samples still in progress on this rank."""


@dataclass(frozen=True, eq=False)
class Tail:
    """A method's unfinished work, yielded after :class:`Handoff`; another rank
    continues it from these rows."""

    rows: Batch


@dataclass(frozen=True)
class Handoff:
    """Control: give up everything unfinished as a :class:`Tail`, then return."""


@dataclass(frozen=True, eq=False)
class Adopt:
    """Control: continue the unfinished work in ``rows`` (another rank's :class:`Tail`)."""

    rows: Batch


@dataclass(frozen=True)
class Finish:
    """Control, after ``Step(pending=0)``: nothing more will come; return."""


Control = Handoff | Adopt | Finish | None
Yielded = Chunk | Step | Tail
StreamMethod = Generator[Yielded, Control, None]


class StreamControl:
    """The driver's controls for one streaming call on one rank.

    The io threads call :meth:`handoff`, :meth:`expect` and :meth:`deliver`; the
    method's thread calls :meth:`poll` at every step and :meth:`idle` when it has
    nothing in progress. Once the call is over (:meth:`close`, or :meth:`idle`
    returned :class:`Finish`), requests are refused, so the driver knows that the
    rank will not take handed-off work.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._handoff = False
        self._expected = 0
        self._inbox: deque[Batch | None] = deque()
        self._done = False

    def handoff(self) -> bool:
        """Ask the method to hand its unfinished work off. False: the call is over."""
        with self._cond:
            if self._done:
                return False
            self._handoff = True
            self._cond.notify_all()
            return True

    def expect(self, count: int) -> bool:
        """Announce ``count`` deliveries (one per source rank). False: the call is
        over and will take none."""
        with self._cond:
            if self._done:
                return False
            self._expected += count
            return True

    def deliver(self, rows: Batch | None) -> None:
        """One announced delivery: a source's tail rows, or None when it had none."""
        with self._cond:
            self._inbox.append(rows)
            self._cond.notify_all()

    def poll(self) -> Control:
        """The control for a step boundary; never waits."""
        with self._cond:
            while self._inbox:
                rows = self._take()
                if rows is not None:
                    return Adopt(rows)
            if self._handoff:
                self._handoff = False
                return Handoff()
            return None

    def idle(self) -> Control:
        """The control when nothing is in progress: waits while announced
        deliveries are outstanding; unblocked by :meth:`deliver` or :meth:`close`."""
        with self._cond:
            while True:
                while self._inbox:
                    rows = self._take()
                    if rows is not None:
                        return Adopt(rows)
                if self._expected == 0 or self._done:
                    self._done = True
                    return Finish()
                self._cond.wait()

    def close(self) -> None:
        """The call is over: later requests are refused, a waiting :meth:`idle` ends."""
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _take(self) -> Batch | None:
        self._expected -= 1
        return self._inbox.popleft()


Emit = Callable[[str, Batch | None, tuple[int, ...], int], None]
"""``emit(kind, rows, ids, pending)``: store rows and report them to the driver."""


def _drive(gen: StreamMethod, react: Callable[[Yielded], Control]) -> None:
    """Run ``gen`` to its end, sending back ``react(item)`` for each item it yields."""
    sent: Control = None
    try:
        while True:
            try:
                out = gen.send(sent)
            except StopIteration:
                return
            sent = react(out)
    finally:
        gen.close()


def run_streamed(gen: StreamMethod, control: StreamControl, emit: Emit, *, micro_batch: int,
                 progress_below: int = 0) -> list[tuple[int, float]]:
    """Run a streaming method, emitting a ``"rows"`` item per ``micro_batch`` finished
    rows (at least; chunks are not split; fewer at the end, once the samples still in
    progress could not fill one, so the tail's rows go out as they finish),
    ``"progress"`` when only the pending count changed (the first count, then only
    at ``progress_below`` or fewer), and ``"tail"`` for handed-off work.

    Returns:
        ``(samples in progress, mean seconds of a step)`` per count seen: the step
        cost the driver's migration simulator fits.
    """
    buffered: list[Chunk] = []
    reported = -1
    steps: dict[int, list[float]] = {}
    last: tuple[int, float] | None = None  # (pending, when) of a step under way

    def react(out: Yielded) -> Control:
        nonlocal reported, last
        if isinstance(out, Chunk):
            if out.rows.num_rows:
                buffered.append(out)
            if _rows(buffered) >= micro_batch:
                _flush(buffered, emit, max(reported, 0))
            return None
        if isinstance(out, Tail):
            _flush(buffered, emit, 0)
            emit("tail", out.rows, (), 0)
            return None
        if last is not None and last[0]:
            took = steps.setdefault(last[0], [0.0, 0.0])
            took[0] += time.perf_counter() - last[1]
            took[1] += 1
        # Full, or the samples still generating could not fill it: ship it.
        if buffered and (out.pending < micro_batch or _rows(buffered) >= micro_batch):
            _flush(buffered, emit, out.pending)
        elif out.pending != reported and (reported < 0 or out.pending <= progress_below):
            emit("progress", None, (), out.pending)
        reported = out.pending
        sent = control.poll() if out.pending else control.idle()
        last = (out.pending, time.perf_counter()) if sent is None else None
        return sent

    try:
        _drive(gen, react)
        _flush(buffered, emit, 0)
    finally:
        control.close()
    return [(b, total / count) for b, (total, count) in sorted(steps.items())]


def _rows(buffered: list[Chunk]) -> int:
    return sum(c.rows.num_rows for c in buffered)


def _flush(buffered: list[Chunk], emit: Emit, pending: int) -> None:
    if not buffered:
        return
    rows = Batch.concat([c.rows for c in buffered])
    ids = tuple(i for c in buffered for i in c.ids)
    buffered.clear()
    emit("rows", rows, ids, pending)


def drain(gen: StreamMethod) -> Batch:
    """Run a streaming method to the end without streaming; its rows in row-id order.

    Raises:
        RuntimeError: the method yielded a :class:`Tail` (nobody asked it to).
    """
    chunks: list[Chunk] = []

    def react(out: Yielded) -> Control:
        if isinstance(out, Chunk):
            chunks.append(out)
        elif isinstance(out, Tail):
            raise RuntimeError("a streaming method yielded a Tail without a Handoff")
        elif out.pending == 0:
            return Finish()
        return None

    _drive(gen, react)
    if not chunks:
        raise RuntimeError("a streaming method must yield at least one Chunk (empty rows give the schema)")
    rows = Batch.concat([c.rows for c in chunks])
    ids = [i for c in chunks for i in c.ids]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return rows if order == list(range(len(ids))) else rows.take(order)
