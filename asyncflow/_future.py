"""``DataFuture``: the awaitable result of a group call, carrying metadata only.

A future is created by the runtime when a role method is called through a group
proxy. Awaiting it yields, once the rows exist, their :class:`~channels.BatchMeta`
(or the small value a method such as a metrics reduction returns). Passing it to
another group call makes the callee's ranks pull their rows straight from the
producer's ranks. ``fetch()`` is the explicit way to bring rows to the driver.

While any future names a shard (directly, or through ``merge``/``map``), the shard
is kept; when the last one is dropped the producer frees it. ``cancel()`` cancels
a call that has not run yet and every call that depends on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from channels import Batch, BatchMeta, ConfigError, MissingFieldError

if TYPE_CHECKING:
    from asyncflow._ledger import Lease

T = TypeVar("T")


class Runtime(Protocol):
    """What a future needs of the session that made it."""

    async def fetch_rows(self, meta: BatchMeta) -> Batch:
        """The rows of ``meta`` at the driver."""
        ...

    def cancel(self, fut: DataFuture[Any]) -> bool:
        """Cancel ``fut``'s call (if queued) and every queued call depending on it."""
        ...


class TransformFn:
    """A row transform with declared fields (made by :func:`transform`)."""

    def __init__(self, fn: Callable[..., Mapping[str, torch.Tensor]], reads: tuple[str, ...] | None,
                 writes: tuple[str, ...] | None) -> None:
        self.fn, self.reads, self.writes = fn, reads, writes
        self.__name__ = getattr(fn, "__name__", "transform")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = fn.__doc__

    def __call__(self, batch: Batch, **kwargs: Any) -> Mapping[str, torch.Tensor]:
        return self.fn(batch, **kwargs)


def transform(*, reads: Sequence[str] | None = None, writes: Sequence[str] | None = None
              ) -> Callable[[Callable[..., Mapping[str, torch.Tensor]]], TransformFn]:
    """Declare the fields a row transform reads and writes, so that ``fut.map(fn)``
    knows its output fields at call time and pulls only what ``fn`` needs.

    The function takes a :class:`~channels.Batch` (the consumer rank's rows) and
    keyword arguments, and returns a mapping of new or replaced columns with the
    same row count.
    """
    def decorate(fn: Callable[..., Mapping[str, torch.Tensor]]) -> TransformFn:
        return TransformFn(fn, None if reads is None else tuple(reads), None if writes is None else tuple(writes))
    return decorate


@dataclass(frozen=True, kw_only=True, eq=False)
class Transform:
    """A transform applied where the rows land, with its arguments."""

    fn: Callable[..., Mapping[str, torch.Tensor]]
    kwargs: Mapping[str, Any]
    reads: tuple[str, ...] | None
    writes: tuple[str, ...] | None


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What a row future resolves to inside the runtime."""

    meta: BatchMeta
    row_lengths: tuple[int, ...] | None
    leases: tuple[Lease, ...]
    transforms: tuple[Transform, ...] = ()


class DataFuture(Generic[T]):
    """The result of a group call (or of ``merge``/``map``/``rename`` on such results).

    Created only by the runtime. ``await fut`` yields the batch metadata (or a
    method's small value); ``await fut.fetch()`` brings the rows to the driver.
    Awaiting a cancelled future raises :class:`asyncio.CancelledError`, as for an
    asyncio future.
    """

    def __init__(self, *, label: str, fields: frozenset[str] | None, runtime: Runtime,
                 origins: Mapping[str, str] | None = None,
                 source: asyncio.Future[Any] | None = None,
                 derive: Callable[[], Awaitable[Resolved]] | None = None,
                 parents: Sequence[DataFuture[Any]] = (), call_id: int | None = None) -> None:
        self._label = label
        self._fields = fields
        self._origins = dict(origins) if origins is not None else (
            None if fields is None else dict.fromkeys(fields, label))
        self._runtime = runtime
        self._source = source
        self._derive = derive
        self._call_id = call_id
        self._parents = tuple(parents)
        self._late: list[tuple[frozenset[int], frozenset[tuple[int, int]]]] = []
        """Calls and micro-batches learned only once the future resolves (``collect``)."""
        self._part: tuple[int, int] | None = None
        """``(call id, number)`` when this future is a micro-batch of a streamed call."""
        self._cached: Any = None
        self._cancelled = False
        self._row_ids: tuple[int, ...] | None = None
        """Per row, its id in the stream it came from (micro-batches of a stream only)."""
        if source is not None:
            # A failure nobody awaits must not log "exception was never retrieved":
            # the error reaches whoever awaits this future or a dependent one.
            source.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def _calls(self) -> frozenset[int]:
        """The calls this future's rows derive from."""
        own = frozenset([self._call_id]) if self._call_id is not None else frozenset()
        return own.union(*(p._calls for p in self._parents), *(c for c, _ in self._late))

    @property
    def _parts(self) -> frozenset[tuple[int, int]]:
        """The streamed micro-batches (``(call id, number)``) this future's rows derive from."""
        own = frozenset([self._part]) if self._part is not None else frozenset()
        return own.union(*(p._parts for p in self._parents), *(m for _, m in self._late))

    @property
    def label(self) -> str:
        """Which call made this future, e.g. ``"actor.generate#3"``."""
        return self._label

    @property
    def fields(self) -> frozenset[str] | None:
        """Fields the rows will carry, when known before they exist."""
        return self._fields

    def done(self) -> bool:
        """Whether the result (or error, or cancellation) is there."""
        if self._source is not None:
            return self._source.done()
        return self._cancelled or self._cached is not None

    def cancelled(self) -> bool:
        """Whether the future was cancelled."""
        if self._source is not None:
            return self._source.cancelled()
        return self._cancelled

    def cancel(self) -> bool:
        """Cancel the call behind this future if it has not run yet, and every
        queued call that depends on it (their rows are never allocated). A call
        that is running finishes and its rows are freed at once.

        Returns:
            False when the future was already done, else True.
        """
        if self.done():
            return False
        return self._runtime.cancel(self)

    def _mark_cancelled(self) -> None:
        """For a derived future: cancelled (the runtime cancels call futures)."""
        self._cancelled = True

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self.done() else "pending"
        return f"<DataFuture {self._label} {state}>"

    async def _resolve(self) -> Any:
        if self._cached is not None:
            return self._cached
        if self._cancelled:
            raise asyncio.CancelledError(f"{self._label} was cancelled")
        if self._source is not None:
            result = await asyncio.shield(self._source)
        else:
            assert self._derive is not None
            result = await self._derive()
        self._cached = result
        return result

    def __await__(self) -> Generator[Any, None, T]:
        result = yield from self._resolve().__await__()
        return result.meta if isinstance(result, Resolved) else result  # type: ignore[return-value]

    async def fetch(self) -> Any:
        """Bring the rows to the driver as a :class:`~channels.Batch` (transforms
        from ``map`` applied); for a value result, the value."""
        result = await self._resolve()
        if not isinstance(result, Resolved):
            return result
        batch = await self._runtime.fetch_rows(result.meta)
        for t in result.transforms:
            batch = batch.update(t.fn(batch, **t.kwargs))
        return batch

    def rename(self, **mapping: str) -> DataFuture[BatchMeta]:
        """A future of the same rows with columns renamed, ``old=new`` (metadata only;
        no row moves). Useful to merge two results that name a column alike."""
        if self._fields is not None:
            missing = [k for k in mapping if k not in self._fields]
            if missing:
                raise MissingFieldError(f"{self._label} has no field {missing[0]!r} to rename; "
                                        f"it has {sorted(self._fields)}")
        return _rename(self, mapping)

    def map(self, fn: Callable[..., Mapping[str, torch.Tensor]], /, **kwargs: Any) -> DataFuture[BatchMeta]:
        """A future of the same rows plus the columns ``fn(batch, **kwargs)``
        returns. ``fn`` runs on the ranks that consume the rows, never on the
        driver. Decorate ``fn`` with :func:`transform` to declare its fields."""
        if not callable(fn):
            raise ConfigError(f"map needs a callable, got {fn!r}")
        reads = fn.reads if isinstance(fn, TransformFn) else None
        writes = fn.writes if isinstance(fn, TransformFn) else None
        t = Transform(fn=fn, kwargs=dict(kwargs), reads=reads, writes=writes)
        name = getattr(fn, "__name__", "fn")
        label = f"{self._label}.map({name})"
        fields = origins = None
        if self._fields is not None and self._origins is not None and writes is not None:
            fields = self._fields | frozenset(writes)
            origins = {**self._origins, **dict.fromkeys(writes, label)}
        parent = self

        async def derive() -> Resolved:
            base = await parent._resolve()
            if not isinstance(base, Resolved):
                raise ConfigError(f"{parent.label} returned a value, not rows; it cannot be mapped")
            return Resolved(meta=base.meta, row_lengths=base.row_lengths, leases=base.leases,
                            transforms=(*base.transforms, t))

        out: DataFuture[BatchMeta] = DataFuture(label=label, fields=fields, origins=origins,
                                                runtime=self._runtime, derive=derive, parents=(self,))
        out._row_ids = self._row_ids
        return out


def _rename(parent: DataFuture[Any], mapping: Mapping[str, str]) -> DataFuture[BatchMeta]:
    fields = None if parent.fields is None else frozenset(mapping.get(f, f) for f in parent.fields)
    origins = None if parent._origins is None else {mapping.get(f, f): o for f, o in parent._origins.items()}

    async def derive() -> Resolved:
        base = await parent._resolve()
        if not isinstance(base, Resolved):
            raise ConfigError(f"{parent.label} returned a value, not rows; it cannot be renamed")
        if base.transforms:
            raise ConfigError(f"rename {parent.label} before mapping it: transforms see the new names")
        return Resolved(meta=base.meta.rename(mapping), row_lengths=base.row_lengths, leases=base.leases)

    args = ", ".join(f"{k}={v!r}" for k, v in mapping.items())
    out: DataFuture[BatchMeta] = DataFuture(label=f"{parent.label}.rename({args})", fields=fields,
                                            origins=origins, runtime=parent._runtime, derive=derive,
                                            parents=(parent,))
    out._row_ids = parent._row_ids
    return out


async def gather(*awaitables: Awaitable[Any]) -> tuple[Any, ...]:
    """Await every argument; results in argument order.

    On the first failure the other waits are cancelled (the stages themselves go on
    in their pools) and that failure is raised as is.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return ()
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return tuple(t.result() for t in tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
