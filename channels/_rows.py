"""Row selection and concatenation on batch metadata: which rows of which shards a
smaller or longer batch is made of, without moving a row.

:func:`select_rows` keeps some rows of a batch (by position, in any order);
:func:`concat_meta` puts the rows of several batches one after another. Both
return a :class:`~channels.BatchMeta` whose segments point into the same shards
as their inputs, so consumers pull exactly the chosen rows from their producers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from channels._errors import SchemaError
from channels._schema import BatchMeta, ColumnGroup, FieldSpec, RowRuns, Segment, runs_length


def select_rows(meta: BatchMeta, runs: RowRuns) -> BatchMeta:
    """The rows ``runs`` of ``meta`` (in the order of ``runs``) as a new batch.

    Groups (``meta.group_size``) survive when every run starts and stops on a
    group boundary; otherwise the result has ``group_size`` 1.

    Args:
        meta: the batch to select from.
        runs: half-open ``(start, stop)`` runs of ``meta``'s rows, e.g. from
            ``runs_from_indices``.

    Raises:
        SchemaError: a run reaches outside ``[0, meta.num_rows)``.
    """
    for start, stop in runs:
        if not 0 <= start <= stop <= meta.num_rows:
            raise SchemaError(f"rows [{start}, {stop}) are outside a batch of {meta.num_rows} rows")
    groups = tuple(ColumnGroup(fields=g.fields, stored=g.stored, segments=_select_segments(g.segments, runs))
                   for g in meta.groups)
    gs = meta.group_size
    whole = all(start % gs == 0 and stop % gs == 0 for start, stop in runs)
    return BatchMeta(num_rows=runs_length(runs), groups=groups, group_size=gs if whole else 1)


def _select_segments(segments: tuple[Segment, ...], runs: RowRuns) -> tuple[Segment, ...]:
    starts = [s.start for s in segments]
    out: list[Segment] = []
    at = 0  # next logical row of the result
    for start, stop in runs:
        row = start
        while row < stop:
            i = bisect.bisect_right(starts, row) - 1
            if i < 0 or segments[i].stop <= row:
                raise SchemaError(f"row {row} is not covered by any segment")
            seg = segments[i]
            end = min(stop, seg.stop)
            offset = seg.offset + (row - seg.start)
            last = out[-1] if out else None
            if last is not None and (last.worker, last.key, last.offset + last.stop - last.start) == (
                    seg.worker, seg.key, offset):
                out[-1] = Segment(worker=seg.worker, key=seg.key, offset=last.offset, start=last.start,
                                  stop=at + end - row)
            else:
                out.append(Segment(worker=seg.worker, key=seg.key, offset=offset, start=at, stop=at + end - row))
            at += end - row
            row = end
    return tuple(out)


def concat_meta(metas: Sequence[BatchMeta], labels: Sequence[str] | None = None) -> BatchMeta:
    """The rows of ``metas`` one after another, as one batch.

    Every input must have the same columns (names, dtypes and per-row shapes) and
    the same group size. Columns that two inputs produced together may come from
    different calls in each: the result's column groups are the finest grouping
    that every input's grouping refines.

    Args:
        metas: the batches, in order.
        labels: a name per batch for error messages (default ``#0``, ``#1``, ...).

    Raises:
        SchemaError: no batches; the columns, their dtypes or shapes, or the group
            sizes differ; or one column is stored under different shard-side names
            (renamed in one input only).
    """
    if not metas:
        raise SchemaError("concat needs at least one batch")
    names = list(labels) if labels is not None else [f"#{i}" for i in range(len(metas))]
    _check_same_schema(metas, names)
    sizes = {m.group_size for m in metas}
    if len(sizes) != 1:
        got = ", ".join(f"{n}: {m.group_size}" for n, m in zip(names, metas, strict=True))
        raise SchemaError(f"concat needs one group size, got {got}; rows cut inside a group lose their "
                          "groups (take(n, groups=True) keeps them), and a method's output gets them back "
                          "when merged with its grouped input")
    parts = [(m, n) for m, n in zip(metas, names, strict=True) if m.num_rows] or [(metas[0], names[0])]
    groups = []
    for fields in _common_groups([m for m, _ in parts]):
        stored = _common_stored(fields, parts)
        segments: list[Segment] = []
        base = 0
        for m, _ in parts:
            g = _group_of(m, fields[0].name)
            segments.extend(Segment(worker=s.worker, key=s.key, offset=s.offset, start=base + s.start,
                                    stop=base + s.stop) for s in g.segments)
            base += m.num_rows
        groups.append(ColumnGroup(fields=fields, segments=tuple(segments),
                                  stored=None if stored == tuple(f.name for f in fields) else stored))
    return BatchMeta(num_rows=sum(m.num_rows for m in metas), groups=tuple(groups), group_size=sizes.pop())


def _check_same_schema(metas: Sequence[BatchMeta], names: Sequence[str]) -> None:
    first = {f.name: f for f in metas[0].fields}
    for m, label in zip(metas[1:], names[1:], strict=True):
        mine = {f.name: f for f in m.fields}
        if set(mine) != set(first):
            raise SchemaError(f"concat needs the same fields: {names[0]} has {sorted(first)} but {label} has "
                              f"{sorted(mine)}; select() the common ones first")
        for name, spec in mine.items():
            if spec != first[name]:
                raise SchemaError(f"concat: field {name!r} is {_spec(first[name])} in {names[0]} but "
                                  f"{_spec(spec)} in {label}; pad rows to one per-row shape and dtype")


def _spec(f: FieldSpec) -> str:
    return f"{f.dtype}{list(f.shape)}"


def _group_of(meta: BatchMeta, name: str) -> ColumnGroup:
    return next(g for g in meta.groups if any(f.name == name for f in g.fields))


def _common_groups(metas: Sequence[BatchMeta]) -> list[tuple[FieldSpec, ...]]:
    """Columns grouped so that each output group lies in one group of every input."""
    where = [{f.name: gi for gi, g in enumerate(m.groups) for f in g.fields} for m in metas]
    out: dict[tuple[int, ...], list[FieldSpec]] = {}
    for f in metas[0].fields:
        out.setdefault(tuple(w[f.name] for w in where), []).append(f)
    return [tuple(fields) for fields in out.values()]


def _common_stored(fields: tuple[FieldSpec, ...], parts: Sequence[tuple[BatchMeta, str]]) -> tuple[str, ...]:
    stored: tuple[str, ...] | None = None
    for m, label in parts:
        g = _group_of(m, fields[0].name)
        by_name = dict(zip((f.name for f in g.fields), g.stored_names(), strict=True))
        mine = tuple(by_name[f.name] for f in fields)
        if stored is not None and mine != stored:
            differ = next(f.name for f, a, b in zip(fields, stored, mine, strict=True) if a != b)
            raise SchemaError(f"concat: field {differ!r} of {label} is a renamed column while another input's "
                              "is not; concat before renaming, or rename every input alike")
        stored = mine
    assert stored is not None
    return stored
