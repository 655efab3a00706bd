"""The driver's end of a worker's control connection (``workers.host._control``):
``execute`` and ``send_slices`` as frames on one TCP connection per worker, with
no Ray task each. A CPU session opens one per worker once its roles are up
(:func:`connect`); :class:`~asyncflow.runtime._transport.RayTransport` sends on it.

Answers arrive in the event loop's own callbacks (an :class:`asyncio.Protocol`),
which settle the waiting futures directly: no task, no thread hop. When the
connection closes under a call, the call fails with
:class:`~asyncflow.runtime._transport.WorkerGone` after :data:`GONE_GRACE_S`,
unless Ray has reported the process's death by then (the session's ``watch``
calls), which names what happened.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import ray

from workers import ControlWire, NotRun

logger = logging.getLogger(__name__)

GONE_GRACE_S = 10.0
"""How long calls on a closed connection wait for Ray to report why before failing."""

CONNECT_S = 60.0
"""How long connecting to the workers may take in all."""


class ConnectionLost(Exception):
    """The control connection to a worker closed while a call waited on it."""


class Control(asyncio.Protocol):
    """One worker's control connection (see the module docstring)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []
        """Frames of this turn of the event loop, written together at its end."""
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._unwritten: set[int] = set()
        """Requests among ``_outgoing``'s frames: the worker cannot have seen them."""
        self._numbers = itertools.count()
        self.lost = False
        self._closing = False
        self.on_lost: Callable[[bool], None] | None = None
        """Called once, as soon as the driver reads that the worker's end closed (its
        process ended), with whether a call written to it had not answered then."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer, head = self._buffer, ControlWire.HEAD_BYTES
        buffer += data
        while len(buffer) >= head:
            length, kind, request = ControlWire.read_head(buffer)
            end = head + length
            if len(buffer) < end:
                return
            body = bytes(buffer[head:end])
            del buffer[:end]
            fut = self._waiting.pop(request, None) if kind == ControlWire.ANSWER else None
            if fut is None or fut.done():
                continue
            try:
                ok, value = ray.cloudpickle.loads(body)
            except Exception as e:
                fut.set_exception(NotRun(f"the worker's answer could not be loaded: {type(e).__name__}: {e}", ""))
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def eof_received(self) -> None:
        # Told here rather than in connection_lost, which comes a turn of the loop
        # later: a call started in between must not look sent before the end.
        self._ended()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()
        waiting, self._waiting = self._waiting, {}
        if self._closing:  # the session's end: nothing waits for these any more
            _fail(list(waiting.values()))
        elif waiting:
            asyncio.get_running_loop().call_later(GONE_GRACE_S, _fail, list(waiting.values()))

    def _ended(self) -> None:
        if self.lost:
            return
        self.lost = True
        if not self._closing and self.on_lost is not None:
            self.on_lost(any(r not in self._unwritten for r in self._waiting))

    def execute(self, call: Any, fetched: Sequence[Any]) -> asyncio.Future[Any]:
        """Run ``execute(call, *fetched)`` on the worker; a future of its result
        (raising :class:`~workers.RankError`, :class:`NotRun` or
        :class:`ConnectionLost`)."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost or self._transport is None:
            fut.set_exception(ConnectionLost("the control connection is closed"))
            return fut
        request = next(self._numbers)
        data = ControlWire.frame(ControlWire.EXECUTE, request, (call, tuple(fetched)))  # raises for an unpicklable argument
        self._waiting[request] = fut
        self._unwritten.add(request)
        self._post(data)
        return fut

    def send_slices(self, dst: int, tag: int, pieces: Sequence[Any]) -> bool:
        """Have the worker post ``pieces`` to worker ``dst`` (its ``send_slices``);
        False when the connection is closed (send another way)."""
        if self.lost or self._transport is None:
            return False
        self._post(ControlWire.frame(ControlWire.SEND, 0, (dst, tag, list(pieces))))
        return True

    def _post(self, frame: bytes) -> None:
        """Queue ``frame`` for the write at the end of this turn of the event loop: a
        step's calls, submitted together, reach the worker in one write (one wake-up
        of its reading thread, one system call here)."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(frame)

    def _flush(self) -> None:
        frames, self._outgoing = self._outgoing, []
        self._unwritten.clear()
        if frames and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(frames))

    def close(self) -> None:
        """Close the connection (the worker's end closes with it), after the frames
        queued in this turn."""
        self._closing = True
        if self._transport is not None:
            self._flush()
            self._transport.close()


def _fail(futures: list[asyncio.Future[Any]]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_exception(ConnectionLost("the control connection closed"))


async def connect(actors: Sequence[Any]) -> list[Control]:
    """Open a control connection to each worker (``WorkerProcess.open_control``),
    in the workers' order; none at all (the calls go by Ray, as before) where one
    cannot be opened, with a warning saying why."""
    tokens = [secrets.token_bytes(32) for _ in actors]
    addresses = await asyncio.gather(*(a.open_control.remote(t) for a, t in zip(actors, tokens, strict=True)))
    loop = asyncio.get_running_loop()
    opened: dict[int, Control] = {}

    async def one(i: int) -> None:
        transport, control = await loop.create_connection(Control, *addresses[i])
        transport.write(tokens[i])
        opened[i] = control

    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(actors)))), CONNECT_S)
    except (OSError, TimeoutError) as e:
        logger.warning("the workers' control connections could not be opened (%s: %s); calls go by Ray tasks, "
                       "about a millisecond more each", type(e).__name__, e)
        for control in opened.values():
            control.close()
        return []
    return [opened[i] for i in range(len(actors))]
