"""What a run does between its steps beside training: stop when asked (SIGTERM,
SIGINT) and trace its first steps."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from asyncflow.runtime import Session

Say = Callable[[str], None]
"""Where a run's messages go."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

ONE_REQUEST_S = 0.5
"""A signal again within this many seconds of the first is the same request:
``timeout`` sends its signal to the command and then to the command's whole
process group, so the command gets it twice at once."""


class StopRequest:
    """SIGTERM or SIGINT (Ctrl-C) during a run. The first ends the run at the next
    step boundary, after a checkpoint of that step, so that a preempted job loses
    no step it finished; a second one ends it at once (the last checkpoint stays),
    unless it is the same signal within :data:`ONE_REQUEST_S` of the first.

    Before the steps (:meth:`begin_steps`: start-up, a warm start, the first
    evaluation) there is no step to finish: the first signal ends the run at once.

    Installed on the running loop for the run's duration, once Ray started (its
    driver installs its own SIGTERM handler, which prints a native stack trace);
    :meth:`remove` gives the default handlers back. Synchronous work on the loop's
    thread (an SFT warm start) runs under :meth:`blocking`, where the loop's
    handlers would run only at its end.
    """

    def __init__(self, say: Say) -> None:
        self.say = say
        self.signal: str | None = None
        """The first signal's name; None while no stop was asked for."""
        self.now = False
        """A second signal came: the run was cancelled where it stood."""
        self._task: asyncio.Task[object] | None = None
        self._first_at = 0.0
        self.stepping = False
        """The RL steps began (:meth:`begin_steps`)."""

    def install(self) -> None:
        """Catch the stop signals on the running loop (its current task is the run)."""
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)

    def begin_steps(self) -> None:
        """From now on the first signal waits for the step under way."""
        self.stepping = True

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Synchronous work on the loop's thread: a stop signal ends it where it
        stands (``asyncio.CancelledError`` raised in it, as the run's cancellation)."""
        def cancel(signum: int, _frame: object) -> None:
            self.signal, self.now = self.signal or signal.Signals(signum).name, True
            raise asyncio.CancelledError

        before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, cancel)
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def remove(self) -> None:
        """Give the stop signals their default handlers back."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)  # SIGINT gets default_int_handler back, SIGTERM SIG_DFL

    def _received(self, sig: signal.Signals) -> None:
        if self.signal is None and not self.stepping:  # nothing to finish: stop where the run stands
            self.signal, self.now = sig.name, True
            if self._task is not None:
                self._task.cancel()
            return
        if self.signal is None:
            self.signal, self._first_at = sig.name, time.monotonic()
            self.say(f"{sig.name}: stopping after this step, once its checkpoint is written "
                     f"({sig.name} again stops at once)")
            return
        if sig.name == self.signal and time.monotonic() - self._first_at < ONE_REQUEST_S:
            return  # the first one, delivered again (to the process and to its group)
        if not self.now and self._task is not None:
            self.now = True
            self._task.cancel()


class TracedSteps:
    """Traces the first ``steps`` RL steps of a run into ``out``."""

    def __init__(self, session: Session, out: Path, steps: int, *, say: Say) -> None:
        self.session, self.out, self.left, self.say = session, out, steps, say
        self.on = False

    async def before_step(self) -> None:
        """Start tracing (the first step) and mark the step."""
        if self.left and not self.on:
            await self.session.start_trace()
            self.on = True
        if self.on:
            self.session.mark_step()

    def after_step(self) -> None:
        """Count the step; after the last, write the trace."""
        if self.on:
            self.left -= 1
            if not self.left:
                self.close()

    def close(self) -> None:
        """Write ``timeline.png`` and ``trace.json`` of the steps traced so far."""
        if not self.on:
            return
        self.on, self.left = False, 0
        from asyncflow.tracing import write_chrome_trace, write_timeline_png

        trace = self.session.stop_trace()
        png = write_timeline_png(trace, self.out / "timeline.png", title=f"{len(trace.steps)} traced RL steps")
        write_chrome_trace(trace, self.out / "trace.json")
        self.say(f"trace of {len(trace.steps)} steps: {png} and {self.out / 'trace.json'} (ui.perfetto.dev)")
