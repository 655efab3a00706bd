"""Remote channels (``channels._remote``) across real Ray processes, on CPU.

An :class:`Owner` actor opens channels and sends from its compute thread; the
driver and :class:`Consumer` actors receive. Every error path of the channel
contract is checked across processes, and so are the deaths of either side.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import psutil
import pytest
import ray
from remote_channel_items import Item, Other

from channels import (
    CHANNEL_CONCURRENCY_GROUPS,
    BrokenResourceError,
    ChannelAddress,
    ChannelHost,
    ChannelStatistics,
    ClosedResourceError,
    ConfigError,
    EndOfStream,
    RemoteReceiveChannel,
    SenderDiedError,
    open_receiver,
    open_remote_channel,
)
from support import LoopThread

# The actors below live in this file, which Ray workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
MB = 1 << 20


def _error(fn: Callable[[], object]) -> str:
    """The name of the exception ``fn`` raises, or ``"ok"``."""
    try:
        fn()
    except Exception as e:
        return type(e).__name__
    return "ok"


@ray.remote(num_cpus=0, concurrency_groups={**CHANNEL_CONCURRENCY_GROUPS, "compute": 4, "control": 2})
class Owner(ChannelHost):
    """Owns channels (by name) and sends into them."""

    def __init__(self) -> None:
        self.sends: dict[str, Any] = {}

    def open(self, name: str, capacity: float) -> ChannelAddress[Item]:
        self.sends[name], address = open_remote_channel(Item, capacity)
        return address

    def open_error(self, capacity: float, item_type: Any = Item) -> str:
        return _error(lambda: open_remote_channel(item_type, capacity))

    @ray.method(concurrency_group="compute")
    def send(self, name: str, ns: list[int], *, size: int = 0, close: bool = False) -> dict[str, Any]:
        """Send ``Item(n)`` for each n (``size`` bytes of payload); what went wrong,
        and after each send the buffer use and this process's private resident
        memory (its shared pages are the Ray object store's, which bounds them
        itself: the replies to receivers pass through it)."""
        send, used, private = self.sends[name], [], []
        try:
            for n in ns:
                send.send(Item(n=n, payload=bytes([n % 256]) * size))
                used.append(send.statistics().current_buffer_used)
                memory = psutil.Process().memory_info()
                private.append(memory.rss - memory.shared)
        except Exception as e:
            return {"error": type(e).__name__, "used": used, "private": private}
        if close:
            send.close()
        return {"error": None, "used": used, "private": private}

    @ray.method(concurrency_group="control")
    def send_nowait(self, name: str, n: int) -> str:
        return _error(lambda: self.sends[name].send_nowait(Item(n=n)))

    @ray.method(concurrency_group="control")
    def clone(self, name: str, new: str) -> None:
        self.sends[new] = self.sends[name].clone()

    @ray.method(concurrency_group="control")
    def close(self, name: str) -> None:
        self.sends[name].close()

    @ray.method(concurrency_group="control")
    def stats(self, name: str) -> ChannelStatistics:
        return self.sends[name].statistics()

    @ray.method(concurrency_group="control")
    def wrong_types(self, name: str) -> list[str]:
        send = self.sends[name]
        return [_error(lambda: send.send(Other(n=1))), _error(lambda: send.send_nowait({"n": 1}))]  # type: ignore[arg-type]

    @ray.method(concurrency_group="control")
    def use_after_close(self, name: str) -> list[str]:
        send = self.sends[name]
        send.close()
        send.close()  # idempotent
        return [_error(lambda: send.send(Item(n=1))), _error(lambda: send.send_nowait(Item(n=1))),
                _error(send.clone)]


@ray.remote(num_cpus=0, concurrency_groups={**CHANNEL_CONCURRENCY_GROUPS, "work": 4})
class Consumer(ChannelHost):
    """Receives from channels (by name) on an event loop of its own."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.receivers: dict[str, RemoteReceiveChannel[Item]] = {}

    @ray.method(concurrency_group="work")
    def open(self, name: str, address: ChannelAddress[Item]) -> None:
        self.receivers[name] = open_receiver(address)

    @ray.method(concurrency_group="work")
    def drain(self, name: str) -> list[int]:
        async def drain() -> list[int]:
            return [item.n async for item in self.receivers[name]]
        return self.loop.run(drain(), timeout=60)

    @ray.method(concurrency_group="work")
    def receive_within(self, name: str, seconds: float) -> int | None:
        """An item's ``n``, or None if none came within ``seconds`` (the receive was cancelled)."""
        async def receive() -> int | None:
            try:
                return (await asyncio.wait_for(self.receivers[name].receive(), seconds)).n
            except TimeoutError:
                return None
        return self.loop.run(receive(), timeout=seconds + 30)


@ray.remote(num_cpus=0)
class Plain:
    """An actor that is no ChannelHost: its death could not be watched."""

    def open_error(self, address: ChannelAddress[Item]) -> str:
        return _error(lambda: open_receiver(address))


@pytest.fixture(scope="module")
def ray_env(no_shared_ray: None) -> Iterator[None]:
    # Workers import the item types by name (see remote_channel_items).
    path = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def owner(ray_env: None) -> Any:
    return Owner.remote()


@pytest.fixture(scope="module")
def consumer(ray_env: None) -> Any:
    return Consumer.remote()


def run(loop_thread: LoopThread, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    return loop_thread.run(asyncio.wait_for(coro, timeout), timeout=timeout + 10)


def eventually(check: Callable[[], bool], timeout: float = 20) -> None:
    """Wait (bounded) until ``check()`` holds: the state of another process."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_open_outside_an_actor_or_with_a_bad_capacity_is_refused(owner: Any) -> None:
    with pytest.raises(ConfigError, match="inside a Ray actor"):
        open_remote_channel(Item, 4)
    assert ray.get([owner.open_error.remote(c) for c in (0, -1, 1.5, float("nan"))]) == ["ConfigError"] * 4
    assert ray.get(owner.open_error.remote(4, item_type="Item")) == "ConfigError"
    assert ray.get(owner.open_error.remote(float("inf"))) == "ok"


def test_receiving_in_an_actor_that_is_no_channel_host_is_refused(owner: Any) -> None:
    address = ray.get(owner.open.remote("unwatched", 4))
    plain = Plain.remote()
    assert ray.get(plain.open_error.remote(address)) == "ConfigError"
    ray.kill(plain)


def test_send_after_close(owner: Any) -> None:
    ray.get(owner.open.remote("closed", 4))
    assert ray.get(owner.use_after_close.remote("closed")) == ["ClosedResourceError"] * 3


def test_wrong_item_type_is_refused_at_send(owner: Any, loop_thread: LoopThread) -> None:
    receive = open_receiver(ray.get(owner.open.remote("typed", 4)))
    assert ray.get(owner.wrong_types.remote("typed")) == ["TypeError", "TypeError"]
    assert ray.get(owner.send.remote("typed", [7], close=True))["error"] is None
    assert run(loop_thread, receive.receive()) == Item(n=7)  # the channel is still whole


def test_end_of_stream_after_draining_in_fifo_order(owner: Any, loop_thread: LoopThread) -> None:
    receive = open_receiver(ray.get(owner.open.remote("fifo", 4)))
    sent = owner.send.remote("fifo", list(range(30)), close=True)

    async def drain() -> list[int]:
        return [item.n async for item in receive]
    assert run(loop_thread, drain()) == list(range(30))
    assert ray.get(sent)["error"] is None
    for _ in range(2):  # end of stream stays
        with pytest.raises(EndOfStream):
            run(loop_thread, receive.receive())
    run(loop_thread, receive.aclose())
    with pytest.raises(ClosedResourceError):
        run(loop_thread, receive.receive())


def test_receiver_process_death_breaks_a_blocked_send(owner: Any) -> None:
    doomed = Consumer.remote()
    ray.get(doomed.open.remote("rx", ray.get(owner.open.remote("dies", 2))))
    sent = owner.send.remote("dies", list(range(10)))
    assert ray.get(doomed.receive_within.remote("rx", 20)) == 0  # attached and watched
    eventually(lambda: ray.get(owner.stats.remote("dies")).tasks_waiting_send == 1)
    ray.kill(doomed)
    result = ray.get(sent, timeout=30)
    assert result["error"] == "BrokenResourceError"
    stats = ray.get(owner.stats.remote("dies"))
    assert (stats.open_receive_channels, stats.current_buffer_used) == (0, 0)  # buffered items dropped


def test_sender_process_death_fails_a_pending_receive(loop_thread: LoopThread, ray_env: None) -> None:
    doomed = Owner.remote()
    receive = open_receiver(ray.get(doomed.open.remote("tx", 4)))
    pending = asyncio.run_coroutine_threadsafe(receive.receive(), loop_thread.loop)
    eventually(lambda: ray.get(doomed.stats.remote("tx")).tasks_waiting_receive == 1)
    ray.kill(doomed)
    with pytest.raises(SenderDiedError, match="died") as err:
        pending.result(30)
    assert isinstance(err.value, BrokenResourceError)
    assert "ray.kill" in str(err.value)  # Ray's own words about the death
    with pytest.raises(SenderDiedError):
        run(loop_thread, receive.receive())


def test_cancelled_receive_leaves_the_item_for_another_process(
        owner: Any, consumer: Any, loop_thread: LoopThread) -> None:
    address = ray.get(owner.open.remote("cancel", 4))
    mine = open_receiver(address)
    ray.get(consumer.open.remote("cancel", address))  # a second receive handle, in another process
    # Cancelled in the driver while its take waits at the owner: the consumer gets the item.
    pending = asyncio.run_coroutine_threadsafe(mine.receive(), loop_thread.loop)
    eventually(lambda: ray.get(owner.stats.remote("cancel")).tasks_waiting_receive == 1)
    pending.cancel()
    eventually(lambda: ray.get(owner.stats.remote("cancel")).tasks_waiting_receive == 0)
    assert ray.get(owner.send_nowait.remote("cancel", 7)) == "ok"
    assert ray.get(owner.stats.remote("cancel")).current_buffer_used == 1  # counted, not received
    assert ray.get(consumer.receive_within.remote("cancel", 20)) == 7
    eventually(lambda: ray.get(owner.stats.remote("cancel")).current_buffer_used == 0)
    # Cancelled in the consumer's process: the driver gets the item.
    assert ray.get(consumer.receive_within.remote("cancel", 0.5)) is None
    assert ray.get(owner.send_nowait.remote("cancel", 8)) == "ok"
    assert run(loop_thread, mine.receive()) == Item(n=8)


def test_receives_cancelled_at_random_lose_and_duplicate_nothing(
        owner: Any, consumer: Any, loop_thread: LoopThread) -> None:
    address = ray.get(owner.open.remote("stress", 8))
    mine = open_receiver(address)
    ray.get(consumer.open.remote("stress", address))
    theirs = consumer.drain.remote("stress")
    sent = owner.send.remote("stress", list(range(300)), close=True)
    rng = random.Random(0)

    async def receive_with_timeouts() -> tuple[list[int], int]:
        # Every other receive is cancelled at a random moment of its first
        # milliseconds; the ones between wait for their item. Without those, a busy
        # machine's owner falls behind a flood of cancelled receives (thousands).
        got, cancelled = [], 0
        for i in itertools.count():
            try:
                got.append((await asyncio.wait_for(mine.receive(), rng.uniform(0, 0.004) if i % 2 else 20)).n)
            except TimeoutError:
                cancelled += 1
            except EndOfStream:
                return got, cancelled
        raise AssertionError("unreachable")
    got, cancelled = run(loop_thread, receive_with_timeouts(), timeout=60)
    assert ray.get(sent)["error"] is None
    both = got + ray.get(theirs, timeout=30)
    assert sorted(both) == list(range(300))  # none lost, none twice
    assert cancelled > 0 and got


def test_send_clones_end_the_stream_together_and_receivers_split_items(
        owner: Any, consumer: Any, loop_thread: LoopThread) -> None:
    address = ray.get(owner.open.remote("a", 4))
    ray.get(owner.clone.remote("a", "b"))
    mine = open_receiver(address)
    ray.get(consumer.open.remote("split", address))
    theirs = consumer.drain.remote("split")

    async def drain() -> list[int]:
        return [item.n async for item in mine]
    got = asyncio.run_coroutine_threadsafe(drain(), loop_thread.loop)
    assert ray.get(owner.send.remote("a", list(range(40)), close=True))["error"] is None
    ready, _ = ray.wait([theirs], timeout=1.0)
    assert not ready and not got.done()  # "b" is still open: no end of stream
    assert ray.get(owner.send.remote("b", list(range(40, 60)), close=True))["error"] is None
    both = got.result(30) + ray.get(theirs, timeout=30)
    assert sorted(both) == list(range(60))


def test_receive_clones_keep_the_channel_open_until_the_last_closes(
        owner: Any, loop_thread: LoopThread) -> None:
    first = open_receiver(ray.get(owner.open.remote("rclone", 4)))
    second = first.clone()
    run(loop_thread, first.aclose())
    assert ray.get(owner.send_nowait.remote("rclone", 1)) == "ok"
    assert run(loop_thread, second.receive()) == Item(n=1)
    with pytest.raises(ClosedResourceError):
        first.clone()
    assert ray.get(owner.send_nowait.remote("rclone", 2)) == "ok"
    run(loop_thread, second.aclose())
    assert ray.get(owner.send_nowait.remote("rclone", 3)) == "BrokenResourceError"
    assert ray.get(owner.stats.remote("rclone")).current_buffer_used == 0  # item 2 was dropped


def test_closing_a_handle_fails_its_pending_receive(owner: Any, loop_thread: LoopThread) -> None:
    receive = open_receiver(ray.get(owner.open.remote("closing", 4)))
    pending = asyncio.run_coroutine_threadsafe(receive.receive(), loop_thread.loop)
    eventually(lambda: ray.get(owner.stats.remote("closing")).tasks_waiting_receive == 1)
    loop_thread.loop.call_soon_threadsafe(receive.close)
    with pytest.raises(ClosedResourceError):
        pending.result(30)
    eventually(lambda: ray.get(owner.send_nowait.remote("closing", 1)) == "BrokenResourceError")


def test_a_slow_consumer_keeps_at_most_capacity_items_buffered(owner: Any, loop_thread: LoopThread) -> None:
    receive = open_receiver(ray.get(owner.open.remote("slow", 4)))
    sent = owner.send.remote("slow", list(range(200)), size=MB, close=True)

    async def consume_slowly() -> int:
        total = 0
        async for item in receive:
            assert item.payload == bytes([item.n % 256]) * MB
            total += len(item.payload)
            await asyncio.sleep(0.005)
        return total
    assert run(loop_thread, consume_slowly(), timeout=90) == 200 * MB
    result = ray.get(sent)
    assert result["error"] is None
    assert max(result["used"]) <= 4
    growth = max(result["private"]) - result["private"][20]  # after warm-up
    # Kept items would grow it by about 200 MB; in busy full suites the growth
    # without them measured 54 and 58 MB.
    assert growth < 100 * MB, f"the owner grew by {growth / MB:.0f} MB while 200 MB went through"
