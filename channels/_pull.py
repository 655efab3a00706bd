"""Pull plans: which rows a consumer rank fetches from which producer, and how it
reassembles them.

The driver computes a :class:`PullPlan` per consumer rank from metadata alone; the
consumer fetches each :class:`Piece` (only the rows and columns it needs) straight
from the producer and calls :func:`assemble`. Bytes moved equal bytes needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import torch

from channels._batch import Batch
from channels._errors import SchemaError, TransportError
from channels._schema import BatchMeta, ColumnGroup, FieldSpec, RowRuns, runs_length

_WIRE = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class Piece(msgspec.Struct, **_WIRE, array_like=True, gc=False):
    """Rows ``[lo, hi)`` of columns ``fields`` of shard ``key`` on worker ``worker``."""

    worker: int
    key: str
    lo: int
    hi: int
    fields: tuple[str, ...]

    @property
    def rows(self) -> int:
        """Rows this piece carries."""
        return self.hi - self.lo


class GroupPlan(msgspec.Struct, **_WIRE):
    """Columns that arrive together, and the pieces (indices into
    :attr:`PullPlan.pieces`) that carry them, in row order."""

    fields: tuple[FieldSpec, ...]
    pieces: tuple[int, ...]
    stored: tuple[str, ...] | None = None
    """Shard-side names of ``fields`` when they differ (a renamed batch)."""


class PullPlan(msgspec.Struct, **_WIRE):
    """Everything one consumer rank needs to fetch for one data argument."""

    num_rows: int
    groups: tuple[GroupPlan, ...]
    pieces: tuple[Piece, ...]
    group_size: int = 1
    """Group size of the assembled rows (the source's, when the runs keep groups whole)."""

    def nbytes(self) -> int:
        """Payload bytes the plan moves."""
        specs = {f.name: f for g in self.groups for f in g.fields}
        return sum(p.rows * sum(specs[n].row_bytes() for n in p.fields) for p in self.pieces)


def _group_pieces(group: ColumnGroup, runs: RowRuns, names: tuple[str, ...]) -> list[Piece]:
    starts = [s.start for s in group.segments]
    pieces: list[Piece] = []
    for start, stop in runs:
        row = start
        while row < stop:
            i = bisect.bisect_right(starts, row) - 1
            if i < 0 or group.segments[i].stop <= row:
                raise SchemaError(f"row {row} is not covered by any segment of columns {names}")
            seg = group.segments[i]
            end = min(stop, seg.stop)
            lo = seg.offset + (row - seg.start)
            hi = lo + (end - row)
            last = pieces[-1] if pieces else None
            if last is not None and (last.worker, last.key, last.hi) == (seg.worker, seg.key, lo):
                pieces[-1] = Piece(worker=seg.worker, key=seg.key, lo=last.lo, hi=hi, fields=names)
            else:
                pieces.append(Piece(worker=seg.worker, key=seg.key, lo=lo, hi=hi, fields=names))
            row = end
    return pieces


def plan_pull(meta: BatchMeta, runs: RowRuns, fields: Iterable[str] | None = None) -> PullPlan:
    """Plan the fetch of rows ``runs`` of columns ``fields`` (all when None).

    Raises:
        MissingFieldError: a requested column is not in ``meta``.
        SchemaError: ``runs`` reach outside ``[0, meta.num_rows)``.
    """
    for start, stop in runs:
        if not 0 <= start <= stop <= meta.num_rows:
            raise SchemaError(f"rows [{start}, {stop}) are outside a batch of {meta.num_rows} rows")
    chosen = meta if fields is None else meta.select(fields)
    groups: list[GroupPlan] = []
    pieces: list[Piece] = []
    for g in chosen.groups:
        names = g.stored_names()
        mine = _group_pieces(g, runs, names)
        groups.append(GroupPlan(fields=g.fields, pieces=tuple(range(len(pieces), len(pieces) + len(mine))),
                                stored=g.stored))
        pieces.extend(mine)
    gs = meta.group_size
    whole = all(start % gs == 0 and stop % gs == 0 for start, stop in runs)
    return PullPlan(num_rows=runs_length(runs), groups=tuple(groups), pieces=tuple(pieces),
                    group_size=gs if whole else 1)


def assemble(plan: PullPlan, fetched: Sequence[Mapping[str, torch.Tensor]]) -> Batch:
    """Build the consumer's batch from the fetched pieces (``fetched[i]`` answers
    ``plan.pieces[i]``).

    Raises:
        TransportError: a piece arrived with the wrong columns or row count.
    """
    if len(fetched) != len(plan.pieces):
        raise TransportError(f"expected {len(plan.pieces)} pieces, got {len(fetched)}")
    columns: dict[str, torch.Tensor] = {}
    for g in plan.groups:
        stored = g.stored if g.stored is not None else tuple(f.name for f in g.fields)
        for spec, source in zip(g.fields, stored, strict=True):
            parts = []
            for i in g.pieces:
                piece, got = plan.pieces[i], fetched[i]
                t = got.get(source)
                if t is None or t.shape[0] != piece.rows:
                    raise TransportError(
                        f"piece {i} from worker {piece.worker} shard {piece.key!r} lacks rows of {spec.name!r}"
                    )
                parts.append(t)
            if not parts:
                columns[spec.name] = torch.empty((0, *spec.shape), dtype=getattr(torch, spec.dtype))
            elif len(parts) == 1:
                columns[spec.name] = parts[0]
            else:
                columns[spec.name] = torch.cat(parts)
    return Batch(columns, group_size=plan.group_size)
