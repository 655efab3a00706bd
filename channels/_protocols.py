"""Transfer protocols: how a group call's input rows map onto the callee's ranks
(``distribute``) and how the ranks' outputs become one result (``collect``).

Protocols are objects, declared per worker method with ``register``. The built-in
ones cover the usual RLHF patterns; subclass :class:`TransferProtocol` for others.
All decisions use metadata only: the driver never sees a row.
"""

from __future__ import annotations

import abc
import math
import typing
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from channels._errors import ConfigError, SchemaError
from channels._layout import GenerationLayout, Layout
from channels._schema import (
    BatchMeta,
    ColumnGroup,
    FieldSpec,
    RowRuns,
    Segment,
)
from channels._split import split_rows

Assignment = RowRuns | None
"""Rows one rank receives (None: the rank runs without input rows)."""

Balance = Literal["rows", "tokens"]
"""How a data-parallel protocol splits rows over its replicas: ``"rows"``, the
contiguous even split (order kept); ``"tokens"``, the same counts with the rows'
token counts balanced (:func:`~channels.split_rows` with weights: as few rows move
off the even split as balance allows), which needs the rows' producer to declare
them (``register(row_lengths=FIELD)``)."""


class PullTiming(msgspec.Struct, frozen=True, kw_only=True):
    """How long a traced rank took to assemble one piece of its input (its own
    clock)."""

    start: float
    end: float
    source: int
    """Worker the piece came from (the rank's own index: it held the piece)."""
    rows: int
    bytes: int
    """Bytes that travelled (0 for a piece the rank held)."""


class RankTiming(msgspec.Struct, frozen=True, kw_only=True):
    """A traced rank's part of a call, on the rank's own clock (``time.time()``)."""

    start: float
    end: float
    rows_in: int = 0
    """Rows of the largest data argument."""
    bytes_pulled: int = 0
    pulls: tuple[PullTiming, ...] = ()
    cpu_s: float = 0.0
    """CPU seconds the calling thread ran from ``start`` to ``end``
    (``time.thread_time``): short of ``end - start`` by the time it waited for
    a peer, a lock or a core."""


class RankResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank reports after a call: where its output rows are, or a small value."""

    rank: int
    worker: int
    key: str | None = None
    """Shard key of the output rows (None: the method returned no rows)."""
    num_rows: int = 0
    fields: tuple[FieldSpec, ...] = ()
    row_lengths: tuple[int, ...] | None = None
    """Per-row token counts, when the method declares ``row_lengths``."""
    value: Any = None
    """A small non-row result (e.g. a metrics dict)."""
    group_size: int = 1
    """Consecutive rows that belong together (see ``BatchMeta.group_size``)."""
    timing: RankTiming | None = None
    """When the call was traced: the rank's span."""


class Collected(msgspec.Struct, frozen=True, kw_only=True):
    """A collected batch plus the per-row lengths that balanced splits use."""

    meta: BatchMeta
    row_lengths: tuple[int, ...] | None = None


class TransferProtocol(abc.ABC):
    """How rows travel into and out of a group call."""

    @abc.abstractmethod
    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        """Rows each rank of ``layout`` receives, one entry per rank."""

    @abc.abstractmethod
    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> Any:
        """One result from every rank's result (``results[r]`` is rank ``r``'s);
        ``assignments`` is what :meth:`distribute` gave the first data argument."""

    def counting_ranks(self, layout: Layout) -> list[bool] | None:
        """Which ranks' rows make up the call's batch once each, for reductions over
        every row of a call (e.g. whitening statistics summed over the ranks).

        Returns:
            One flag per rank of ``layout``: True where a sum over the rank's rows
            belongs in a sum over the whole batch (each row counted on exactly one
            rank); or None when every rank that runs the call holds all of its rows
            (nothing to reduce over ranks).

        Raises:
            ConfigError: the protocol does not say (override this method).
        """
        raise ConfigError(
            f"{type(self).__name__} does not say how its rows spread over ranks; override "
            "TransferProtocol.counting_ranks to use transforms that reduce over the call's rows"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _batch_from(results: Sequence[RankResult], assignments: Sequence[Assignment] | None) -> Collected:
    """Concatenate the output shards of ``results``; rows go back to input order when
    every result answers exactly the rows it was given."""
    shards = [r for r in results if r.key is not None and r.num_rows > 0]
    fields = _common_fields(results)
    mapped = assignments is not None and all(
        assignments[r.rank] is not None and sum(b - a for a, b in assignments[r.rank] or ()) == r.num_rows
        for r in results
    )
    segments: list[Segment] = []
    lengths: dict[int, int] = {}
    if mapped:
        assert assignments is not None
        for r in shards:
            offset = 0
            for start, stop in assignments[r.rank] or ():
                segments.append(Segment(worker=r.worker, key=r.key or "", offset=offset, start=start, stop=stop))
                if r.row_lengths is not None:
                    lengths.update(zip(range(start, stop), r.row_lengths[offset : offset + stop - start], strict=True))
                offset += stop - start
        segments.sort(key=lambda s: s.start)
        num_rows = sum(r.num_rows for r in results)
    else:
        num_rows = 0
        for r in shards:
            segments.append(Segment(worker=r.worker, key=r.key or "", offset=0, start=num_rows, stop=num_rows + r.num_rows))
            if r.row_lengths is not None:
                lengths.update(zip(range(num_rows, num_rows + r.num_rows), r.row_lengths, strict=True))
            num_rows += r.num_rows
    groups = (ColumnGroup(fields=fields, segments=tuple(segments)),) if fields else ()
    row_lengths = tuple(lengths[i] for i in range(num_rows)) if len(lengths) == num_rows and num_rows else None
    sizes = {r.group_size for r in shards} or {1}
    if len(sizes) != 1:
        raise SchemaError(f"ranks returned rows with different group sizes {sorted(sizes)}")
    meta = BatchMeta(num_rows=num_rows, groups=groups, group_size=sizes.pop())
    return Collected(meta=meta, row_lengths=row_lengths)


def _common_fields(results: Sequence[RankResult]) -> tuple[FieldSpec, ...]:
    with_rows = [r for r in results if r.key is not None]
    if not with_rows:
        return ()
    first = with_rows[0]
    for r in with_rows[1:]:
        if r.fields != first.fields:
            mine = {f.name: f for f in first.fields}
            for f in r.fields:
                other = mine.get(f.name)
                if other != f:
                    raise SchemaError(
                        f"ranks {first.rank} and {r.rank} returned different schemas for field "
                        f"{f.name!r}: {other} vs {f}; pad rows to a fixed per-row shape"
                    )
            raise SchemaError(
                f"ranks {first.rank} and {r.rank} returned different fields: "
                f"{[f.name for f in first.fields]} vs {[f.name for f in r.fields]}"
            )
    return first.fields


class _Replicated(TransferProtocol):
    """Split rows over replicas; every rank of a replica gets the replica's rows and
    the replica's output rank reports them."""

    def __init__(self, *, balance: Balance = "rows", group_size: int = 1) -> None:
        if balance not in typing.get_args(Balance):
            raise ConfigError(f"balance must be 'rows' or 'tokens', got {balance!r}")
        if group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {group_size}")
        self.balance = balance
        self.group_size = group_size

    @abc.abstractmethod
    def replicas(self, layout: Layout) -> list[tuple[int, bool]]:
        """For each rank: (replica index, whether it is its replica's output rank)."""

    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        reps = self.replicas(layout)
        n_rep = max(i for i, _ in reps) + 1
        per_replica = split_rows(
            meta.num_rows, n_rep, group_size=math.lcm(self.group_size, meta.group_size),
            weights=_weights(self.balance, row_lengths, meta.num_rows),
        )
        return [per_replica[i] for i, _ in reps]

    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> Collected:
        outputs = [results[r] for r, (_, out) in enumerate(self.replicas(layout)) if out]
        return _batch_from(outputs, assignments)

    def counting_ranks(self, layout: Layout) -> list[bool] | None:
        """Each replica's output rank counts its replica's rows (the other ranks of a
        replica hold copies of them); None with a single replica."""
        reps = self.replicas(layout)
        if len({i for i, _ in reps}) == 1:
            return None
        return [out for _, out in reps]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(balance={self.balance!r}, group_size={self.group_size})"


def _weights(balance: str, row_lengths: Sequence[int] | None, n: int) -> Sequence[int] | None:
    if balance == "rows":
        return None
    if row_lengths is None or len(row_lengths) != n:
        raise ConfigError(
            "balance='tokens' needs per-row lengths: declare row_lengths=FIELD on the method "
            "that produced the rows"
        )
    return row_lengths


class DP(_Replicated):
    """Data parallel: rows split over the ``d`` data-parallel groups, replicated
    within each group's tensor/pipeline ranks; collected from each group's output
    rank (last pipeline stage, tensor rank 0).

    Args:
        balance: ``"rows"`` or ``"tokens"`` (see :data:`Balance`).
        group_size: keep runs of this many consecutive rows (e.g. GRPO's samples of
            one prompt) on one rank.
    """

    def replicas(self, layout: Layout) -> list[tuple[int, bool]]:
        out = []
        for r in range(layout.world):
            c = layout.coords(r)
            out.append((c.dp, c.tp == 0 and c.pp == layout.p - 1))
        return out


class AllToAll(_Replicated):
    """Every rank gets its own share of the rows and reports its own output."""

    def replicas(self, layout: Layout) -> list[tuple[int, bool]]:
        return [(r, True) for r in range(layout.world)]


class MicroDP(_Replicated):
    """The hybrid engine's generation layout: each training replica of ``p * t``
    ranks holds ``dg = (p*t) / (pg*tg)`` generation replicas (see
    :class:`~channels.GenerationLayout`); rows split over all ``d * dg`` of them,
    replicated within a replica's generation TP/PP ranks, and collected from each
    replica's generation TP rank 0 on its last generation stage.

    Args:
        tg: generation tensor-parallel size (must divide the training ``t``), with
            the ``hybridflow`` grouping and ``pg = 1``; None (the default) uses the
            callee layout's own ``gen`` (whole weights on every rank without one).
    """

    def __init__(self, *, tg: int | None = None, balance: Balance = "rows",
                 group_size: int = 1) -> None:
        super().__init__(balance=balance, group_size=group_size)
        if tg is not None and (not isinstance(tg, int) or tg < 1):
            raise ConfigError(f"MicroDP.tg must be an int >= 1 or None, got {tg!r}")
        self.tg = tg

    def replicas(self, layout: Layout) -> list[tuple[int, bool]]:
        if self.tg is not None:
            if layout.t % self.tg:
                raise ConfigError(f"MicroDP.tg={self.tg} must divide the training tensor size t={layout.t}")
            layout = Layout(p=layout.p, t=layout.t, d=layout.d, gen=GenerationLayout(tg=self.tg))
        last = layout.generation.pg - 1
        out = []
        for r in range(layout.world):
            g = layout.gen_coords(r)
            out.append((g.replica, g.tp == 0 and g.pp == last))
        return out

    def __repr__(self) -> str:
        return f"MicroDP(tg={self.tg}, balance={self.balance!r}, group_size={self.group_size})"


class OneToAll(TransferProtocol):
    """Every rank gets every row. Rows returned by all ranks are concatenated in rank
    order; values come back as a list in rank order."""

    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        whole: RowRuns = ((0, meta.num_rows),) if meta.num_rows else ()
        return [whole] * layout.world

    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> Any:
        if any(r.key is not None for r in results):
            return _batch_from(results, None)
        return [r.value for r in results]

    def counting_ranks(self, layout: Layout) -> list[bool] | None:
        """None: every rank holds every row."""
        return None


class TensorShards(TransferProtocol):
    """Rows that are tensor-parallel shards (row ``k`` of ``R`` holds the ``k``-th of
    ``R`` shards, as ``actor.weights()`` publishes them), to a callee laid out with
    tensor size ``t``: the rank with tensor coordinate ``j`` gets the rows that make
    its own shard, rows ``j*R/t .. (j+1)*R/t - 1`` when ``t`` divides ``R``, or row
    ``j*R // t`` (a larger shard it cuts its part from) when ``R`` divides ``t``.
    Every data-parallel replica and pipeline stage gets the same rows; values come
    back as a list in rank order.

    Raises:
        ConfigError: (at dispatch) neither of ``R`` and ``t`` divides the other.
    """

    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        rows, t = meta.num_rows, layout.t
        if rows == 0:
            return [()] * layout.world
        if rows % t and t % rows:
            raise ConfigError(f"TensorShards: {rows} shard rows cannot be split over tensor size {t} "
                              f"(layout {layout}); one of them must divide the other")
        out: list[Assignment] = []
        for r in range(layout.world):
            j = layout.coords(r).tp
            lo = j * rows // t
            out.append(((lo, max(lo + 1, (j + 1) * rows // t)),))  # R / t rows, or the one holding its part
        return out

    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> Any:
        if any(r.key is not None for r in results):
            return _batch_from(results, None)
        return [r.value for r in results]


class RankZero(TransferProtocol):
    """Rank 0 gets every row; the other ranks run without rows (e.g. to join a
    collective). Rank 0's output is the result."""

    def distribute(self, meta: BatchMeta, layout: Layout, row_lengths: Sequence[int] | None) -> list[Assignment]:
        whole: RowRuns = ((0, meta.num_rows),) if meta.num_rows else ()
        return [whole] + [None] * (layout.world - 1)

    def collect(self, results: Sequence[RankResult], layout: Layout, assignments: Sequence[Assignment] | None) -> Any:
        r0 = results[0]
        if r0.key is not None:
            return _batch_from([r0], assignments)
        return r0.value

    def counting_ranks(self, layout: Layout) -> list[bool] | None:
        """None: only rank 0 gets rows, and it gets all of them."""
        return None
