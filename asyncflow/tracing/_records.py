"""What a trace holds: one record per call, with one span per rank and per pull.

Every time is in seconds on the driver's clock (``time.time()``): the workers
record their spans with their own clocks and the driver shifts them by each
worker's measured offset before they land here (see ``asyncflow.runtime._tracer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class PullSpan:
    """A rank assembling one piece of a call's input rows."""

    start: float
    end: float
    source: int
    """Session-wide index of the worker the rows came from (the rank's own index:
    a piece it held itself)."""
    rows: int
    bytes: int
    """Bytes that travelled (0 for a piece the rank held)."""


@dataclass(frozen=True, kw_only=True)
class RankSpan:
    """One rank's part of one call: from the method's start to its return."""

    pool: str
    rank: int
    worker: int
    start: float
    end: float
    rows: int
    """Rows the rank produced (0: it returned a value)."""
    rows_in: int = 0
    """Rows of the rank's largest data argument."""
    bytes_pulled: int
    """Bytes of input rows that reached the rank from other workers."""
    pulls: tuple[PullSpan, ...] = ()
    cpu_s: float = 0.0
    """CPU seconds the rank's calling thread ran in the span: below
    :attr:`seconds` by what it spent waiting (for a peer's rows or collective,
    a lock, or a core the machine's other processes held)."""

    @property
    def seconds(self) -> float:
        """The span's length."""
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One group call as the driver saw it, with its ranks' spans."""

    call_id: int
    role: str
    method: str
    pool: str
    rank_local: bool
    """The call could run on some of the pool's ranks only (``Role.rank_local``)."""
    deps: tuple[int, ...]
    """Calls whose whole output this call read."""
    parts: tuple[tuple[int, int], ...] = ()
    """``(call id, micro-batch number)`` of streamed outputs this call read (the
    call depends on that micro-batch only, not on the whole producer)."""
    step: int = 0
    """The step (``Tracer.mark_step``) in which the driver submitted the call."""
    place: tuple[int, int] = (0, 0)
    """The call's place in its pool's queue order, session-wide: a call made on a
    stream takes the place the stream reserved, ahead of calls made after the
    stream (``Trace.calls`` is in this order)."""
    submitted: float
    started: float
    """When the pool's dispatcher started it (inputs ready, lanes free)."""
    finished: float
    ok: bool = True
    """False: the call failed or was cancelled."""
    ranks: tuple[RankSpan, ...] = ()
    part_times: tuple[float, ...] = ()
    """A streamed call: when each of its micro-batches reached the driver (number
    ``k`` at index ``k - 1``)."""

    @property
    def label(self) -> str:
        """``role.method#id``."""
        return f"{self.role}.{self.method}#{self.call_id}"

    @property
    def seconds(self) -> float:
        """From dispatch to completion, as the driver measured it."""
        return self.finished - self.started


@dataclass(kw_only=True)
class Trace:
    """The calls of a traced stretch of a run.

    Attributes:
        calls: the records, in queue order (``CallRecord.place``): submission
            order, except that calls made on a stream sit where the stream was.
        pools: ranks per pool.
        roles: the pool of each role.
        start: when tracing started (driver clock).
        end: when it stopped.
        steps: start time of each step marked while tracing.
    """

    calls: list[CallRecord] = field(default_factory=list)
    pools: dict[str, int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    steps: list[float] = field(default_factory=list)
