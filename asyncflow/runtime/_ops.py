"""Operations on data futures that move no rows: ``merge`` (of futures or of streams)."""

from __future__ import annotations

from typing import Any

from asyncflow.runtime._datastream import DataStream, template, zip_into
from asyncflow.runtime._future import DataFuture, Resolved, Transform
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


def _merge_streams(streams: list[DataStream[Any]]) -> DataStream[BatchMeta]:
    probe = _merge_futures(tuple(template(s) for s in streams))
    out: DataStream[BatchMeta] = DataStream(label=probe.label, fields=probe.fields, origins=probe._origins,
                                            runtime=streams[0]._runtime, spawn=streams[0]._spawn)
    out._spawn(zip_into(out, streams, lambda futs: _merge_futures(tuple(futs))), f"asyncflow-{probe.label}")
    return out


def _merge_futures(futures: tuple[DataFuture[Any], ...]) -> DataFuture[BatchMeta]:
    if len({id(f._runtime) for f in futures}) != 1:
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
                                            runtime=futures[0]._runtime, derive=derive, parents=futures)
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


def _merged_transforms(parts: list[Resolved]) -> tuple[Transform, ...]:
    out: list[Transform] = []
    written: dict[str, Transform] = {}
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
