"""Wire schemas of the data plane: what a batch holds and where its rows live.

A :class:`BatchMeta` is all a data future carries: field names, dtypes and per-row
shapes, the row count, and for every run of rows the worker, shard key and offset
that hold them. It is small (independent of the payload size) and msgspec-encoded
when it crosses processes. Tensors never travel inside these Structs.

Columns produced by different calls (``merge``) keep their own locations, so a
batch is a tuple of :class:`ColumnGroup` s that share the row count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import msgspec

from channels._errors import MissingFieldError, SchemaError

_WIRE = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}

RowRuns = tuple[tuple[int, int], ...]
"""A row selection: half-open ``(start, stop)`` runs of logical rows, in order."""


class FieldSpec(msgspec.Struct, **_WIRE):
    """One column: its name, torch dtype name and the shape of a single row."""

    name: str
    """Column name, e.g. ``"response_ids"``."""
    dtype: str
    """torch dtype without the ``torch.`` prefix, e.g. ``"int64"``."""
    shape: tuple[int, ...]
    """Shape of one row (the batch dimension excluded)."""

    def row_bytes(self) -> int:
        """Bytes one row of this column occupies."""
        import torch  # deferred: schemas are importable without torch

        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


class Segment(msgspec.Struct, **_WIRE, array_like=True, gc=False):
    """Logical rows ``[start, stop)`` are rows ``[offset, offset + stop - start)`` of
    shard ``key`` in the store of worker ``worker``."""

    worker: int
    """Session-wide worker index of the producer."""
    key: str
    """Shard key in that worker's store."""
    offset: int
    """First row inside the shard."""
    start: int
    """First logical row covered."""
    stop: int
    """One past the last logical row covered."""


class ColumnGroup(msgspec.Struct, **_WIRE):
    """Columns produced together, and the segments that hold them."""

    fields: tuple[FieldSpec, ...]
    segments: tuple[Segment, ...]
    """Sorted by ``start``; together they cover ``[0, num_rows)`` exactly once."""
    stored: tuple[str, ...] | None = None
    """Names of the columns in the shards, parallel to ``fields``, when they were
    renamed (None: the same as the field names)."""

    def stored_names(self) -> tuple[str, ...]:
        """The shard-side name of each field."""
        return self.stored if self.stored is not None else tuple(f.name for f in self.fields)


class BatchMeta(msgspec.Struct, **_WIRE):
    """Metadata of a batch of rows spread over workers."""

    num_rows: int
    groups: tuple[ColumnGroup, ...] = ()
    group_size: int = 1
    """Rows come in runs of this many consecutive rows (e.g. the samples of one
    prompt) that data-parallel splits keep on one rank."""

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        """Every column, in group order."""
        return tuple(f for g in self.groups for f in g.fields)

    @property
    def field_names(self) -> tuple[str, ...]:
        """Names of every column."""
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> FieldSpec:
        """The spec of column ``name``.

        Raises:
            MissingFieldError: no such column.
        """
        for f in self.fields:
            if f.name == name:
                return f
        raise MissingFieldError(f"field {name!r} is not in this batch (it has {list(self.field_names)})")

    def select(self, names: Iterable[str]) -> BatchMeta:
        """The same rows restricted to columns ``names``.

        Raises:
            MissingFieldError: a name is not a column of this batch.
        """
        wanted = list(dict.fromkeys(names))
        for n in wanted:
            self.field(n)
        groups = []
        for g in self.groups:
            pairs = [(f, s) for f, s in zip(g.fields, g.stored_names(), strict=True) if f.name in wanted]
            if pairs:
                fields = tuple(f for f, _ in pairs)
                stored = tuple(s for _, s in pairs)
                groups.append(ColumnGroup(fields=fields, segments=g.segments,
                                          stored=None if stored == tuple(f.name for f in fields) else stored))
        return BatchMeta(num_rows=self.num_rows, groups=tuple(groups), group_size=self.group_size)

    def rename(self, mapping: Mapping[str, str]) -> BatchMeta:
        """The same batch with columns renamed (metadata only: the shards keep their
        names and pulls map them).

        Raises:
            MissingFieldError: a renamed column does not exist.
            SchemaError: a new name collides with another column.
        """
        for old in mapping:
            self.field(old)
        names = [mapping.get(n, n) for n in self.field_names]
        if len(set(names)) != len(names):
            raise SchemaError(f"renaming {dict(mapping)} gives duplicate columns {names}")
        groups = []
        for g in self.groups:
            fields = tuple(msgspec.structs.replace(f, name=mapping.get(f.name, f.name)) for f in g.fields)
            groups.append(ColumnGroup(fields=fields, segments=g.segments, stored=g.stored_names()))
        return BatchMeta(num_rows=self.num_rows, groups=tuple(groups), group_size=self.group_size)

    def shard_keys(self) -> set[tuple[int, str]]:
        """Every ``(worker, key)`` this batch's rows live in."""
        return {(s.worker, s.key) for g in self.groups for s in g.segments}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Payload size in bytes of the columns ``names`` (all when None)."""
        chosen = self.fields if names is None else [self.field(n) for n in names]
        return self.num_rows * sum(f.row_bytes() for f in chosen)


def merge_meta(metas: Sequence[BatchMeta]) -> BatchMeta:
    """Union the columns of batches that have the same rows.

    A column may be in several inputs only when it is the same column: same
    schema, same shards and the same shard-side name (it is then kept once).

    Raises:
        SchemaError: the row counts differ, or one name stands for two columns.
    """
    if not metas:
        raise SchemaError("merge needs at least one batch")
    rows = {m.num_rows for m in metas}
    if len(rows) != 1:
        raise SchemaError(f"merge needs batches with the same row count, got {[m.num_rows for m in metas]}")
    seen: dict[str, tuple[FieldSpec, str, tuple[Segment, ...]]] = {}
    groups: list[ColumnGroup] = []
    for m in metas:
        fresh = []
        for g in m.groups:
            for f, stored in zip(g.fields, g.stored_names(), strict=True):
                where = (f, stored, g.segments)
                if f.name not in seen:
                    seen[f.name] = where
                    fresh.append(f.name)
                elif seen[f.name] != where:
                    raise SchemaError(
                        f"field {f.name!r} is in two inputs as different columns; rename one before merging"
                    )
        groups.extend(m.select(fresh).groups if fresh else ())
    group_size = math.lcm(*(m.group_size for m in metas))
    if metas[0].num_rows % group_size:
        raise SchemaError(f"merged batches have incompatible group sizes {[m.group_size for m in metas]}")
    return BatchMeta(num_rows=metas[0].num_rows, groups=tuple(groups), group_size=group_size)


def runs_length(runs: RowRuns) -> int:
    """Number of rows a selection holds."""
    return sum(stop - start for start, stop in runs)


def runs_from_indices(indices: Iterable[int]) -> RowRuns:
    """Compress row indices (in consumer order) into runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def iter_runs(runs: RowRuns) -> Iterator[int]:
    """The row indices of a selection, in order."""
    for start, stop in runs:
        yield from range(start, stop)
