"""The control connection between the driver and a worker (asyncflow.runtime._control
and workers.host._control), over a real TCP connection in this process: calls
answer in order, errors come back as the transport raises them, only the
session's token connects, and a lost connection fails what waits on it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

from asyncflow.runtime import _control
from asyncflow.runtime._control import ConnectionLost, Control
from workers import NotRun, RankError
from workers.host._control import ControlServer

TOKEN = b"t" * 32


class Worker:
    """What ControlServer calls: ``execute`` (records, may raise) and ``send``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        self.sent: list[tuple[int, int, Any]] = []
        self.gate = threading.Event()
        self.gate.set()

    def execute(self, call: Any, *fetched: Any) -> Any:
        self.gate.wait(30)
        self.calls.append((call, fetched))
        if call == "raise":
            raise RankError("ValueError: bad rows", "Traceback ...")
        return {"echo": call, "fetched": fetched, "thread": threading.current_thread().name}

    def send(self, dst: int, tag: int, pieces: Any) -> None:
        self.sent.append((dst, tag, pieces))


async def _connect(server: ControlServer, token: bytes = TOKEN) -> Control:
    transport, control = await asyncio.get_running_loop().create_connection(Control, *server.address)
    transport.write(token)
    return control


def _server(worker: Worker) -> ControlServer:
    return ControlServer(host="127.0.0.1", token=TOKEN, execute=worker.execute, send=worker.send)


def test_calls_answer_in_order_on_one_compute_thread_and_sends_post_at_once() -> None:
    worker = Worker()
    server = _server(worker)

    async def main() -> list[Any]:
        control = await _connect(server)
        worker.gate.clear()  # the first call holds the compute thread: the send goes by it
        futures = [control.execute(f"call{i}", [i]) for i in range(3)]
        assert control.send_slices(5, 64, ["piece"])
        await asyncio.sleep(0.2)
        sent_while_computing = list(worker.sent)
        worker.gate.set()
        out = await asyncio.gather(*futures)
        control.close()
        return [sent_while_computing, out]

    try:
        sent, out = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.close()
    assert sent == [(5, 64, ["piece"])]
    assert [o["echo"] for o in out] == ["call0", "call1", "call2"]
    assert [o["fetched"] for o in out] == [(0,), (1,), (2,)]
    assert {o["thread"] for o in out} == {"asyncflow-control-compute"}


def test_the_frames_of_one_turn_of_the_loop_go_in_one_write_and_close_sends_them_first() -> None:
    worker = Worker()
    server = _server(worker)
    writes: list[int] = []

    async def main() -> list[Any]:
        control = await _connect(server)
        assert control._transport is not None
        write = control._transport.write
        control._transport.write = lambda data: (writes.append(len(data)), write(data))[1]  # type: ignore[method-assign]
        first = [control.execute(f"a{i}", []) for i in range(3)]  # one turn: one write
        assert writes == []  # written at the end of the turn
        out = await asyncio.gather(*first)
        out.append(await control.execute("b", []))  # a later turn: its own write
        assert control.send_slices(1, 2, ["last"])
        control.close()  # in the same turn: the queued send goes out before the close
        return out

    try:
        out = asyncio.run(asyncio.wait_for(main(), 30))
        deadline = time.monotonic() + 10
        while not worker.sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.close()
    assert [o["echo"] for o in out] == ["a0", "a1", "a2", "b"]
    assert len(writes) == 3
    assert worker.sent == [(1, 2, ["last"])]


def test_a_rank_error_and_arguments_that_do_not_load_come_back_as_errors() -> None:
    worker = Worker()
    server = _server(worker)

    async def main() -> tuple[BaseException, BaseException, Any]:
        control = await _connect(server)
        with pytest.raises(RankError) as raised:
            await control.execute("raise", [])
        with pytest.raises(NotRun) as unloadable:
            await control.execute(_Unloadable(), [])
        after = await control.execute("fine", [])  # the connection goes on
        control.close()
        return raised.value, unloadable.value, after

    try:
        raised, unloadable, after = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.close()
    assert str(raised) == "ValueError: bad rows"
    assert "cannot be loaded here" in str(unloadable) and "Traceback" in unloadable.traceback_str
    assert after["echo"] == "fine"
    assert [c for c, _ in worker.calls] == ["raise", "fine"], "the unloadable call never ran"


class _Unloadable:
    """Pickles, but raises where it is unpickled (the worker)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _refuse, ()


def _refuse() -> None:
    raise RuntimeError("cannot be loaded here")


def test_only_the_token_connects_and_the_listener_closes_after_one_connection() -> None:
    worker = Worker()
    server = _server(worker)

    async def main() -> bool:
        control = await _connect(server, token=b"x" * 32)
        fut = control.execute("never", [])
        await asyncio.sleep(0.5)
        return control.lost and not fut.done()

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)), "a wrong token: the worker hung up"
        with pytest.raises(OSError):
            socket.create_connection(server.address, timeout=2).close()
    finally:
        server.close()
    assert worker.calls == []


def test_a_lost_connection_fails_the_calls_waiting_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_control, "GONE_GRACE_S", 0.2)
    worker = Worker()
    server = _server(worker)

    async def main() -> float:
        control = await _connect(server)
        worker.gate.clear()
        fut = control.execute("stuck", [])
        await asyncio.sleep(0.2)
        started = time.monotonic()
        server.close()  # the worker's end goes (as when its process dies)
        with pytest.raises(ConnectionLost):
            await fut
        with pytest.raises(ConnectionLost):  # and later calls fail at once
            await control.execute("later", [])
        return time.monotonic() - started

    try:
        waited = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        worker.gate.set()
        server.close()
    assert waited < 10


def test_the_end_of_the_workers_side_is_told_at_once_with_whether_a_call_waited_on_it() -> None:
    """``on_lost`` hears of the worker's end as soon as the driver reads it (the
    sign that its process died, and whether it died serving a call); never of
    the driver's own close."""
    idle_worker, busy_worker, closed_worker = Worker(), Worker(), Worker()
    servers = [_server(w) for w in (idle_worker, busy_worker, closed_worker)]

    async def main() -> list[list[bool]]:
        controls = [await _connect(s) for s in servers]
        told: list[list[bool]] = [[], [], []]
        ended = asyncio.Event()
        for heard, control in zip(told, controls, strict=True):
            control.on_lost = lambda busy, heard=heard: (heard.append(busy), ended.set())
        assert (await controls[0].execute("answered", []))["echo"] == "answered"
        busy_worker.gate.clear()
        controls[1].execute("stuck", [])
        await asyncio.sleep(0.2)  # written: the worker runs it
        controls[2].close()
        for server in servers[:2]:
            server.close()  # the worker's end goes (as when its process dies)
        while not (told[0] and told[1]):
            await ended.wait()
            ended.clear()
        return told

    try:
        told = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        busy_worker.gate.set()
        for server in servers:
            server.close()
    assert told == [[False], [True], []]


def test_connect_falls_back_to_ray_calls_when_a_worker_cannot_be_reached(caplog: pytest.LogCaptureFixture) -> None:
    """One worker listening, one whose address answers nothing: no connection is
    kept (calls go by Ray for every worker), and a warning says why."""
    worker = Worker()
    server = _server(worker)
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        nowhere = s.getsockname()

    class Actor:
        def __init__(self, address: tuple[str, int]) -> None:
            self.open_control = self
            self.address = address

        async def remote(self, token: bytes) -> tuple[str, int]:
            return self.address

    try:
        controls = asyncio.run(_control.connect([Actor(server.address), Actor(nowhere)]))
    finally:
        server.close()
    assert controls == []
    assert "calls go by Ray tasks" in caplog.text
