"""Operations that combine data futures and move no rows: ``merge`` (of futures or of
streams) and ``concat``."""

from __future__ import annotations

from typing import Any

from asyncflow.runtime._datastream import DataStream, template, zip_into
from asyncflow.runtime._future import DataFuture, derived
from asyncflow.runtime._resolved import Resolved
from asyncflow.runtime._select import concat_fields, concat_rows
from asyncflow.runtime._transform import BoundTransform
from channels import BatchMeta, ConfigError, SchemaError, merge_meta


def merge(*futures: Any) -> Any:
    """A future of the union of the columns of ``futures`` (same rows, same order).

    A column may appear in several futures only when it is the same column of the
    same producer (e.g. ``merge(a, a.map(f))``); two different columns with one
    name are an error (rename one first).

    Given :class:`DataStream` s (all of them streams derived from one streamed
    call), returns a stream that merges them micro-batch by micro-batch, matching
    rows by their identity.

    Raises:
        ConfigError: no futures, futures of different sessions, a mix of streams
            and futures, or one name for two different columns (when known at
            call time).
    """
    if not futures:
        raise ConfigError("merge needs at least one future")
    streams = [f for f in futures if isinstance(f, DataStream)]
    if streams:
        if len(streams) != len(futures):
            raise ConfigError("merge takes futures or streams, not both: collect() the streams first")
        return _merge_streams(streams)
    return _merge_futures(futures)


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
            hint = "; collect() the stream first" if isinstance(f, DataStream) else ""
            raise ConfigError(f"concat takes DataFutures, got {type(f).__name__}{hint}")
    if len({id(f._owner) for f in futures}) != 1:
        raise ConfigError("concat needs futures of one session")
    fields = concat_fields([(f.label, f.fields) for f in futures])
    label = "concat(" + ", ".join(f.label for f in futures) + ")"

    async def compute() -> tuple[Resolved, tuple[int, ...] | None]:
        parts = [await f._rows("concat") for f in futures]
        return concat_rows(parts, [f.label for f in futures], label), None

    return derived(futures, label, fields=fields, origins=None, compute=compute)


def _merge_streams(streams: list[DataStream[Any]]) -> DataStream[BatchMeta]:
    probe = _merge_futures(tuple(template(s) for s in streams))
    out: DataStream[BatchMeta] = DataStream(label=probe.label, fields=probe.fields, origins=probe._origins,
                                            owner=streams[0]._owner, spawn=streams[0]._spawn)
    out._spawn(zip_into(out, streams, lambda futs: _merge_futures(tuple(futs))), f"asyncflow-{probe.label}")
    return out


def _merge_futures(futures: tuple[DataFuture[Any], ...]) -> DataFuture[BatchMeta]:
    if len({id(f._owner) for f in futures}) != 1:
        raise ConfigError("merge needs futures of one session")
    _check_origins(futures)
    known = [f.fields for f in futures]
    fields = None if any(k is None for k in known) else frozenset().union(*(k for k in known if k is not None))
    origins = None
    if fields is not None:
        origins = {name: origin for f in futures for name, origin in (f._origins or {}).items()}

    async def derive() -> Resolved:
        parts = [await f._resolve() for f in futures]
        for f, p in zip(futures, parts, strict=True):
            if not isinstance(p, Resolved):
                raise ConfigError(f"{f.label} returned a value, not rows; it cannot be merged")
        lengths = next((p.row_lengths for p in parts if p.row_lengths is not None), None)
        try:
            meta = merge_meta([p.meta for p in parts])
        except SchemaError as e:
            raise SchemaError(f"merge({', '.join(f.label for f in futures)}): {e}") from None
        return Resolved(meta=meta, row_lengths=lengths, leases=tuple(lease for p in parts for lease in p.leases),
                        transforms=_merged_transforms(parts))

    label = "merge(" + ", ".join(f.label for f in futures) + ")"
    out: DataFuture[BatchMeta] = DataFuture(label=label, fields=fields, origins=origins,
                                            owner=futures[0]._owner, derive=derive, parents=futures)
    ids = {f._row_ids for f in futures}
    if len(ids) == 1:
        out._row_ids = ids.pop()
    return out


def _check_origins(futures: tuple[DataFuture[Any], ...]) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for f in futures:
        for name, origin in (f._origins or {}).items():
            if name in seen and seen[name][0] != origin:
                raise ConfigError(
                    f"merge: field {name!r} comes from both {seen[name][1]} and {f.label} "
                    f"(different columns); rename one, e.g. {f.label.split('#')[0]}(...).rename({name}=...)"
                )
            seen.setdefault(name, (origin, f.label))


def _merged_transforms(parts: list[Resolved]) -> tuple[BoundTransform, ...]:
    out: list[BoundTransform] = []
    written: dict[str, BoundTransform] = {}
    for p in parts:
        for t in p.transforms:
            if any(t is o for o in out):  # the same transform reached through two parents
                continue
            for name in t.writes or ():
                if name in written:
                    raise SchemaError(f"merge: two different transforms write field {name!r}")
                written[name] = t
            out.append(t)
    return tuple(out)
