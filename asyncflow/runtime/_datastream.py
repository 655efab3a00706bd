"""``DataStream``: micro-batches of a streamed call, as metadata-only futures.

``roles.actor.generate(prompts, stream=True)`` returns a :class:`DataStream` at
once: an async iterator of :class:`DataFuture` s, one per micro-batch of finished
samples, in completion order. Passing a stream to another group's method returns
a stream too (one call per micro-batch, each pulling its rows peer to peer as
soon as they exist); ``merge`` zips streams micro-batch by micro-batch and
:func:`collect` gives one future of every row in the original order.

A stream can be iterated by any number of consumers, each from the start; the
micro-batch futures stay named (their rows kept) while the stream is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from asyncflow.runtime._future import DataFuture
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._transform import BoundTransform
from channels import BatchMeta, ConfigError, SchemaError, collect_parts

T = TypeVar("T")
logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], Any]


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How a streamed call reports its rows: ``generate(prompts, stream=StreamOptions(...))``
    (``stream=True`` takes the defaults)."""

    micro_batch: int = 8
    """Rows per micro-batch a rank reports (at least; groups are never split)."""
    buffer: int = 4
    """Micro-batches a rank may have reported but the driver not yet received
    before the rank waits (its channel's capacity)."""
    migrate: int | Literal["auto"] | None = "auto"
    """Long-tail migration: when this many samples (or fewer) are still generating,
    move them onto fewer ranks. ``"auto"`` lets the runtime pick the threshold (and
    targets) with its simulator from what it observed of the method's previous
    streamed call and of the rank-local calls on the pool (none before the first
    observation); None or 0 never migrates."""
    targets: int | None = None
    """Ranks that keep the tail (None: enough that none decodes more samples than
    it started with)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "buffer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"StreamOptions.{name} must be an int >= 1, got {value!r}")
        m = self.migrate
        if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 0)):
            raise ConfigError(f"StreamOptions.migrate must be an int >= 0, 'auto' or None, got {m!r}")
        if self.targets is not None and (not isinstance(self.targets, int) or self.targets < 1):
            raise ConfigError(f"StreamOptions.targets must be an int >= 1 or None, got {self.targets!r}")


class DataStream(Generic[T]):
    """Futures of micro-batches, in the order they finished (see the module docstring).

    Created only by the runtime. ``async for fut in stream`` yields each
    micro-batch's :class:`DataFuture`; iteration ends when the producer is done, or
    raises the producer's error after the micro-batches that made it.
    """

    def __init__(self, *, label: str, fields: frozenset[str] | None, owner: Any, spawn: Spawn,
                 origins: Mapping[str, str] | None = None) -> None:
        self._label, self._fields, self._owner, self._spawn = label, fields, owner, spawn
        self._origins = dict(origins) if origins is not None else (
            None if fields is None else dict.fromkeys(fields, label))
        self._items: list[DataFuture[Any]] = []
        self._loop: asyncio.AbstractEventLoop = owner._loop
        self._end: asyncio.Future[None] = self._loop.create_future()
        self._end.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._changed: asyncio.Future[None] | None = None
        self._report: asyncio.Future[Any] | None = None

    async def report(self) -> Any:
        """What the streamed call behind this stream observed, once it ended: a
        ``StreamStats`` (rows, per-rank finish times, the migration threshold,
        samples migrated and when); None for a stream derived from another.

        Raises:
            the call's error, if it failed.
        """
        if self._report is None:
            return None
        return await asyncio.shield(self._report)

    @property
    def label(self) -> str:
        """What made the stream, e.g. ``"actor.generate#3"``."""
        return self._label

    @property
    def fields(self) -> frozenset[str] | None:
        """Fields every micro-batch carries, when known."""
        return self._fields

    def done(self) -> bool:
        """Whether the stream ended (every micro-batch is in, or it failed)."""
        return self._end.done()

    def __repr__(self) -> str:
        return f"<DataStream {self._label} {len(self._items)} micro-batches{' done' if self.done() else ''}>"

    # ----- fed by the runtime -----

    def _push(self, fut: DataFuture[Any]) -> None:
        if self._end.done():
            return
        self._items.append(fut)
        self._notify()

    def _finish(self, error: BaseException | None = None) -> None:
        """End the stream: complete, failed with ``error``, or cancelled (a
        ``CancelledError``: consumers then get ``CancelledError``)."""
        if self._end.done():
            return
        if error is None:
            self._end.set_result(None)
        elif isinstance(error, asyncio.CancelledError):
            self._end.cancel()
        else:
            self._end.set_exception(error)
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    # ----- consumed -----

    async def __aiter__(self) -> AsyncIterator[DataFuture[Any]]:
        i = 0
        while True:
            if i < len(self._items):
                i += 1
                yield self._items[i - 1]
                continue
            if self._end.done():
                self._end.result()  # raises the producer's error
                return
            if self._changed is None:
                self._changed = self._loop.create_future()
            # wait() leaves the shared future alone when this consumer is cancelled.
            await asyncio.wait([self._changed])

    async def futures(self) -> list[DataFuture[Any]]:
        """Every micro-batch's future, once the stream ended.

        Raises:
            the producer's error, if it failed.
        """
        await asyncio.wait([self._end])
        self._end.result()
        return list(self._items)

    def map(self, fn: Callable[..., Mapping[str, torch.Tensor]], /, **kwargs: Any) -> DataStream[BatchMeta]:
        """A stream of ``fut.map(fn, **kwargs)`` for every micro-batch (``fn`` runs
        where each micro-batch's rows land). Use it for row-local transforms; one
        that needs every row (e.g. whitening over the batch) goes after :func:`collect`."""
        return self._derive(f"{self._label}.map({getattr(fn, '__name__', 'fn')})",
                            lambda f: f.map(fn, **kwargs))

    def rename(self, **mapping: str) -> DataStream[BatchMeta]:
        """A stream of ``fut.rename(**mapping)`` for every micro-batch."""
        return self._derive(f"{self._label}.rename(...)", lambda f: f.rename(**mapping))

    def _derive(self, label: str, each: Callable[[DataFuture[Any]], DataFuture[Any]]) -> DataStream[BatchMeta]:
        probe = each(template(self))
        out: DataStream[BatchMeta] = DataStream(label=label, fields=probe.fields, origins=probe._origins,
                                                owner=self._owner, spawn=self._spawn)

        def one(futs: Sequence[DataFuture[Any]]) -> DataFuture[Any]:
            return each(futs[0])
        out._spawn(zip_into(out, [self], one), f"asyncflow-derive-{label}")
        return out


def template(stream: DataStream[Any]) -> DataFuture[Any]:
    """A future standing for any micro-batch of ``stream`` (never awaited): lets a
    call on a stream be checked at call time, before any micro-batch exists."""
    return DataFuture(label=stream.label, fields=stream.fields, origins=stream._origins,
                      owner=stream._owner, source=None, derive=_never)


async def _never() -> Resolved:
    raise AssertionError("a stream's template future is never awaited")



async def zip_into(out: DataStream[Any], streams: Sequence[DataStream[Any]],
                   each: Callable[[Sequence[DataFuture[Any]]], DataFuture[Any]]) -> None:
    """Feed ``out`` with ``each(k-th future of every stream)`` as they arrive; end
    ``out`` when the inputs end, with their error if one fails."""
    iters = [aiter(s) for s in streams]
    try:
        while True:
            futs: list[DataFuture[Any] | None] = []
            for it in iters:
                try:
                    futs.append(await anext(it))
                except StopAsyncIteration:
                    futs.append(None)
            if all(f is None for f in futs):
                break
            if any(f is None for f in futs):
                raise SchemaError(f"streams {[s.label for s in streams]} have different numbers of micro-batches")
            ids = {f._row_ids for f in futs if f is not None}
            if len(ids) > 1:
                raise SchemaError(f"streams {[s.label for s in streams]} do not carry the same rows micro-batch "
                                  "by micro-batch; merge streams derived from one stream")
            fut = each([f for f in futs if f is not None])
            fut._row_ids = next(iter(ids))
            out._push(fut)
    except BaseException as e:
        out._finish(e)
        if not isinstance(e, Exception):
            raise
    else:
        out._finish()


def collect(stream: DataStream[Any]) -> DataFuture[BatchMeta]:
    """One future of every row of ``stream``, in the order the call would have
    returned them without streaming (training needs the whole batch).

    Moves no row: the result's metadata points at the micro-batches' shards.

    Raises:
        ConfigError: ``stream`` is not a DataStream.
    """
    if not isinstance(stream, DataStream):
        raise ConfigError(f"collect needs a DataStream, got {type(stream).__name__}")

    late: list[tuple[frozenset[int], frozenset[tuple[int, int]]]] = []

    async def derive() -> Resolved:
        futs = await stream.futures()
        late.append((frozenset().union(*(f._calls for f in futs)), frozenset().union(*(f._parts for f in futs))))
        parts = [await f._resolve() for f in futs]
        for f, p in zip(futs, parts, strict=True):
            if not isinstance(p, Resolved):
                raise ConfigError(f"{f.label} returned a value, not rows; it cannot be collected")
            if f._row_ids is None:
                raise SchemaError(f"{f.label} does not carry row ids: only rows derived micro-batch by "
                                  "micro-batch from a streamed call can be collected")
        meta, order = collect_parts([(p.meta, f._row_ids or ()) for f, p in zip(futs, parts, strict=True)])
        lengths = [x for p in parts for x in (p.row_lengths or ())]
        row_lengths = tuple(lengths[i] for i in order) if len(lengths) == meta.num_rows and lengths else None
        return Resolved(meta=meta, row_lengths=row_lengths, leases=tuple(le for p in parts for le in p.leases),
                        transforms=_common_transforms(futs, parts))

    out: DataFuture[BatchMeta] = DataFuture(label=f"collect({stream.label})", fields=stream.fields,
                                            origins=stream._origins, owner=stream._owner, derive=derive)
    out._late = late
    return out


def _common_transforms(futs: Sequence[DataFuture[Any]], parts: Sequence[Resolved]) -> tuple[BoundTransform, ...]:
    if not parts:
        return ()
    first = parts[0].transforms
    for f, p in zip(futs, parts, strict=True):
        if len(p.transforms) != len(first) or not all(
                a.same_as(b) for a, b in zip(p.transforms, first, strict=True)):
            raise SchemaError(f"{f.label} was mapped differently from the stream's other micro-batches")
    return first
