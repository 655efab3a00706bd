"""``DataFuture``: the awaitable result of a group call, carrying metadata only.

A future is created by the runtime when a role method is called through a group
proxy. Awaiting it yields, once the rows exist, their :class:`~channels.BatchMeta`
(or the small value a method such as a metrics reduction returns). Passing it to
another group call makes the callee's ranks pull their rows straight from the
producer's ranks. ``fetch()`` is the explicit way to bring rows to the driver.

While any future names a shard (directly, or through ``merge``/``map``), the shard
is kept; when the last one is dropped the producer frees it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from channels import Batch, BatchMeta, ConfigError, MissingFieldError, merge_meta

if TYPE_CHECKING:
    from asyncflow._session import Session

T = TypeVar("T")


class Lease:
    """Keeps one shard alive; when the last reference goes, the shard is freed."""

    __slots__ = ("__weakref__", "key", "worker")

    def __init__(self, worker: int, key: str, release: Callable[[int, str], None]) -> None:
        self.worker, self.key = worker, key
        weakref.finalize(self, release, worker, key)


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


@dataclass(frozen=True, kw_only=True)
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
    """The result of a group call (or of ``merge``/``map`` on such results).

    Created only by the runtime. ``await fut`` yields the batch metadata (or a
    method's small value); ``await fut.fetch()`` brings the rows to the driver.
    """

    def __init__(self, *, label: str, fields: frozenset[str] | None, session: Session,
                 source: asyncio.Future[Any] | None = None,
                 derive: Callable[[], Awaitable[Resolved]] | None = None) -> None:
        self._label = label
        self._fields = fields
        self._session = session
        self._source = source
        self._derive = derive
        self._cached: Any = None
        if source is not None:
            # A failure nobody awaits must not log "exception was never retrieved":
            # the error reaches whoever awaits this future or a dependent one.
            source.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def label(self) -> str:
        """Which call made this future, e.g. ``"actor.generate#3"``."""
        return self._label

    @property
    def fields(self) -> frozenset[str] | None:
        """Fields the rows will carry, when known before they exist."""
        return self._fields

    def done(self) -> bool:
        """Whether the result (or error) is there."""
        if self._source is not None:
            return self._source.done()
        return self._cached is not None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DataFuture {self._label} {state}>"

    async def _resolve(self) -> Any:
        if self._cached is not None:
            return self._cached
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
        batch = await self._session.fetch_rows(result.meta)
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
        fields = None if self._fields is None or writes is None else self._fields | frozenset(writes)
        parent = self

        async def derive() -> Resolved:
            base = await parent._resolve()
            if not isinstance(base, Resolved):
                raise ConfigError(f"{parent.label} returned a value, not rows; it cannot be mapped")
            return Resolved(meta=base.meta, row_lengths=base.row_lengths, leases=base.leases,
                            transforms=(*base.transforms, t))

        name = getattr(fn, "__name__", "fn")
        return DataFuture(label=f"{self._label}.map({name})", fields=fields, session=self._session, derive=derive)


def _rename(parent: DataFuture[Any], mapping: Mapping[str, str]) -> DataFuture[BatchMeta]:
    fields = None if parent.fields is None else frozenset(mapping.get(f, f) for f in parent.fields)

    async def derive() -> Resolved:
        base = await parent._resolve()
        if not isinstance(base, Resolved):
            raise ConfigError(f"{parent.label} returned a value, not rows; it cannot be renamed")
        if base.transforms:
            raise ConfigError(f"rename {parent.label} before mapping it: transforms see the new names")
        return Resolved(meta=base.meta.rename(mapping), row_lengths=base.row_lengths, leases=base.leases)

    args = ", ".join(f"{k}={v!r}" for k, v in mapping.items())
    return DataFuture(label=f"{parent.label}.rename({args})", fields=fields, session=parent._session,
                      derive=derive)


def merge(*futures: DataFuture[Any]) -> DataFuture[BatchMeta]:
    """A future of the union of the columns of ``futures`` (same rows, same order).

    Raises:
        ConfigError: no futures, or futures of different sessions.
    """
    if not futures:
        raise ConfigError("merge needs at least one future")
    sessions = {id(f._session) for f in futures}
    if len(sessions) != 1:
        raise ConfigError("merge needs futures of one session")
    known = [f.fields for f in futures]
    fields = None if any(k is None for k in known) else frozenset().union(*(k for k in known if k is not None))

    async def derive() -> Resolved:
        parts = [await f._resolve() for f in futures]
        for f, p in zip(futures, parts, strict=True):
            if not isinstance(p, Resolved):
                raise ConfigError(f"{f.label} returned a value, not rows; it cannot be merged")
        lengths = next((p.row_lengths for p in parts if p.row_lengths is not None), None)
        return Resolved(
            meta=merge_meta([p.meta for p in parts]),
            row_lengths=lengths,
            leases=tuple(lease for p in parts for lease in p.leases),
            transforms=tuple(t for p in parts for t in p.transforms),
        )

    label = "merge(" + ", ".join(f.label for f in futures) + ")"
    return DataFuture(label=label, fields=fields, session=futures[0]._session, derive=derive)


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

