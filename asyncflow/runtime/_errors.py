"""Control-plane errors (the base classes live in ``channels``).

Each names where it happened in its first line; longer detail (a remote
traceback, Ray's own report) follows below it or sits in an attribute, so a
one-line report (the CLI's) shows the cause.
"""

from __future__ import annotations

from typing import Any

from channels import AsyncflowError


class RemoteStageError(AsyncflowError):
    """A role method raised on a worker.

    Attributes:
        role, method, rank, pool: where it failed.
        cause: ``"<ExceptionType>: <message>"`` of the remote error.
        remote_traceback: the worker's traceback, as text ("" when there is none).
        error: the exception the method raised, when it could travel to the driver
            (an ``OSError`` keeps its ``errno`` and ``filename``); None otherwise.
    """

    def __init__(self, *, role: str, method: str, rank: int, pool: str, cause: str,
                 remote_traceback: str = "", error: BaseException | None = None) -> None:
        self.role, self.method, self.rank, self.pool = role, method, rank, pool
        self.cause = cause
        self.remote_traceback = remote_traceback
        self.error = error
        super().__init__(self._message())

    def _message(self) -> str:
        if self.role or self.method:
            what = f"{self.role}.{self.method}" if self.role else self.method
            head = f"{what} failed on rank {self.rank} of pool {self.pool!r}: {self.cause}"
        else:  # no call to name (a process that died between calls)
            head = f"rank {self.rank} of pool {self.pool!r}: {self.cause}"
        if not self.remote_traceback:
            return head
        return f"{head}\nwhere the remote call failed:\n{self.remote_traceback}"

    def __reduce__(self) -> tuple[Any, ...]:  # keep picklable despite keyword-only __init__
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls: type[RemoteStageError], state: dict[str, Any]) -> RemoteStageError:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    Exception.__init__(obj, obj._message())
    return obj


class WorkerDiedError(RemoteStageError):
    """The worker process running a role method died (killed, out of memory,
    crashed), or a worker whose rows the method pulled died.

    ``role``, ``method``, ``rank`` and ``pool`` name the process that died and the
    call it was serving (for a producer: the call that made the rows), for every
    call the death fails: a call queued behind that one, or running on the pool's
    other ranks, says so in ``cause``. ``role`` and ``method`` are empty when the
    process served no call (it died between calls); ``cause`` then names the call
    that found it dead, if one did.

    Attributes:
        detail: Ray's report of the death, for debugging.
    """

    def __init__(self, *, role: str, method: str, rank: int, pool: str, cause: str,
                 detail: str = "") -> None:
        self.detail = detail
        super().__init__(role=role, method=method, rank=rank, pool=pool, cause=cause)


class CallTimeoutError(RemoteStageError):
    """A call given ``timeout_s`` did not finish in time on a rank (a stalled pull,
    a stuck process). The rank may still be running it, so its pool takes no more
    calls (they fail with :class:`PoolBrokenError`), as after a death.

    ``role``, ``method``, ``rank`` and ``pool`` name the call and the first rank
    that had not finished.

    Attributes:
        timeout_s: the call's timeout.
    """

    def __init__(self, *, role: str, method: str, rank: int, pool: str, cause: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(role=role, method=method, rank=rank, pool=pool, cause=cause)


class PoolBrokenError(AsyncflowError):
    """A pool can take no more calls: one of its worker processes died, or a call
    on it timed out (``timeout_s``).

    Attributes:
        pool: the pool's name.
        cause: the :class:`WorkerDiedError` (or :class:`CallTimeoutError`) that broke it.
    """

    def __init__(self, message: str, *, pool: str, cause: BaseException) -> None:
        super().__init__(message)
        self.pool, self.cause = pool, cause


class SessionClosedError(AsyncflowError):
    """The session was closed; its roles and futures can no longer be used."""
