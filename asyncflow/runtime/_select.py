"""Row and column selection on data futures, metadata only: ``select``, ``take``,
slices, ``filter`` (by row or by prompt group) and :func:`concat`.

None of these moves a row. The result's metadata points at (some of) the same
shards as its inputs, and consumers pull exactly the chosen rows, in order, from
their producers. A result holds leases on only the shards it still names: once
it is resolved it lets go of its inputs, so the shards nothing names any more
(e.g. the rows a filter dropped, once the unfiltered future is gone) are freed.

``filter`` decides on the driver from one column with one scalar per row (e.g. a
sequence reward): that column's values, and nothing else, come to the driver.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import torch

from asyncflow.runtime._future import DataFuture, Resolved, Transform
from channels import (
    BatchMeta,
    ConfigError,
    MissingFieldError,
    SchemaError,
    concat_meta,
    runs_from_indices,
    select_rows,
)

Predicate = Callable[[torch.Tensor], Any]
"""Takes a column's values, returns a bool tensor (see :meth:`DataFuture.filter`)."""

Compute = Callable[[], Awaitable[tuple[Resolved, tuple[int, ...] | None]]]
"""Resolves a derived future: its rows and, when known, their stream row ids."""


def select_fields(parent: DataFuture[Any], names: Iterable[str] | str) -> DataFuture[BatchMeta]:
    """See :meth:`DataFuture.select`."""
    wanted = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
    if not wanted:
        raise ConfigError(f"{parent.label}.select() needs at least one field name")
    if parent.fields is not None:
        missing = [n for n in wanted if n not in parent.fields]
        if missing:
            raise MissingFieldError(f"{parent.label} has no field {missing[0]!r} to select; "
                                    f"it has {sorted(parent.fields)}")
    label = f"{parent.label}.select({', '.join(wanted)})"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        base = await _rows_of(parent, "select")
        if base.transforms:
            raise ConfigError(f"{label}: select before map(): transforms may read the columns select drops")
        try:
            meta = base.meta.select(wanted)
        except MissingFieldError as e:
            raise MissingFieldError(f"{label}: {e}") from None
        return _with_meta(base, meta, base.row_lengths), parent._row_ids

    origins = None if parent._origins is None else {k: v for k, v in parent._origins.items() if k in wanted}
    out = _derived((parent,), label, fields=frozenset(wanted), origins=origins, compute=compute)
    out._row_ids = parent._row_ids
    return out


def take_rows(parent: DataFuture[Any], n: int, *, groups: bool = False) -> DataFuture[BatchMeta]:
    """See :meth:`DataFuture.take`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"{parent.label}.take(n): n must be an int >= 0, got {n!r}")
    unit = "groups" if groups else "rows"
    label = f"{parent.label}.take({n}{', groups=True' if groups else ''})"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        base = await _rows_of(parent, "take")
        size = base.meta.group_size if groups else 1
        have = base.meta.num_rows // size
        if n > have:
            raise SchemaError(f"{label}: {parent.label} has only {have} {unit}"
                              f"{f' of {size} rows' if groups else ''}; concat more rows first or take fewer")
        return _pick(parent, base, range(n * size))

    return _derived((parent,), label, fields=parent.fields, origins=parent._origins, compute=compute)


def slice_rows(parent: DataFuture[Any], key: Any) -> DataFuture[BatchMeta]:
    """See :meth:`DataFuture.__getitem__`."""
    if not isinstance(key, slice):
        raise ConfigError(f"{parent.label}[{key!r}]: index a DataFuture with a slice of rows, e.g. fut[i:i + 1]")
    for part in (key.start, key.stop, key.step):
        if part is not None and (not isinstance(part, int) or isinstance(part, bool)):
            raise ConfigError(f"{parent.label}[...]: slice bounds must be ints or None, got {part!r}")
    if key.step == 0:
        raise ConfigError(f"{parent.label}[...]: slice step cannot be zero")
    text = ":".join("" if p is None else str(p) for p in (key.start, key.stop)) + (
        "" if key.step is None else f":{key.step}")
    label = f"{parent.label}[{text}]"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        base = await _rows_of(parent, "slice")
        return _pick(parent, base, range(*key.indices(base.meta.num_rows)))

    return _derived((parent,), label, fields=parent.fields, origins=parent._origins, compute=compute)


def filter_rows(parent: DataFuture[Any], column: str, pred: Predicate | None = None, *,
                by_group: bool = False) -> DataFuture[BatchMeta]:
    """See :meth:`DataFuture.filter`."""
    if not isinstance(column, str):
        raise ConfigError(f"{parent.label}.filter: the first argument names the column to test, got {column!r}; "
                          "e.g. fut.filter('scores', lambda s: s > 0)")
    if pred is not None and not callable(pred):
        raise ConfigError(f"{parent.label}.filter: pred must be callable or None, got {pred!r}")
    if parent.fields is not None and column not in parent.fields:
        raise MissingFieldError(f"{parent.label} has no field {column!r} to filter on; "
                                f"it has {sorted(parent.fields)}")
    name = "" if pred is None else f", {getattr(pred, '__name__', 'pred')}"
    label = f"{parent.label}.filter({column!r}{name}{', by_group=True' if by_group else ''})"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        base = await _rows_of(parent, "filter")
        values = await _column(parent, base, column, label)
        keep = _mask(values, pred, by_group=by_group, group_size=base.meta.group_size, label=label)
        return _pick(parent, base, torch.nonzero(keep).flatten().tolist())

    return _derived((parent,), label, fields=parent.fields, origins=parent._origins, compute=compute)


def concat(*futures: DataFuture[Any]) -> DataFuture[BatchMeta]:
    """A future of the rows of ``futures`` one after another (metadata only: the
    result points at the inputs' shards).

    Every input must carry the same fields (names, dtypes and per-row shapes) and
    the same group size; transforms from ``map`` must be the same on every input
    (or map after concatenating). E.g. ``batch = concat(kept_1, kept_2).take(64, groups=True)``.

    Args:
        futures: futures of rows, of one session.

    Raises:
        ConfigError: no futures, a stream (``collect()`` it first), or futures of
            different sessions.
        SchemaError: the fields differ (when known at call time; else on await or
            in the consuming call), or group sizes, dtypes, shapes or transforms
            differ.
    """
    if not futures:
        raise ConfigError("concat needs at least one future")
    for f in futures:
        if not isinstance(f, DataFuture):
            hint = "; collect() the stream first" if hasattr(f, "futures") else ""
            raise ConfigError(f"concat takes DataFutures, got {type(f).__name__}{hint}")
    if len({id(f._runtime) for f in futures}) != 1:
        raise ConfigError("concat needs futures of one session")
    known = [f for f in futures if f.fields is not None]
    for f in known[1:]:
        if f.fields != known[0].fields:
            assert f.fields is not None and known[0].fields is not None
            raise SchemaError(f"concat needs the same fields: {known[0].label} has {sorted(known[0].fields)} but "
                              f"{f.label} has {sorted(f.fields)}; select() the common ones first")
    fields = known[0].fields if len(known) == len(futures) else None
    label = "concat(" + ", ".join(f.label for f in futures) + ")"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        parts = [await _rows_of(f, "concat") for f in futures]
        try:
            meta = concat_meta([p.meta for p in parts], [f.label for f in futures])
        except SchemaError as e:
            raise SchemaError(f"{label}: {e}") from None
        lengths = None
        if all(p.row_lengths is not None for p in parts):
            lengths = tuple(x for p in parts for x in p.row_lengths or ())
        leases = tuple({id(le): le for p in parts for le in p.leases}.values())
        return Resolved(meta=meta, row_lengths=lengths, leases=leases,
                        transforms=_common_transforms(futures, parts, label)), None

    return _derived(futures, label, fields=fields, origins=None, compute=compute)


# ----- shared -----


def _derived(parents: Sequence[DataFuture[Any]], label: str, *, fields: frozenset[str] | None,
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
                                            runtime=parents[0]._runtime, derive=derive, parents=parents)
    ref = weakref.ref(out)  # not the future itself: the closure would make a cycle that holds leases until gc
    out._detach = True
    return out


async def _rows_of(fut: DataFuture[Any], op: str) -> Resolved:
    base = await fut._resolve()
    if not isinstance(base, Resolved):
        raise ConfigError(f"{fut.label} returned a value, not rows; it cannot be passed to {op}")
    return base


def _with_meta(base: Resolved, meta: BatchMeta, row_lengths: tuple[int, ...] | None) -> Resolved:
    """``base`` narrowed to ``meta``, keeping only the leases of shards ``meta`` names."""
    named = meta.shard_keys()
    return Resolved(meta=meta, row_lengths=row_lengths, transforms=base.transforms,
                    leases=tuple(le for le in base.leases if (le.worker, le.key) in named))


def _pick(parent: DataFuture[Any], base: Resolved, rows: Sequence[int]
          ) -> tuple[Resolved, tuple[int, ...] | None]:
    """Rows ``rows`` (positions in ``base``, in order) of ``parent``."""
    meta = select_rows(base.meta, runs_from_indices(rows))
    lengths = None if base.row_lengths is None else tuple(base.row_lengths[i] for i in rows)
    ids = None if parent._row_ids is None else tuple(parent._row_ids[i] for i in rows)
    return _with_meta(base, meta, lengths), ids


async def _column(parent: DataFuture[Any], base: Resolved, column: str, label: str) -> torch.Tensor:
    """The values of ``column`` (one scalar per row) at the driver, as a 1-d tensor."""
    if column not in base.meta.field_names:
        made = any(column in (t.writes or ()) for t in base.transforms)
        why = (" (a map() transform makes it on the consuming ranks only; filter before mapping, or have "
               "a role method write it)") if made else ""
        raise MissingFieldError(f"{label}: {parent.label} has no stored field {column!r}{why}; "
                                f"it has {sorted(base.meta.field_names)}")
    spec = base.meta.field(column)
    if any(s != 1 for s in spec.shape):
        raise SchemaError(f"{label}: filter reads one value per row, but {column!r} has per-row shape "
                          f"{list(spec.shape)}; filter on a per-row score (e.g. a role method's sequence reward)")
    batch = await parent._runtime.fetch_rows(base.meta.select([column]))
    return batch[column].reshape(-1)


def _mask(values: torch.Tensor, pred: Predicate | None, *, by_group: bool, group_size: int,
          label: str) -> torch.Tensor:
    """Per row, whether it is kept."""
    n = values.shape[0]
    if by_group:
        arg = values.reshape(n // group_size, group_size)
        want, unit = n // group_size, f"group of {group_size} rows"
    else:
        arg, want, unit = values, n, "row"
    if pred is None:
        got: Any = arg.bool().all(dim=1) if by_group else arg.bool()
    else:
        got = pred(arg)
    mask = torch.as_tensor(got)
    if mask.dtype != torch.bool or tuple(mask.shape) != (want,):
        reduce = " (reduce over dim 1, e.g. .all(dim=1))" if by_group and mask.dim() == 2 else ""
        raise SchemaError(f"{label}: the predicate must return one bool per {unit} ({want} in all){reduce}, "
                          f"got a {mask.dtype} tensor of shape {list(mask.shape)}")
    return mask.repeat_interleave(group_size) if by_group else mask


def _common_transforms(futures: Sequence[DataFuture[Any]], parts: Sequence[Resolved],
                       label: str) -> tuple[Transform, ...]:
    first = parts[0].transforms
    for f, p in zip(futures, parts, strict=True):
        same = len(p.transforms) == len(first) and all(
            a is b or (a.fn is b.fn and dict(a.kwargs) == dict(b.kwargs))
            for a, b in zip(p.transforms, first, strict=True))
        if not same:
            raise SchemaError(f"{label}: {f.label} was mapped differently from {futures[0].label}; "
                              "concat first, then map() the result")
    return first
