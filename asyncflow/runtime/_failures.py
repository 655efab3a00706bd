"""From what the ranks of a failed call reported to the one error its caller sees.

A rank reports a :class:`~workers.RankError` (its method raised; a *peer failure*
when the rank only failed because another broke a collective it was in) or the
transport reports :class:`~asyncflow.runtime._transport.WorkerGone` (a process died). The
caller sees the most telling one: a death or a rank's own error before any peer
failure. Errors are stored without tracebacks, whose frames would keep the call's
inputs (and through them shards) alive.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from asyncflow.runtime._calls import Call
from asyncflow.runtime._errors import RemoteStageError, WorkerDiedError
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._transport import WorkerGone
from channels import AsyncflowError
from workers import RankError


def primary_error(call: Call, pool: str, failures: Mapping[int, BaseException],
                  gone: Callable[[int, WorkerGone], WorkerDiedError]) -> AsyncflowError | None:
    """The error worth reporting for the failures so far (None: only peer failures).

    Args:
        call: the failed call.
        pool: its pool's name.
        failures: each failed rank's report, by rank.
        gone: maps a rank's :class:`WorkerGone` to the public error.
    """
    for rank in sorted(failures):
        exc = failures[rank]
        if isinstance(exc, WorkerGone):
            return gone(rank, exc)
        if isinstance(exc, RankError) and not exc.peer_failure:
            if isinstance(exc.error, RemoteStageError):
                return exc.error
            return RemoteStageError(role=call.role, method=call.method, rank=rank, pool=pool,
                                    cause=exc.cause, remote_traceback=exc.remote_traceback, error=exc.error)
        if not isinstance(exc, RankError):
            return RemoteStageError(role=call.role, method=call.method, rank=rank, pool=pool,
                                    cause=f"{type(exc).__name__}: {exc}")
    return None


def peer_error(call: Call, pool: str, failures: Mapping[int, BaseException]) -> RemoteStageError:
    """The error to report when every rank failed only because of a peer (e.g. all
    timed out in a collective)."""
    rank = min(failures)
    exc = failures[rank]
    assert isinstance(exc, RankError)
    return RemoteStageError(role=call.role, method=call.method, rank=rank, pool=pool,
                            cause=f"a peer rank broke a collective: {exc.cause}",
                            remote_traceback=exc.remote_traceback)


def producer_of(call: Call, worker: int) -> str:
    """The label (``role.method#id``) of the call whose rows ``call`` pulled from ``worker``."""
    for fut in call.data_args.values():
        cached = fut._cached
        if isinstance(cached, Resolved):
            for g in cached.meta.groups:
                for s in g.segments:
                    if s.worker == worker:
                        return s.key
    return "?.?"


def settle(call: Call, exc: BaseException) -> None:
    if not call.result.done():
        call.result.set_exception(detach(exc))


def detach(exc: BaseException) -> BaseException:
    """``exc`` without tracebacks (their frames would keep the call's inputs, and
    through them shards, alive for as long as anyone holds the error)."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return exc
