"""A pool as the scheduler sees it: its ranks (lanes), its queue and its health.

The queue holds calls in call order and *slots*: the place of the calls a stream
will make, one per micro-batch (``roles.ref.log_prob(stream)``). A call made
later (``roles.actor.update(collect(...))``) may need those calls' rows, so they
take the slot's place in the queue, not the end of it, as they are made.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from asyncflow.runtime._calls import Call
from asyncflow.runtime._errors import CallTimeoutError, WorkerDiedError


@dataclass(eq=False, kw_only=True)
class Slot:
    """Where the calls of a stream of calls go in a pool's queue (see the module docstring)."""

    role: str
    rank_local: bool
    closed: bool = False
    """Every call of the stream was made (or the stream ended)."""
    place: int = 0
    """Its place in the session's queue order (see ``Call.place``)."""


@dataclass(eq=False, kw_only=True)
class PoolState:
    """A pool's workers, its queue, its free ranks and whether it can still take calls."""

    name: str
    workers: list[int]
    """Session-wide worker index of each rank."""
    died: asyncio.Future[WorkerDiedError | CallTimeoutError]
    """Resolved when one of the pool's worker processes died, or a call on it timed
    out (its rank may still be running it): the pool is broken either way."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the dispatcher may be able to start something."""
    epoch: int = 0
    """How many times the pool's groups were healed."""
    pending: list[Call | Slot] = field(default_factory=list)
    """Calls not started yet and open slots, in call order."""
    running: dict[int, Call] = field(default_factory=dict)
    holders: dict[int, list[int]] = field(default_factory=dict)
    """Per rank, the calls (ids) submitted to it and not finished, in order."""
    needs_heal: bool = False
    """A call failed: the groups must be reconnected before the next call that uses them."""
    healing: bool = False

    @property
    def broken(self) -> WorkerDiedError | CallTimeoutError | None:
        """The death (or timeout) that broke the pool, if any."""
        return self.died.result() if self.died.done() else None

    @property
    def free(self) -> list[int]:
        """Ranks running nothing."""
        return sorted(r for r, held in self.holders.items() if not held)

    def stackable(self) -> list[int]:
        """Busy ranks that may take one more rank-local call behind the one they run
        (it waits in the worker's queue, so the rank does not idle while the driver
        hears of the first and sends the next)."""
        return sorted(r for r, held in self.holders.items()
                      if len(held) == 1 and self.running[held[0]].rank_local)

    def calls(self) -> list[Call]:
        """The calls not started yet (no slots), in call order."""
        return [c for c in self.pending if isinstance(c, Call)]
