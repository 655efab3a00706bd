"""Row and column selections over resolved rows, metadata only: the checks and the
row arithmetic behind ``DataFuture.select``, ``take``, slices, ``filter`` (by row or
by prompt group) and :func:`~asyncflow.concat`.

None of these moves a row. A selection's metadata points at (some of) the same
shards as its inputs, and consumers pull exactly the chosen rows, in order, from
their producers. A selection keeps the leases of only the shards it still names
(:meth:`Resolved.narrowed`), so that the shards nothing names any more (e.g. the
rows a filter dropped) are freed.

``filter`` decides on the driver from one column with one scalar per row (e.g. a
sequence reward): that column's values, and nothing else, come to the driver.

The futures themselves are built in ``_future`` (and ``concat`` in ``_ops``); this
module knows nothing of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._transform import BoundTransform
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


# ----- select -----


def selected_fields(of: str, fields: frozenset[str] | None, names: Iterable[str] | str) -> tuple[str, ...]:
    """The field names ``of.select(names)`` keeps, checked against ``fields`` when known."""
    wanted = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
    if not wanted:
        raise ConfigError(f"{of}.select() needs at least one field name")
    if fields is not None:
        missing = [n for n in wanted if n not in fields]
        if missing:
            raise MissingFieldError(f"{of} has no field {missing[0]!r} to select; it has {sorted(fields)}")
    return wanted


def select_columns(base: Resolved, wanted: Sequence[str], label: str) -> Resolved:
    """``base`` with only the columns ``wanted``."""
    if base.transforms:
        raise ConfigError(f"{label}: select before map(): transforms may read the columns select drops")
    try:
        meta = base.meta.select(wanted)
    except MissingFieldError as e:
        raise MissingFieldError(f"{label}: {e}") from None
    return base.narrowed(meta, base.row_lengths)


# ----- take and slices -----


def check_take(of: str, n: Any) -> None:
    """``of.take(n)``'s ``n`` is an int >= 0."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"{of}.take(n): n must be an int >= 0, got {n!r}")


def first_rows(base: Resolved, n: int, *, groups: bool, label: str, of: str) -> range:
    """The positions of the first ``n`` rows (or prompt groups) of ``base``."""
    size = base.meta.group_size if groups else 1
    have = base.meta.num_rows // size
    if n > have:
        unit = "groups" if groups else "rows"
        raise SchemaError(f"{label}: {of} has only {have} {unit}"
                          f"{f' of {size} rows' if groups else ''}; concat more rows first or take fewer")
    return range(n * size)


def slice_text(of: str, key: Any) -> str:
    """``key`` as written between brackets, once checked to be a slice of ints."""
    if not isinstance(key, slice):
        raise ConfigError(f"{of}[{key!r}]: index a DataFuture with a slice of rows, e.g. fut[i:i + 1]")
    for part in (key.start, key.stop, key.step):
        if part is not None and (not isinstance(part, int) or isinstance(part, bool)):
            raise ConfigError(f"{of}[...]: slice bounds must be ints or None, got {part!r}")
    if key.step == 0:
        raise ConfigError(f"{of}[...]: slice step cannot be zero")
    return ":".join("" if p is None else str(p) for p in (key.start, key.stop)) + (
        "" if key.step is None else f":{key.step}")


def pick_rows(base: Resolved, rows: Sequence[int]) -> Resolved:
    """Rows ``rows`` (positions in ``base``, in order) of ``base``."""
    meta = select_rows(base.meta, runs_from_indices(rows))
    lengths = None if base.row_lengths is None else tuple(base.row_lengths[i] for i in rows)
    return base.narrowed(meta, lengths)


# ----- filter -----


def check_filter(of: str, fields: frozenset[str] | None, column: Any, pred: Any) -> None:
    """``of.filter(column, pred)``'s arguments: a column name (a field, when the
    fields are known) and a callable or None."""
    if not isinstance(column, str):
        raise ConfigError(f"{of}.filter: the first argument names the column to test, got {column!r}; "
                          "e.g. fut.filter('scores', lambda s: s > 0)")
    if pred is not None and not callable(pred):
        raise ConfigError(f"{of}.filter: pred must be callable or None, got {pred!r}")
    if fields is not None and column not in fields:
        raise MissingFieldError(f"{of} has no field {column!r} to filter on; it has {sorted(fields)}")


def filter_column(base: Resolved, column: str, *, label: str, of: str) -> BatchMeta:
    """The metadata of ``column`` alone, once checked to be stored with one scalar
    per row: what a filter brings to the driver."""
    if column not in base.meta.field_names:
        made = any(column in (t.writes or ()) for t in base.transforms)
        why = (" (a map() transform makes it on the consuming ranks only; filter before mapping, or have "
               "a role method write it)") if made else ""
        raise MissingFieldError(f"{label}: {of} has no stored field {column!r}{why}; "
                                f"it has {sorted(base.meta.field_names)}")
    spec = base.meta.field(column)
    if any(s != 1 for s in spec.shape):
        raise SchemaError(f"{label}: filter reads one value per row, but {column!r} has per-row shape "
                          f"{list(spec.shape)}; filter on a per-row score (e.g. a role method's sequence reward)")
    return base.meta.select([column])


def row_mask(values: torch.Tensor, pred: Predicate | None, *, by_group: bool, group_size: int,
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


# ----- concat -----


def concat_fields(inputs: Sequence[tuple[str, frozenset[str] | None]]) -> frozenset[str] | None:
    """The fields of the concatenation of ``(label, fields)`` inputs: the same for
    every input whose fields are known; None unless all are."""
    known = [(label, fields) for label, fields in inputs if fields is not None]
    for label, fields in known[1:]:
        if fields != known[0][1]:
            raise SchemaError(f"concat needs the same fields: {known[0][0]} has {sorted(known[0][1] or ())} but "
                              f"{label} has {sorted(fields or ())}; select() the common ones first")
    return known[0][1] if known and len(known) == len(inputs) else None


def concat_rows(parts: Sequence[Resolved], labels: Sequence[str], label: str) -> Resolved:
    """The rows of ``parts`` one after another (``labels`` name them in errors)."""
    try:
        meta = concat_meta([p.meta for p in parts], list(labels))
    except SchemaError as e:
        raise SchemaError(f"{label}: {e}") from None
    lengths = None
    if all(p.row_lengths is not None for p in parts):
        lengths = tuple(x for p in parts for x in p.row_lengths or ())
    leases = tuple({id(le): le for p in parts for le in p.leases}.values())
    first = parts[0].transforms
    for name, p in zip(labels, parts, strict=True):
        if not _mapped_alike(p.transforms, first):
            raise SchemaError(f"{label}: {name} was mapped differently from {labels[0]}; "
                              "concat first, then map() the result")
    return Resolved(meta=meta, row_lengths=lengths, leases=leases, transforms=first)


def _mapped_alike(a: Sequence[BoundTransform], b: Sequence[BoundTransform]) -> bool:
    return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b, strict=True))
