"""``StopRequest``: during the steps the first SIGTERM/SIGINT asks the run to stop
after its step, a second cancels it where it stands; before them, and in
synchronous work on the loop, the first stops it at once; removing it gives the
default handlers back.
Real signals to this process, no Ray."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncflow.train._signals import ONE_REQUEST_S, StopRequest


def test_the_first_signal_asks_for_a_stop_and_a_second_cancels_the_run() -> None:
    said: list[str] = []

    async def run() -> StopRequest:
        stop = StopRequest(said.append)
        stop.install()
        stop.begin_steps()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # the loop runs the handler
            assert stop.signal == "SIGTERM" and not stop.now
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)  # the step the second signal stops at once
            assert stop.now
        finally:
            stop.remove()
        return stop

    asyncio.run(run())
    assert len(said) == 1 and said[0].startswith("SIGTERM: stopping after this step")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_one_signal_delivered_twice_at_once_is_one_request() -> None:
    """As ``timeout`` sends it: to the command, then to its process group. The same
    signal again later stops the run at once."""
    async def run() -> StopRequest:
        stop = StopRequest(lambda line: None)
        stop.install()
        stop.begin_steps()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)  # the loop runs both handlers
            assert stop.signal == "SIGTERM" and not stop.now
            await asyncio.sleep(ONE_REQUEST_S)
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)
            assert stop.now
        finally:
            stop.remove()
        return stop

    asyncio.run(run())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_before_the_steps_the_first_signal_stops_at_once() -> None:
    async def run() -> StopRequest:
        stop = StopRequest(lambda line: None)
        stop.install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)  # start-up: nothing to finish
        finally:
            stop.remove()
        return stop

    stop = asyncio.run(run())
    assert (stop.signal, stop.now, stop.stepping) == ("SIGTERM", True, False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_synchronous_work_on_the_loop_where_it_stands(sig: signal.Signals) -> None:
    """An SFT warm start runs on the loop's thread: the loop's handlers would run only
    at its end."""
    async def run() -> tuple[StopRequest, int]:
        stop = StopRequest(lambda line: None)
        stop.install()
        rounds = 0
        try:
            with pytest.raises(asyncio.CancelledError), stop.blocking():
                os.kill(os.getpid(), sig)
                while rounds < 10_000_000:  # busy, no await
                    rounds += 1
        finally:
            stop.remove()
        return stop, rounds

    stop, rounds = asyncio.run(run())
    assert (stop.signal, stop.now) == (sig.name, True) and rounds < 10_000_000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
