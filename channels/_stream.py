"""Wire form of a stream of rows, and how its micro-batches become one batch again.

A streaming group call (``roles.actor.generate(prompts, stream=True)``) reports,
from each rank through a typed channel, :class:`StreamItem` s: a micro-batch of
finished rows stored in the rank's shard store, the rank's progress, or the
unfinished rows it hands off to another rank (long-tail migration). Each row
carries a *row id*, ``rank << 32 | index``: the rank that was given the row and
its position among that rank's outputs, so sorting by row id gives the order a
non-streaming call returns. :func:`collect_parts` builds the metadata of the whole
batch back from its micro-batches by row id, without moving a row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

import msgspec

from channels._errors import SchemaError
from channels._schema import BatchMeta, ColumnGroup, FieldSpec, Segment

ROW_ID_BITS = 32
"""Bits of a row id that hold the row's index within its rank's outputs."""


def row_id(rank: int, index: int) -> int:
    """The id of output row ``index`` of ``rank`` (see the module docstring)."""
    return (rank << ROW_ID_BITS) | index


class StreamItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a streaming rank reports through its channel.

    ``kind`` says which: ``"rows"`` (a micro-batch of finished rows, stored under
    ``key``), ``"progress"`` (only ``pending`` changed) or ``"tail"`` (the rank's
    unfinished samples, stored under ``key``, handed to another rank).
    """

    kind: Literal["rows", "progress", "tail"]
    rank: int
    """The rank (in its pool) that sent the item."""
    worker: int
    """Its session-wide worker index (holds the rows)."""
    key: str | None = None
    """Shard key of the rows (None for progress)."""
    num_rows: int = 0
    fields: tuple[FieldSpec, ...] = ()
    row_ids: tuple[int, ...] = ()
    """Per row, its row id (``rows``; empty for a tail, whose rows carry their ids)."""
    row_lengths: tuple[int, ...] | None = None
    """Per-row token counts, when the method declares ``row_lengths``."""
    group_size: int = 1
    pending: int = 0
    """Samples the rank is still generating after this item."""

    def meta(self) -> BatchMeta:
        """The metadata of the item's rows (one shard)."""
        if self.key is None or not self.num_rows:
            return BatchMeta(num_rows=0, group_size=self.group_size)
        seg = Segment(worker=self.worker, key=self.key, offset=0, start=0, stop=self.num_rows)
        return BatchMeta(num_rows=self.num_rows, groups=(ColumnGroup(fields=self.fields, segments=(seg,)),),
                         group_size=self.group_size)


def collect_parts(parts: Sequence[tuple[BatchMeta, Sequence[int]]]) -> tuple[BatchMeta, list[int]]:
    """One batch from micro-batches with row ids, rows sorted by id.

    Args:
        parts: each micro-batch's metadata and its rows' ids (same length).

    Returns:
        The batch's metadata and, per output row, ``(part, row)`` flattened as the
        position of that row in the concatenation of ``parts`` (for reordering
        per-row values such as lengths).

    Raises:
        SchemaError: parts with different columns, ids that repeat, or ids whose
            count differs from a part's rows.
    """
    flat: list[tuple[int, int]] = []  # (row id, position in the concatenation)
    base = 0
    for meta, ids in parts:
        if len(ids) != meta.num_rows:
            raise SchemaError(f"a micro-batch of {meta.num_rows} rows has {len(ids)} row ids")
        flat.extend((rid, base + i) for i, rid in enumerate(ids))
        base += meta.num_rows
    flat.sort()
    if any(a[0] == b[0] for a, b in itertools.pairwise(flat)):
        raise SchemaError("a row id appears in two micro-batches")
    where = [0] * len(flat)
    for pos, (_, concat) in enumerate(flat):
        where[concat] = pos
    layouts = {_signature(meta) for meta, _ in parts if meta.num_rows}
    if len(layouts) > 1:
        raise SchemaError(f"micro-batches carry different columns: {sorted(layouts)}")
    segments: dict[int, list[Segment]] = {}
    template: BatchMeta | None = None
    base = 0
    for meta, _ in parts:
        if not meta.num_rows:
            continue
        template = template or meta
        for gi, g in enumerate(meta.groups):
            out = segments.setdefault(gi, [])
            for s in g.segments:
                out.extend(_moved(s, [where[base + r] for r in range(s.start, s.stop)]))
        base += meta.num_rows
    if template is None:
        sizes = [m.group_size for m, _ in parts] or [1]
        return BatchMeta(num_rows=0, group_size=math.lcm(*sizes)), []
    groups = tuple(ColumnGroup(fields=g.fields, stored=g.stored,
                               segments=tuple(sorted(segments[gi], key=lambda s: s.start)))
                   for gi, g in enumerate(template.groups))
    order = [concat for _, concat in flat]
    return BatchMeta(num_rows=len(flat), groups=groups, group_size=template.group_size), order


def _signature(meta: BatchMeta) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(f.name for f in g.fields) for g in meta.groups)


def _moved(s: Segment, targets: list[int]) -> list[Segment]:
    """Segment ``s`` with its rows placed at ``targets`` (split where they jump)."""
    out: list[Segment] = []
    run_start = 0
    for i in range(1, len(targets) + 1):
        if i == len(targets) or targets[i] != targets[i - 1] + 1:
            out.append(Segment(worker=s.worker, key=s.key, offset=s.offset + run_start,
                               start=targets[run_start], stop=targets[i - 1] + 1))
            run_start = i
    return out
