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
    for bad in (-1, 1.5, float("nan"), -math.inf):
        with pytest.raises(ValueError, match="capacity"):
            open_channel(bad)
    open_channel(1)
    open_channel(math.inf)


def test_zero_capacity_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"cancellation-safe.*capacity=1"):
        open_channel(0)


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


async def _settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_cancelled_receive_after_wakeup_takes_nothing() -> None:
    async def main():
        send, receive = open_channel[int](1)
        waiter = asyncio.create_task(receive.receive())
        await _settle()
        send.send_nowait(7)  # wakes the waiter...
        waiter.cancel()      # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert receive.receive_nowait() == 7
        assert receive.statistics().tasks_waiting_receive == 0

    run(main())


def test_cancelled_waiting_receive_keeps_order_for_the_others() -> None:
    async def main():
        send, receive = open_channel[int](2)
        first, second, third = (asyncio.create_task(receive.receive()) for _ in range(3))
        await _settle()
        first.cancel()
        await _settle()
        assert receive.statistics().tasks_waiting_receive == 2
        send.send_nowait(1)
        send.send_nowait(2)
        assert [await second, await third] == [1, 2]
        assert first.cancelled()

    run(main())


def test_receive_cancelled_after_wakeup_passes_it_on() -> None:
    async def main():
        send, receive = open_channel[int](1)
        first = asyncio.create_task(receive.receive())
        await _settle()
        second = asyncio.create_task(receive.clone().receive())
        await _settle()
        send.send_nowait(7)  # wakes `first` only
        first.cancel()
        assert await second == 7
        assert first.cancelled()
        stats = receive.statistics()
        assert (stats.current_buffer_used, stats.tasks_waiting_receive) == (0, 0)

    run(main())


def test_woken_receiver_that_finds_nothing_waits_at_the_front() -> None:
    async def main():
        send, receive = open_channel[int](1)
        first = asyncio.create_task(receive.receive())
        await _settle()
        second = asyncio.create_task(receive.receive())
        await _settle()
        send.send_nowait(1)                  # wakes `first`...
        assert receive.receive_nowait() == 1  # ...but this takes the item first
        await _settle()
        assert receive.statistics().tasks_waiting_receive == 2
        send.send_nowait(2)
        assert await first == 2
        assert not second.done()
        send.close()
        with pytest.raises(EndOfStream):
            await second

    run(main())


def test_cancelled_send_leaves_channel_unchanged() -> None:
    async def main():
        send, receive = open_channel[int](1)
        send.send_nowait(0)
        sender = asyncio.create_task(send.send(1))
        await _settle()
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sender
        assert send.statistics().tasks_waiting_send == 0
        assert receive.receive_nowait() == 0
        with pytest.raises(WouldBlock):
            receive.receive_nowait()

    run(main())


def test_send_cancelled_after_wakeup_sends_nothing_and_passes_it_on() -> None:
    async def main():
        send, receive = open_channel[int](1)
        send.send_nowait(0)
        first = asyncio.create_task(send.send(1))
        await _settle()
        second = asyncio.create_task(send.send(2))
        await _settle()
        assert receive.receive_nowait() == 0  # wakes `first`...
        first.cancel()                         # ...which is cancelled before it runs
        await second
        assert first.cancelled()
        send.close()
        assert [item async for item in receive] == [2]

    run(main())


def test_wait_for_timeouts_never_lose_an_item() -> None:
    async def main():
        send, receive = open_channel[int](3)
        n = 300
        got: list[int] = []

        async def producer():
            async with send:
                for i in range(n):
                    await send.send(i)
                    if i % 3 == 0:
                        await asyncio.sleep(0.0005)

        async def consumer():
            while True:
                try:
                    got.append(await asyncio.wait_for(receive.receive(), 0.0005))
                except TimeoutError:
                    continue
                except EndOfStream:
                    return

        async with asyncio.TaskGroup() as tg:
            tg.create_task(producer(), name="producer")
            tg.create_task(consumer(), name="consumer")
        assert got == list(range(n))

    run(main())


def test_closing_receivers_wakes_blocked_senders() -> None:
    async def main():
        send, receive = open_channel[int](1)
        send.send_nowait(0)
        sender = asyncio.create_task(send.send(1))
        await _settle()
        receive.close()
        with pytest.raises(BrokenResourceError):
            await sender
        assert send.statistics().current_buffer_used == 0

    run(main())


def test_closing_a_handle_fails_its_waiters_and_passes_wakeups_on() -> None:
    async def main():
        send, receive = open_channel[int](1)
        other = receive.clone()
        mine = asyncio.create_task(receive.receive())
        await _settle()
        theirs = asyncio.create_task(other.receive())
        await _settle()
        send.send_nowait(5)  # wakes `mine`...
        receive.close()      # ...whose handle closes before it runs
        with pytest.raises(ClosedResourceError):
            await mine
        assert await theirs == 5

        blocked = asyncio.create_task(other.receive())
        await _settle()
        other.close()
        with pytest.raises(ClosedResourceError):
            await blocked

    run(main())


def test_closing_a_send_handle_fails_its_waiting_sends() -> None:
    async def main():
        send, receive = open_channel[int](1)
        other = send.clone()
        send.send_nowait(0)
        blocked = asyncio.create_task(send.send(1))
        await _settle()
        send.close()
        with pytest.raises(ClosedResourceError):
            await blocked
        other.close()
        assert [item async for item in receive] == [0]

    run(main())
