"""Control-plane errors (the base classes live in ``channels``)."""

from __future__ import annotations

from channels import AsyncflowError


class RemoteStageError(AsyncflowError):
    """A role method raised on a worker.

    Attributes:
        role, method, rank: where it failed.
        remote_traceback: the worker's traceback, as text.
    """

    def __init__(self, *, role: str, method: str, rank: int, pool: str, cause: str, remote_traceback: str) -> None:
        self.role, self.method, self.rank, self.pool = role, method, rank, pool
        self.cause = cause
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{role}.{method} failed on rank {rank} of pool {pool!r}: {cause}\n"
            f"where the remote call failed:\n{remote_traceback}"
        )

    def __reduce__(self):  # keep picklable despite keyword-only __init__
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls, state):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    Exception.__init__(obj, str(state.get("cause")))
    return obj


class WorkerDiedError(RemoteStageError):
    """The worker process running a role method died (killed, out of memory, crashed)."""


class PoolBrokenError(AsyncflowError):
    """A pool can take no more calls because an earlier call failed on it."""


class SessionClosedError(AsyncflowError):
    """The session was closed; its roles and futures can no longer be used."""
