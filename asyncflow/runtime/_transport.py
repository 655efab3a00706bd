"""How the scheduler reaches the workers: a small protocol, and its Ray implementation.

The scheduler plans calls from metadata alone and talks to workers only through a
:class:`Transport`: run a method on a rank (its rows pulled peer to peer), store
rows, fetch rows to the driver, free shards, poison and heal a rank's groups, and
learn of a worker's death. :class:`RayTransport` does this with Ray actors (on
the CPU, a call and its producers' sends go on each worker's control connection
instead, ``asyncflow.runtime._control``): rows go worker to worker over the
session's gloo process group on the CPU
(``workers.host._pulls``) and by Ray Direct Transport over NCCL on GPUs;
``asyncflow.runtime._local.LocalTransport`` does it in-process for unit tests of
the scheduler without Ray.

Failures reach the scheduler in two forms only: :class:`~workers.RankError` (the
method raised on the rank) and :class:`WorkerGone` (a worker process died: the
callee, or a producer the callee pulled rows from).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import ray
import torch

from asyncflow.runtime._control import ConnectionLost, Control
from channels import Piece, RankResult, StoreStats, open_receiver
from workers import PULL_TAGS, CallArgs, NotRun, Pull, RankError, pieces_by_worker

BLAME_S = 10.0
"""Seconds a consumer's failed receive waits to learn whether its producer died."""

BoundTransforms = Mapping[str, Sequence[tuple[Any, Mapping[str, Any]]]]
"""Per data argument, its bound transforms as ``(fn, kwargs)`` pairs, applied where the
rows land."""


class WorkerGone(Exception):
    """Worker ``worker`` (session-wide index; -1 when unknown) died.

    Attributes:
        worker: the dead worker's index.
        detail: the runtime's report.
    """

    def __init__(self, worker: int, detail: str) -> None:
        super().__init__(f"worker {worker} died: {detail}")
        self.worker, self.detail = worker, detail


class Transport(Protocol):
    """What the scheduler needs from the workers (see the module docstring)."""

    async def execute(self, worker: int, spec: bytes, kwargs: Mapping[str, Any], transforms: BoundTransforms,
                      pieces: Sequence[Piece], free: Sequence[str] = ()) -> RankResult:
        """Run one rank's part of a call; ``pieces`` not held by ``worker`` are
        pulled straight from their producers. ``free``: shards of ``worker`` that no
        future names any more, dropped first (a ``free`` without a round trip of its own).

        Raises:
            RankError: the method raised.
            WorkerGone: ``worker`` or a producer of ``pieces`` died.
        """
        ...

    async def put(self, worker: int, key: str, columns: Mapping[str, torch.Tensor], group_size: int) -> RankResult:
        """Store rows from the driver on ``worker``."""
        ...

    async def fetch(self, pieces: Sequence[Piece]) -> list[dict[str, torch.Tensor]]:
        """Bring pieces to the driver."""
        ...

    async def free(self, worker: int, keys: Sequence[str]) -> Any:
        """Drop shards on ``worker``."""
        ...

    async def poison(self, worker: int) -> None:
        """Drop ``worker``'s group connections (peers blocked on it fail at once)."""
        ...

    async def heal(self, worker: int, epoch: int) -> None:
        """Reconnect ``worker``'s groups (collective over its pool)."""
        ...

    async def watch(self, worker: int) -> None:
        """Return never while ``worker`` lives; raise :class:`WorkerGone` when it dies."""
        ...

    def on_disconnect(self, fn: Callable[[int, bool], None]) -> None:
        """Have ``fn(worker, busy)`` called as soon as ``worker``'s own connection to
        the driver closes, which only its process's end does: ``busy`` says whether
        a call sent to it had not answered then. The earliest sign of a death (the
        death itself is known from :meth:`watch` or a failed call); never called
        where the workers have no such connection."""
        ...

    async def stats(self, worker: int) -> StoreStats:
        """``worker``'s shard-store counters."""
        ...

    async def clock(self, worker: int) -> float:
        """``worker``'s ``time.time()`` (to align traced spans)."""
        ...

    async def open_stream(self, worker: int, call_id: int, capacity: int) -> Any:
        """Open streamed call ``call_id``'s channel on ``worker`` (before the call
        runs); returns its receive end: an async iterator of
        :class:`~channels.StreamItem` with ``aclose()``, raising when ``worker``
        dies."""
        ...

    async def stream_control(self, worker: int, call_id: int, action: str, count: int) -> bool:
        """``"handoff"`` or ``"expect"`` (``count`` tails) to a running streamed call;
        False when the call is over on ``worker``."""
        ...

    async def stream_adopt(self, worker: int, call_id: int, piece: Piece | None, group_size: int) -> None:
        """Deliver a tail (pulled by ``worker`` straight from its producer), or None."""
        ...


class RayTransport:
    """:class:`Transport` over Ray actors (``workers.WorkerProcess``).

    Args:
        actors: worker actor handles by session-wide index.
        actor_ids: their Ray actor ids (hex), to name a dead producer.
        rows_by: ``"gloo"``: rows go worker to worker over the session's process
            group (``workers.host._pulls``); ``"nccl"``: by Ray Direct Transport;
            None: through the object store.
        controls: the workers' control connections, by index
            (``asyncflow.runtime._control``): ``execute`` and ``send_slices`` go
            on them, without a Ray task each; none: both are Ray calls.
    """

    def __init__(self, actors: Sequence[Any], actor_ids: Sequence[str], rows_by: str | None,
                 controls: Sequence[Control] = ()) -> None:
        self._actors = list(actors)
        self._controls = list(controls)
        self._index = {a: i for i, a in enumerate(actor_ids)}
        self._rows_by = rows_by
        self._tags = itertools.count()

    def _slice(self, p: Piece) -> Any:
        method = self._actors[p.worker].slice
        if self._rows_by is not None:
            method = method.options(tensor_transport=self._rows_by)
        return method.remote(p.key, p.lo, p.hi, p.fields)

    def _slices(self, worker: int, pieces: Sequence[Piece]) -> Any:
        method = self._actors[worker].slices
        if self._rows_by is not None:
            method = method.options(tensor_transport=self._rows_by)
        return method.remote(list(pieces))

    async def _call(self, worker: int, ref: Any) -> Any:
        try:
            return await ref
        except ray.exceptions.RayTaskError as e:
            raise self._unwrap(e) from None
        except ray.exceptions.RayActorError as e:
            raise WorkerGone(self._index.get(e.actor_id or "", worker), _first_lines(str(e))) from None

    def _unwrap(self, e: ray.exceptions.RayTaskError) -> Exception:
        cause = e.cause
        if isinstance(cause, RankError):
            return cause
        if isinstance(cause, ray.exceptions.RayActorError):  # an argument's producer died
            return WorkerGone(self._index.get(cause.actor_id or "", -1), _first_lines(str(cause)))
        text = f"{type(cause).__name__}: {cause}" if cause is not None else type(e).__name__
        return _NotRun(text, getattr(e, "traceback_str", "") or str(e))

    async def execute(self, worker: int, spec: bytes, kwargs: Mapping[str, Any], transforms: BoundTransforms,
                      pieces: Sequence[Piece], free: Sequence[str] = ()) -> RankResult:
        groups = pieces_by_worker(pieces, worker)
        if self._rows_by != "gloo":
            handles = [self._slices(w, group) for w, group in groups.items()]
            result: RankResult = await self._call(
                worker, self._actors[worker].execute.remote(CallArgs(spec, kwargs, transforms, tuple(free)), *handles))
            return result
        # The call is submitted before the sends: if its arguments cannot be
        # serialized, no send waits for a receive that never comes.
        pulls = [Pull(w, self._tag()) for w in groups]
        args = CallArgs(spec, kwargs, transforms, tuple(free))
        control = self._control(worker)
        if control is not None:
            answer = self._answer(worker, control.execute(args, pulls))
        else:
            answer = self._call(worker, self._actors[worker].execute.remote(args, *pulls))
        for pull, group in zip(pulls, groups.values(), strict=True):
            self._post(pull, worker, group)
        try:
            result = await answer
        except _NotRun:  # the rank never received its rows (its arguments failed to load): it takes them now
            self._actors[worker].drop_pulls.remote(pulls)
            raise
        except RankError as e:
            if e.peer_failure and pulls:
                await self._blame_producers([p.source for p in pulls])
            raise
        return result

    def _control(self, worker: int) -> Control | None:
        """``worker``'s control connection while it is open; None: call by Ray."""
        control = self._controls[worker] if self._controls else None
        return None if control is None or control.lost else control

    async def _answer(self, worker: int, fut: asyncio.Future[Any]) -> Any:
        """What a call on ``worker``'s control connection returned, its errors as
        :meth:`_call` raises them."""
        try:
            return await fut
        except NotRun as e:
            raise _NotRun(e.text, e.traceback_str) from None
        except ConnectionLost as e:
            raise WorkerGone(worker, str(e)) from None

    def _tag(self) -> int:
        return next(self._tags) % (2**31 // PULL_TAGS) * PULL_TAGS

    def _post(self, pull: Pull, dst: int, pieces: Sequence[Piece]) -> None:
        """Have worker ``pull.source`` send ``pieces`` to worker ``dst``, which
        receives them by ``pull``."""
        control = self._control(pull.source)
        if control is None or not control.send_slices(dst, pull.tag, pieces):
            self._actors[pull.source].send_slices.remote(dst, pull.tag, list(pieces))

    async def _blame_producers(self, workers: Sequence[int]) -> None:
        """Raise :class:`WorkerGone` for the first of ``workers`` that died (a
        consumer's receive fails when its producer dies mid-transfer), if Ray
        says so within :data:`BLAME_S`."""
        checks = [asyncio.ensure_future(self._call(w, self._actors[w].clock.remote())) for w in workers]
        done, pending = await asyncio.wait(checks, timeout=BLAME_S)
        for task in pending:
            task.cancel()
        for task in checks:
            if task in done and isinstance(task.exception(), WorkerGone):
                raise task.exception()  # type: ignore[misc]

    async def put(self, worker: int, key: str, columns: Mapping[str, torch.Tensor], group_size: int) -> RankResult:
        result: RankResult = await self._call(worker, self._actors[worker].put.remote(key, columns, group_size))
        return result

    async def fetch(self, pieces: Sequence[Piece]) -> list[dict[str, torch.Tensor]]:
        refs = [self._actors[p.worker].slice_to_host.remote(p.key, p.lo, p.hi, p.fields) for p in pieces]
        return [await self._call(p.worker, r) for p, r in zip(pieces, refs, strict=True)]

    async def free(self, worker: int, keys: Sequence[str]) -> Any:
        return await self._call(worker, self._actors[worker].free.remote(list(keys)))

    async def poison(self, worker: int) -> None:
        await self._call(worker, self._actors[worker].poison.remote())

    async def heal(self, worker: int, epoch: int) -> None:
        await self._call(worker, self._actors[worker].heal.remote(epoch))

    async def watch(self, worker: int) -> None:
        await self._call(worker, self._actors[worker].watch.remote())

    def on_disconnect(self, fn: Callable[[int, bool], None]) -> None:
        for worker, control in enumerate(self._controls):
            control.on_lost = functools.partial(fn, worker)

    async def stats(self, worker: int) -> StoreStats:
        result: StoreStats = await self._call(worker, self._actors[worker].stats.remote())
        return result

    async def clock(self, worker: int) -> float:
        t: float = await self._call(worker, self._actors[worker].clock.remote())
        return t

    async def open_stream(self, worker: int, call_id: int, capacity: int) -> Any:
        address = await self._call(worker, self._actors[worker].open_stream.remote(call_id, capacity))
        return open_receiver(address)

    async def stream_control(self, worker: int, call_id: int, action: str, count: int) -> bool:
        ok: bool = await self._call(worker, self._actors[worker].stream_control.remote(call_id, action, count))
        return ok

    async def stream_adopt(self, worker: int, call_id: int, piece: Piece | None, group_size: int) -> None:
        rows: Any = None  # a target is never its own source
        if piece is not None and self._rows_by == "gloo":
            rows = Pull(piece.worker, self._tag())
            self._post(rows, worker, [piece])
        elif piece is not None:
            rows = self._slice(piece)
        try:
            await self._call(worker, self._actors[worker].stream_adopt.remote(call_id, group_size, rows))
        except RankError:
            if isinstance(rows, Pull):
                await self._blame_producers([rows.source])
            raise


class _NotRun(RankError):
    """A worker's task raised something other than a :class:`~workers.RankError`
    (a :class:`~workers.RankError` to the scheduler). From ``execute``, whose body
    wraps every error in one, it means the task failed before its body ran (e.g.
    its arguments did not load), so before the rank received its rows."""


def _first_lines(text: str, n: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:n])
