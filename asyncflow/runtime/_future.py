"""``DataFuture``: the awaitable result of a group call, carrying metadata only.

A future is created by the runtime when a role method is called through a group
proxy. Awaiting it yields, once the rows exist, their :class:`~channels.BatchMeta`
(or the small value a method such as a metrics reduction returns). Passing it to
another group call makes the callee's ranks pull their rows straight from the
producer's ranks. ``fetch()`` is the explicit way to bring rows to the driver.

While any future names a shard (directly, or through ``merge``/``map`` or a
selection: ``select``, ``take``, slices, ``filter``, ``concat``), the shard is
kept; when the last one is dropped the producer frees it. ``cancel()`` cancels
a call that has not run yet and every call that depends on it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._select import (
    Predicate,
    check_filter,
    check_take,
    filter_column,
    first_rows,
    pick_rows,
    row_mask,
    select_columns,
    selected_fields,
    slice_text,
)
from asyncflow.runtime._transform import BoundTransform, RowFn
from channels import Batch, BatchMeta, ConfigError, MissingFieldError

T = TypeVar("T")

Compute = Callable[[], Awaitable[tuple[Resolved, tuple[int, ...] | None]]]
"""Resolves a derived future: its rows and, when known, their stream row ids."""


class FutureOwner(Protocol):
    """What a future needs of the session that made it."""

    async def fetch_rows(self, meta: BatchMeta) -> Batch:
        """The rows of ``meta`` at the driver."""
        ...

    def cancel(self, fut: DataFuture[Any]) -> bool:
        """Cancel ``fut``'s call (if queued) and every queued call depending on it."""
        ...


class DataFuture(Generic[T]):
    """The result of a group call (or of ``merge``/``map``/``rename``/``select``/
    ``take``/``filter``/``concat`` or a slice on such results).

    Created only by the runtime. ``await fut`` yields the batch metadata (or a
    method's small value); ``await fut.fetch()`` brings the rows to the driver.
    Awaiting a cancelled future raises :class:`asyncio.CancelledError`, as for an
    asyncio future.
    """

    def __init__(self, *, label: str, fields: frozenset[str] | None, owner: FutureOwner,
                 origins: Mapping[str, str] | None = None,
                 source: asyncio.Future[Any] | None = None,
                 derive: Callable[[], Awaitable[Resolved]] | None = None,
                 parents: Sequence[DataFuture[Any]] = (), call_id: int | None = None) -> None:
        self._label = label
        self._fields = fields
        self._origins = dict(origins) if origins is not None else (
            None if fields is None else dict.fromkeys(fields, label))
        self._owner = owner
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
        self._detach = False
        """Let go of the parents once resolved (a row or column selection names fewer
        shards than its parents: holding them would keep the rest alive)."""
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
        return self._owner.cancel(self)

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
        if self._detach and self._derive is not None:
            self._late = [*self._late, (self._calls, self._parts)]
            self._parents, self._derive = (), None
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
        batch = await self._owner.fetch_rows(result.meta)
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

    def map(self, fn: RowFn, /, **kwargs: Any) -> DataFuture[BatchMeta]:
        """A future of the same rows plus the columns ``fn(batch, **kwargs)``
        returns. ``fn`` runs on the ranks that consume the rows, never on the
        driver. Decorate ``fn`` with :func:`transform` to declare its fields."""
        if not callable(fn):
            raise ConfigError(f"map needs a callable, got {fn!r}")
        t = BoundTransform.of(fn, kwargs)
        writes = t.writes
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
                                                owner=self._owner, derive=derive, parents=(self,))
        out._row_ids = self._row_ids
        return out

    # ----- selections (metadata only; the checks and row arithmetic are in _select) -----

    def select(self, fields: Iterable[str] | str) -> DataFuture[BatchMeta]:
        """A future of the same rows with only columns ``fields`` (metadata only).
        Shards that held only dropped columns are freed once nothing else names them.

        ``fut.select(["response_ids", "scores"])``

        Args:
            fields: column names (a single name is allowed).

        Raises:
            ConfigError: no names; or, on await, the future was mapped (select
                before ``map``: a transform may read a dropped column).
            MissingFieldError: a name is not a field (at call time when the fields
                are known, else on await).
        """
        wanted = selected_fields(self._label, self._fields, fields)
        label = f"{self._label}.select({', '.join(wanted)})"

        async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
            return select_columns(await self._rows("select"), wanted, label), self._row_ids

        origins = None if self._origins is None else {k: v for k, v in self._origins.items() if k in wanted}
        out = derived((self,), label, fields=frozenset(wanted), origins=origins, compute=compute)
        out._row_ids = self._row_ids
        return out

    def take(self, n: int, *, groups: bool = False) -> DataFuture[BatchMeta]:
        """A future of the first ``n`` rows, or with ``groups=True`` the first ``n``
        prompt groups (``n * group_size`` rows, groups kept whole). Metadata only.

        ``fut.take(64)``; ``kept.take(8, groups=True)``

        Unlike a slice, ``take`` is exact: asking for more than there are is an error.
        Rows that do not end on a group boundary give a result of group size 1.
        Groups are the rows' ``group_size`` (see :class:`~channels.BatchMeta`): a
        method's output that declares none has groups of 1 until merged with its
        grouped input, e.g. ``merge(made, prompts.rename(idx="prompt"))``.

        Raises:
            ConfigError: ``n`` is not an int >= 0.
            SchemaError: on await (or in the consuming call), fewer than ``n`` rows
                (groups) exist.
        """
        check_take(self._label, n)
        label = f"{self._label}.take({n}{', groups=True' if groups else ''})"

        async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
            base = await self._rows("take")
            return self._pick(base, first_rows(base, n, groups=groups, label=label, of=self._label))

        return derived((self,), label, fields=self._fields, origins=self._origins, compute=compute)

    def __getitem__(self, rows: slice) -> DataFuture[BatchMeta]:
        """A future of the rows in slice ``rows``, by position as for a list
        (negative bounds, steps, clamping). Metadata only: ``fut[8:16]``.

        Raises:
            ConfigError: ``rows`` is not a slice of ints.
        """
        label = f"{self._label}[{slice_text(self._label, rows)}]"

        async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
            base = await self._rows("slice")
            return self._pick(base, range(*rows.indices(base.meta.num_rows)))

        return derived((self,), label, fields=self._fields, origins=self._origins, compute=compute)

    # Slicing must not make a future iterable (``iter`` would call ``fut[0]``, ...):
    # None makes ``iter(fut)`` raise TypeError and ``isinstance(fut, Iterable)`` False.
    __iter__ = None

    def filter(self, column: str, pred: Predicate | None = None, /, *,
               by_group: bool = False) -> DataFuture[BatchMeta]:
        """A future of the rows (or prompt groups) whose values of ``column`` pass
        ``pred``. Metadata only: no row moves; the dropped rows' shards are freed
        once nothing else names them.

        The decision is made on the driver from ``column`` alone, which must hold
        one scalar per row (e.g. a sequence reward): those values are the only
        data that reach the driver. ``pred`` runs there on a CPU tensor.

        - Per row (default): ``pred(values)`` gets the ``[rows]`` values and returns
          a ``[rows]`` bool mask. Without ``pred``, rows whose value is non-zero are
          kept. A result that splits a group has group size 1.
        - ``by_group=True``: groups of ``group_size`` consecutive rows (a GRPO
          prompt's samples) are kept or dropped whole. ``pred`` gets the values as
          ``[groups, group_size]`` and returns one bool per group (``[groups]``);
          without ``pred`` a group is kept when every value is non-zero.

        ``scored.filter("scores", lambda s: s.amax(1) > s.amin(1), by_group=True)``
        (DAPO: drop the groups whose rewards are all equal)

        Args:
            column: the column to test.
            pred: values -> bool mask, or None (see above).
            by_group: keep or drop whole groups.

        Raises:
            ConfigError: ``column`` is not a string or ``pred`` not callable.
            MissingFieldError: ``column`` is not a stored field (at call time when
                the fields are known, else on await).
            SchemaError: on await, ``column`` has more than one value per row, or
                ``pred`` returned something else than one bool per row (group).
        """
        check_filter(self._label, self._fields, column, pred)
        name = "" if pred is None else f", {getattr(pred, '__name__', 'pred')}"
        label = f"{self._label}.filter({column!r}{name}{', by_group=True' if by_group else ''})"

        async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
            base = await self._rows("filter")
            batch = await self._owner.fetch_rows(filter_column(base, column, label=label, of=self._label))
            keep = row_mask(batch[column].reshape(-1), pred, by_group=by_group, group_size=base.meta.group_size,
                            label=label)
            return self._pick(base, torch.nonzero(keep).flatten().tolist())

        return derived((self,), label, fields=self._fields, origins=self._origins, compute=compute)

    async def _rows(self, op: str) -> Resolved:
        """What this future resolves to, which must be rows to pass to ``op``."""
        base = await self._resolve()
        if not isinstance(base, Resolved):
            raise ConfigError(f"{self._label} returned a value, not rows; it cannot be passed to {op}")
        return base

    def _pick(self, base: Resolved, rows: Sequence[int]) -> tuple[Resolved, tuple[int, ...] | None]:
        """Rows ``rows`` (positions in ``base``, in order) of this future, with their stream row ids."""
        ids = None if self._row_ids is None else tuple(self._row_ids[i] for i in rows)
        return pick_rows(base, rows), ids


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
                                            origins=origins, owner=parent._owner, derive=derive,
                                            parents=(parent,))
    out._row_ids = parent._row_ids
    return out


def derived(parents: Sequence[DataFuture[Any]], label: str, *, fields: frozenset[str] | None,
            origins: dict[str, str] | None, compute: Compute) -> DataFuture[BatchMeta]:
    """A future resolved once by ``compute`` (concurrent awaiters share the one
    result: a filter's column is fetched once) that lets go of its parents once
    resolved, so that it holds only the leases of the shards it names."""
    lock = asyncio.Lock()
    done: list[Resolved] = []

    async def derive() -> Resolved:
        async with lock:
            if not done:
                resolved, row_ids = await compute()
                me = ref()
                if me is not None and row_ids is not None:
                    me._row_ids = row_ids
                done.append(resolved)
        return done[0]

    out: DataFuture[BatchMeta] = DataFuture(label=label, fields=fields, origins=origins,
                                            owner=parents[0]._owner, derive=derive, parents=parents)
    ref = weakref.ref(out)  # not the future itself: the closure would make a cycle that holds leases until gc
    out._detach = True
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
