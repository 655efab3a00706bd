"""The typed channel contract (trio/anyio semantics)."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from channels import (
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
    open_channel,
)


class Item(msgspec.Struct, frozen=True):
    n: int


def run(coro):
    return asyncio.run(coro)


def test_bad_capacity_rejected() -> None:
    for bad in (-1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            open_channel(bad)
    open_channel(math.inf)


def test_fifo_backpressure_and_end_of_stream() -> None:
    async def main():
        send, receive = open_channel[Item](2, item_type=Item)
        got = []

        async def consumer():
            async for item in receive:
                got.append(item.n)
                await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(consumer(), name="consumer")
            async with send:
                for i in range(10):
                    await send.send(Item(i))
                    assert send.statistics().current_buffer_used <= 2
        assert got == list(range(10))

    run(main())


def test_typed_channel_rejects_other_items() -> None:
    send, _ = open_channel[Item](1, item_type=Item)
    with pytest.raises(TypeError, match="Item"):
        send.send_nowait(3)  # type: ignore[arg-type]


def test_nowait_and_errors() -> None:
    send, receive = open_channel[int](1)
    with pytest.raises(WouldBlock):
        receive.receive_nowait()
    send.send_nowait(1)
    with pytest.raises(WouldBlock):
        send.send_nowait(2)
    assert receive.receive_nowait() == 1
    send.close()
    with pytest.raises(ClosedResourceError):
        send.send_nowait(3)
    with pytest.raises(EndOfStream):
        receive.receive_nowait()
    s2, r2 = open_channel[int](1)
    r2.close()
    with pytest.raises(BrokenResourceError):
        s2.send_nowait(1)


def test_clones_end_stream_only_after_all_closed() -> None:
    async def main():
        send, receive = open_channel[int](10)
        other = send.clone()
        send.close()
        await other.send(5)
        assert await receive.receive() == 5
        other.close()
        with pytest.raises(EndOfStream):
            await receive.receive()

    run(main())


def test_cancelled_receive_loses_nothing() -> None:
    async def main():
        send, receive = open_channel[int](0)
        waiter = asyncio.create_task(receive.receive())
        await asyncio.sleep(0)
        send.send_nowait(7)  # handed to the waiter...
        waiter.cancel()      # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert receive.receive_nowait() == 7
        assert receive.statistics().tasks_waiting_receive == 0

    run(main())


def test_cancelled_send_leaves_channel_unchanged() -> None:
    async def main():
        send, receive = open_channel[int](0)
        sender = asyncio.create_task(send.send(1))
        await asyncio.sleep(0)
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sender
        assert send.statistics().tasks_waiting_send == 0
        with pytest.raises(WouldBlock):
            receive.receive_nowait()

    run(main())


def test_closing_receivers_wakes_blocked_senders() -> None:
    async def main():
        send, receive = open_channel[int](0)
        sender = asyncio.create_task(send.send(1))
        await asyncio.sleep(0)
        receive.close()
        with pytest.raises(BrokenResourceError):
            await sender

    run(main())
