"""Row selection and concatenation on metadata (``select_rows``, ``concat_meta``):
pulling the result's rows gives exactly the chosen rows of the inputs, in order."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from channels import (
    Batch,
    BatchMeta,
    ColumnGroup,
    SchemaError,
    Segment,
    assemble,
    concat_meta,
    merge_meta,
    plan_pull,
    runs_from_indices,
    select_rows,
)

Stores = dict[tuple[int, str], Batch]


def _sharded(n: int, cuts: list[int], *, key: str, base: int = 0, group_size: int = 1,
             offset: int = 2) -> tuple[BatchMeta, Stores, torch.Tensor]:
    """Rows ``base .. base + n - 1`` (column ``i``; ``x`` derived) as shards on
    workers 0..k split at ``cuts``; every shard starts with ``offset`` unrelated rows."""
    ids = torch.arange(base, base + n)
    bounds = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    segs, stores = [], {}
    for w, (a, b) in enumerate(itertools.pairwise(bounds)):
        pad = torch.full((offset,), -1)
        stores[(w, key)] = Batch({"i": torch.cat([pad, ids[a:b]]), "x": torch.cat([pad, ids[a:b]]).double() * 2})
        segs.append(Segment(worker=w, key=key, offset=offset, start=a, stop=b))
    fields = Batch({"i": ids, "x": ids.double()}).field_specs()
    meta = BatchMeta(num_rows=n, groups=(ColumnGroup(fields=fields, segments=tuple(segs)),), group_size=group_size)
    return meta, stores, ids


def _pull(meta: BatchMeta, stores: Stores) -> Batch:
    plan = plan_pull(meta, ((0, meta.num_rows),) if meta.num_rows else ())
    fetched = [stores[(p.worker, p.key)].select(p.fields).slice(p.lo, p.hi) for p in plan.pieces]
    return assemble(plan, fetched)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), cuts=st.lists(st.integers(1, 39), max_size=4), data=st.data())
def test_selected_rows_pull_exactly_those_rows_in_order(n: int, cuts: list[int], data) -> None:
    meta, stores, ids = _sharded(n, cuts, key="k")
    rows = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n))
    out = select_rows(meta, runs_from_indices(rows))
    got = _pull(out, stores)
    assert got["i"].tolist() == [int(ids[r]) for r in rows]
    assert torch.equal(got["x"], got["i"].double() * 2)
    assert out.shard_keys() <= meta.shard_keys()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=4), data=st.data())
def test_concat_pulls_every_input_in_order(sizes: list[int], data) -> None:
    metas, stores, want = [], {}, []
    for k, n in enumerate(sizes):
        cuts = data.draw(st.lists(st.integers(1, 11), max_size=2))
        meta, s, ids = _sharded(n, cuts, key=f"k{k}", base=100 * k)
        metas.append(meta)
        stores.update(s)
        want.extend(ids.tolist())
    out = concat_meta(metas)
    assert out.num_rows == sum(sizes)
    assert _pull(out, stores)["i"].tolist() == want


def test_select_rows_keeps_groups_only_when_runs_stay_on_group_boundaries() -> None:
    meta, _, _ = _sharded(12, [4, 8], key="k", group_size=4)
    assert select_rows(meta, ((4, 12),)).group_size == 4
    assert select_rows(meta, ((0, 4), (8, 12))).group_size == 4
    assert select_rows(meta, ((0, 2),)).group_size == 1
    assert select_rows(meta, ()).num_rows == 0
    empty = select_rows(meta, ())
    assert empty.field_names == meta.field_names  # a consumer still learns the schema
    with pytest.raises(SchemaError, match="outside a batch of 12 rows"):
        select_rows(meta, ((10, 13),))


def test_select_rows_merges_adjacent_rows_of_one_shard_into_one_segment() -> None:
    meta, _, _ = _sharded(8, [], key="k")
    out = select_rows(meta, runs_from_indices([1, 2, 3, 5]))
    segs = out.groups[0].segments
    assert [(s.offset, s.start, s.stop) for s in segs] == [(3, 0, 3), (7, 3, 4)]


def test_concat_of_differently_merged_inputs_refines_column_groups() -> None:
    a, sa, _ = _sharded(4, [2], key="a")
    b, sb, _ = _sharded(3, [], key="b", base=50)
    # b's columns come from two calls (a merge): ``i`` from one shard, ``x`` from another
    other = BatchMeta(num_rows=3, groups=(ColumnGroup(fields=(b.field("x"),), segments=(
        Segment(worker=9, key="bx", offset=0, start=0, stop=3),)),))
    b2 = merge_meta([b.select(["i"]), other])
    stores = {**sa, **sb, (9, "bx"): Batch({"x": torch.arange(50, 53).double() * 2})}
    out = concat_meta([a, b2])
    assert [tuple(f.name for f in g.fields) for g in out.groups] == [("i",), ("x",)]
    got = _pull(out, stores)
    assert got["i"].tolist() == [0, 1, 2, 3, 50, 51, 52]
    assert torch.equal(got["x"], got["i"].double() * 2)


def test_concat_rejects_different_schemas_and_group_sizes_naming_the_input() -> None:
    a, _, _ = _sharded(4, [], key="a")
    with pytest.raises(SchemaError, match=r"same fields: first has \['i', 'x'\] but second has \['i'\]"):
        concat_meta([a, a.select(["i"])], ["first", "second"])
    wide_x = msgspec.structs.replace(a.field("x"), shape=(2,))
    wide = BatchMeta(num_rows=4, groups=(ColumnGroup(fields=(a.field("i"), wide_x), segments=a.groups[0].segments),))
    with pytest.raises(SchemaError, match=r"field 'x' is float64\[\] in #0 but float64\[2\] in #1; pad rows"):
        concat_meta([a, wide])
    grouped = BatchMeta(num_rows=4, groups=a.groups, group_size=2)
    with pytest.raises(SchemaError, match="one group size"):
        concat_meta([a, grouped])
    renamed = BatchMeta(num_rows=4, groups=(ColumnGroup(fields=a.groups[0].fields, segments=a.groups[0].segments,
                                                        stored=("i", "y")),))
    with pytest.raises(SchemaError, match="field 'x' of #1 is a renamed column"):
        concat_meta([a, renamed])
    with pytest.raises(SchemaError, match="at least one"):
        concat_meta([])
