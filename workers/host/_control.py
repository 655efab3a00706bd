"""A worker's end of its session's control connection: the driver's calls to
``execute`` and ``send_slices`` without a Ray task each.

A Ray actor call costs the driver and the worker a few hundred microseconds of
CPU, more with every argument (serialisation, the task's bookkeeping), and two
such calls carry a call between pools on the CPU (the consumer's ``execute``, the
producer's ``send_slices``). A CPU session instead opens one TCP connection per
worker (``WorkerProcess.open_control``) and sends both as frames on it: an 8-byte
length, then a pickle. Everything else (setting the session up, poisoning and
healing groups, streams, death) stays on Ray, whose ``watch`` call still reports
the process's death.

Trust: the connection is authenticated like the rest of the session's traffic,
through Ray: the driver hands a fresh random token to ``open_control`` by a Ray
call, and the listener (on the node's address, like gloo's) takes one connection,
whose first frame must be that token, then closes. Nobody else can connect.

A frame is its length (8 bytes), a kind (1 byte), a request number (8 bytes)
and a pickle. From the driver: ``EXECUTE`` with ``(call, fetched)`` runs
``execute(call, *fetched)`` on the connection's compute thread, one at a time and
in order, and answers (kind ``ANSWER``, the same number) ``(True, result)`` or
``(False, error)``: the rank's :class:`~workers.RankError`, or :class:`NotRun`
when its arguments could not be loaded; ``SEND`` with ``(dst, tag, pieces)``
posts a ``send_slices`` at once and answers nothing (a failure goes to the
receiver, as with Ray).
"""

from __future__ import annotations

import hmac
import logging
import pickle
import queue
import socket
import struct
import threading
import traceback
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle

from workers.host._call import RankError

logger = logging.getLogger(__name__)

ACCEPT_S = 120.0
"""How long the listener waits for the driver's connection."""

_HEAD = struct.Struct("<QBQ")  # the length of what follows it, the kind, the request number
_KIND_AND_REQUEST = _HEAD.size - 8  # counted in the length


class NotRun(Exception):
    """A control frame's call never ran on the worker (its arguments could not be
    loaded): its text and the worker's traceback."""

    def __init__(self, text: str, traceback_str: str) -> None:
        super().__init__(text)
        self.text, self.traceback_str = text, traceback_str

    def __reduce__(self) -> tuple[Any, ...]:
        return NotRun, (self.text, self.traceback_str)


class ControlWire:
    """The frames of a control connection (see the module docstring)."""

    EXECUTE, SEND, ANSWER = 1, 2, 3
    """The kinds of frame."""
    HEAD_BYTES = _HEAD.size
    """A frame's head: what :meth:`read_head` reads."""

    @staticmethod
    def frame(kind: int, request: int, obj: Any) -> bytes:
        """One frame: ``obj`` pickled by Ray's pickler (by value where Ray would)."""
        body = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return _HEAD.pack(len(body) + _KIND_AND_REQUEST, kind, request) + body

    @staticmethod
    def read_head(data: bytes | bytearray) -> tuple[int, int, int]:
        """The head at the start of ``data``: the pickle's length, the kind and the
        request number."""
        length, kind, request = _HEAD.unpack_from(data)
        return length - _KIND_AND_REQUEST, kind, request


class ControlServer:
    """The worker's end of one session's control connection (see the module
    docstring). ``execute(call, *fetched)`` and ``send(dst, tag, pieces)`` are the
    worker's methods."""

    def __init__(self, *, host: str, token: bytes, execute: Callable[..., Any],
                 send: Callable[[int, int, Any], None]) -> None:
        self._token, self._execute, self._send = token, execute, send
        self._listener = socket.create_server((host, 0), backlog=1)
        self._listener.settimeout(ACCEPT_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._conn: socket.socket | None = None
        self._write = threading.Lock()
        self._work: queue.SimpleQueue[tuple[int, Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="asyncflow-control", daemon=True).start()
        threading.Thread(target=self._compute, name="asyncflow-control-compute", daemon=True).start()

    def close(self) -> None:
        """End the connection and both threads (a call running finishes first)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._work.put(None)
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    # ----- the reading thread -----

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:  # closed, or no driver within ACCEPT_S
            self.close()
            return
        finally:
            self._listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn = conn
        reader = conn.makefile("rb")
        try:
            if not hmac.compare_digest(_exactly(reader, len(self._token)), self._token):
                logger.warning("a control connection without the session's token was refused")
                return
            while True:
                length, kind, request = ControlWire.read_head(_exactly(reader, ControlWire.HEAD_BYTES))
                self._dispatch(kind, request, _exactly(reader, length))
        except (OSError, EOFError):
            pass
        finally:
            self.close()

    def _dispatch(self, kind: int, request: int, data: bytes) -> None:
        try:
            message = pickle.loads(data)
        except Exception as e:
            if kind == ControlWire.EXECUTE:
                self._answer(request, False, NotRun(f"{type(e).__name__}: {e}", traceback.format_exc()))
            else:
                logger.error("an unreadable send_slices request was dropped: %s", e)
            return
        if kind == ControlWire.SEND:
            self._send(*message)
        else:
            self._work.put((request, *message))

    # ----- the compute thread -----

    def _compute(self) -> None:
        while (job := self._work.get()) is not None:
            request, call, fetched = job
            try:
                result = self._execute(call, *fetched)
            except Exception as e:
                self._answer(request, False, e)
            except BaseException as e:  # never end the thread unanswered: the call would wait forever
                self._answer(request, False, RankError.from_exception(e, peer_failure=False))
            else:
                self._answer(request, True, result)

    def _answer(self, request: int, ok: bool, value: Any) -> None:
        try:
            data = ControlWire.frame(ControlWire.ANSWER, request, (ok, value))
        except Exception as e:  # an unpicklable result or error: say so instead
            error = NotRun(f"the answer could not be pickled: {e}", traceback.format_exc())
            data = ControlWire.frame(ControlWire.ANSWER, request, (False, error))
        conn = self._conn
        if conn is None:
            return
        with self._write:
            try:
                conn.sendall(data)
            except OSError:  # the driver went: nobody to answer
                pass


def _exactly(reader: Any, n: int) -> bytes:
    data: bytes = reader.read(n)
    if len(data) < n:
        raise EOFError
    return data


class ControlHost:
    """The worker's methods for its control connection (a mixin of
    ``WorkerProcess``, which provides ``execute`` and ``send_slices``)."""

    _control: ControlServer | None = None

    @ray.method(concurrency_group="io")
    def open_control(self, token: bytes) -> tuple[str, int]:
        """Listen for the session's control connection (one, whose first bytes are
        ``token``) on this node's address; returns where."""
        self.close_control()
        worker: Any = self  # a WorkerProcess
        self._control = ControlServer(host=ray.util.get_node_ip_address(), token=token,
                                      execute=worker.execute, send=worker.send_slices)
        return self._control.address

    def close_control(self) -> None:
        """End the control connection, if any (a session's end)."""
        if self._control is not None:
            self._control.close()
            self._control = None
