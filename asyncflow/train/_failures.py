"""How a run that stopped early says so: which process died or stalled on which
node, or which signal stopped it, and the checkpoint to continue from."""

from __future__ import annotations

from asyncflow.runtime import (
    CallTimeoutError,
    PoolBrokenError,
    Session,
    WorkerDiedError,
    head_answers,
)
from channels import AsyncflowError


class RunInterruptedError(AsyncflowError):
    """A run stopped because a worker process died, a call on it stalled past its
    timeout (a weight pull), or SIGTERM / SIGINT asked it to (see
    :class:`~asyncflow.train._signals.StopRequest`: after the step under way, or at
    once before the first step or at a second signal); the message names why and the
    checkpoint to continue from."""


def interrupted(error: WorkerDiedError | CallTimeoutError | PoolBrokenError, session: Session,
                where: str, *, signal: str | None = None) -> RunInterruptedError:
    """One line: which process died (or stalled) on which node, then ``where`` (the
    checkpoint to continue from); first, when a stop ``signal`` came before and
    Ray's own processes are gone, that the signal ended them too."""
    if signal is not None and not head_answers():
        return RunInterruptedError(f"stopped by {signal}, which ended Ray's own processes too (it was sent to the "
                                   f"whole process group), and with them the step under way; {where}")
    died = error.cause if isinstance(error, PoolBrokenError) else error
    assert isinstance(died, WorkerDiedError | CallTimeoutError)
    who = f"{died.role} " if died.role else ""
    doing = (f" during {died.role}.{died.method}" if died.role
             else " between calls" if "between calls" in died.cause else "")
    if isinstance(died, CallTimeoutError):
        return RunInterruptedError(f"{died.role}.{died.method} stalled on rank {died.rank} of pool {died.pool!r}: "
                                   f"{died.cause}; {where}")
    process = f"the {who}worker process of rank {died.rank} in pool {died.pool!r}"
    try:
        node = session.where(died.pool, died.rank)
        if session.has_left(node):
            return RunInterruptedError(f"{node.describe()} left the Ray cluster: {process} died{doing}; {where}")
        process += f" on {node.describe()}"
    except KeyError:  # not a rank of a pool (a producer's label)
        pass
    return RunInterruptedError(f"{process} died{doing}; {where}")
