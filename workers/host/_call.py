"""The wire form of one group call as one rank sees it, and of its failure."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from channels import Piece, PullPlan

_WIRE = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class DataArg(msgspec.Struct, **_WIRE):
    """A data argument: which rows to pull (None: this rank gets none)."""

    name: str
    plan: PullPlan | None


class StreamSpec(msgspec.Struct, **_WIRE):
    """How a streamed call reports its rows (see ``workers.host._streaming``)."""

    micro_batch: int
    """Rows (at least; whole chunks) per reported micro-batch."""
    progress_below: int = 0
    """Report progress (the pending count without rows) only while at most this
    many samples are pending on the rank: the driver needs exact counts only near
    its migration threshold (0: only the first count)."""


class CallSpec(msgspec.Struct, **_WIRE):
    """One rank's part of a group call.

    The pieces of every data argument's plan arrive, in order, as the positional
    tensor arguments of ``execute``: a fetched piece, or None for a piece in this
    worker's own store.
    """

    call_id: int
    role: str
    method: str
    out_key: str
    data_args: tuple[DataArg, ...] = ()
    stream: StreamSpec | None = None
    """Set when the call streams (its channel was opened by ``open_stream``)."""
    trace: bool = False
    """Time the call and its pulls (``RankResult.timing``)."""


class CallArgs(NamedTuple):
    """Everything one call carries to a rank but the rows it pulls, as one argument
    of ``WorkerProcess.execute``: Ray serializes each argument of an actor call on
    its own, at about 0.1 ms apiece on a laptop core."""

    spec: bytes
    """The msgpack-encoded :class:`CallSpec`."""
    kwargs: Mapping[str, Any]
    """The method's non-data arguments."""
    transforms: Mapping[str, Sequence[Any]]
    """Per data argument, the ``BoundTransform`` s applied in order to the pulled
    rows before the method sees them."""
    free: Sequence[str] = ()
    """Shards no future names any more, dropped first (``WorkerProcess.free``: the
    driver sends them along instead of in a call of their own)."""


def pieces_by_worker(pieces: Sequence[Piece], worker: int) -> dict[int, list[Piece]]:
    """The pieces ``worker`` must fetch, grouped by the worker holding them (in
    order of first appearance): one transfer per producer, not one per piece."""
    groups: dict[int, list[Piece]] = {}
    for p in pieces:
        if p.worker != worker:
            groups.setdefault(p.worker, []).append(p)
    return groups


def ungroup(pieces: Sequence[Piece], worker: int, fetched: Sequence[Sequence[Any]]) -> list[Any]:
    """Per piece, its fetched columns (None: ``worker`` holds it), from the groups
    of :func:`pieces_by_worker` in the same order."""
    queues = {w: iter(group) for w, group in zip(pieces_by_worker(pieces, worker), fetched, strict=True)}
    return [None if p.worker == worker else next(queues[p.worker]) for p in pieces]


class RankError(Exception):
    """How a rank reports a failed call to the driver (pickled through Ray).

    Attributes:
        cause: ``"<ExceptionType>: <message>"`` of what the rank raised.
        remote_traceback: the rank's traceback, as text.
        peer_failure: True when the rank failed because a peer broke a collective
            it was in (the peer's error is the cause worth reporting).
        error: the original exception when it pickles (e.g. an asyncflow error a
            role raised on purpose), else None.
    """

    def __init__(self, cause: str, remote_traceback: str, *, peer_failure: bool = False,
                 error: BaseException | None = None) -> None:
        super().__init__(cause)
        self.cause, self.remote_traceback = cause, remote_traceback
        self.peer_failure, self.error = peer_failure, error

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_rank_error, (self.cause, self.remote_traceback, self.peer_failure, self.error))

    @classmethod
    def from_exception(cls, exc: BaseException, *, peer_failure: bool) -> RankError:
        """The wire form of ``exc``, raised by a role method on this rank."""
        text = "".join(traceback.format_exception(exc))
        try:
            pickle.dumps(exc)
            original: BaseException | None = exc.with_traceback(None)
        except Exception:
            original = None
        return cls(f"{type(exc).__name__}: {exc}", text, peer_failure=peer_failure, error=original)


def _rebuild_rank_error(cause: str, tb: str, peer: bool, error: BaseException | None) -> RankError:
    return RankError(cause, tb, peer_failure=peer, error=error)
