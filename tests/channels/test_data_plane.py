"""Schemas, pull plans, protocols and row splits, on metadata alone (no Ray)."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from channels import (
    DP,
    AllToAll,
    Batch,
    BatchMeta,
    ColumnGroup,
    ConfigError,
    Layout,
    Metrics,
    MicroDP,
    MissingFieldError,
    OneToAll,
    RankResult,
    RankZero,
    SchemaError,
    Segment,
    ShardStore,
    TensorShards,
    assemble,
    merge_meta,
    plan_pull,
    split_rows,
)


def _sharded(n: int, cuts: list[int], width: int = 3) -> tuple[BatchMeta, dict[tuple[int, str], Batch], torch.Tensor]:
    """A batch of n rows stored as shards on workers 0..k, split at ``cuts``."""
    full = torch.arange(n * width, dtype=torch.float32).view(n, width)
    bounds = [0, *sorted(set(cuts)), n]
    segs, stores = [], {}
    for w, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a == b:
            continue
        segs.append(Segment(worker=w, key="k", offset=0, start=a, stop=b))
        stores[(w, "k")] = Batch({"x": full[a:b], "i": torch.arange(a, b)})
    fields = Batch({"x": full, "i": torch.arange(n)}).field_specs()
    return BatchMeta(num_rows=n, groups=(ColumnGroup(fields=fields, segments=tuple(segs)),)), stores, full


def _fetch(plan, stores):
    return [stores[(p.worker, p.key)].select(p.fields).slice(p.lo, p.hi) for p in plan.pieces]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), cuts=st.lists(st.integers(0, 60), max_size=5), parts=st.integers(1, 5))
def test_any_split_reassembles_rows_in_order(n: int, cuts: list[int], parts: int) -> None:
    meta, stores, full = _sharded(n, [c for c in cuts if c <= n])
    got = []
    for runs in split_rows(n, parts):
        plan = plan_pull(meta, runs)
        got.append(assemble(plan, _fetch(plan, stores)))
    out = Batch.concat(got)
    assert torch.equal(out["x"], full)
    assert torch.equal(out["i"], torch.arange(n))


def test_plan_moves_only_needed_rows_and_columns() -> None:
    meta, stores, full = _sharded(20, [5, 10, 15], width=4)
    plan = plan_pull(meta, ((3, 7),), ["x"])
    assert [(p.worker, p.lo, p.hi) for p in plan.pieces] == [(0, 3, 5), (1, 0, 2)]
    assert plan.nbytes() == 4 * 4 * 4  # 4 rows of 4 float32, column i not pulled
    assert torch.equal(assemble(plan, _fetch(plan, stores))["x"], full[3:7])


def test_missing_field_is_named() -> None:
    meta, _, _ = _sharded(4, [])
    with pytest.raises(MissingFieldError, match="'adv'"):
        plan_pull(meta, ((0, 4),), ["adv"])


def test_merge_keeps_each_columns_location() -> None:
    a, _, _ = _sharded(6, [3])
    b = BatchMeta(num_rows=6, groups=(ColumnGroup(
        fields=Batch({"v": torch.zeros(6)}).field_specs(),
        segments=(Segment(worker=9, key="v", offset=0, start=0, stop=6),)),))
    m = merge_meta([a, b])
    assert m.field_names == ("x", "i", "v")
    assert plan_pull(m, ((2, 4),), ["v"]).pieces[0].worker == 9
    with pytest.raises(SchemaError):
        merge_meta([a, BatchMeta(num_rows=5)])


def test_dp_replicates_within_tensor_groups_and_collects_output_ranks() -> None:
    meta, _, _ = _sharded(8, [])
    layout = Layout(t=2, d=2)
    a = DP().distribute(meta, layout, None)
    assert a[0] == a[1] == ((0, 4),) and a[2] == a[3] == ((4, 8),)
    results = [RankResult(rank=r, worker=10 + r, key="o", num_rows=4, fields=meta.fields) for r in range(4)]
    out = DP().collect(results, layout, a)
    assert {s.worker for s in out.meta.groups[0].segments} == {10, 12}


def test_micro_dp_strided_generation_groups() -> None:
    # t=4, tg=2: generation TP groups {0,2} {1,3}; replicas 0 and 1 of the training replica.
    reps = MicroDP(tg=2).replicas(Layout(t=4, d=1))
    assert reps == [(0, True), (1, True), (0, False), (1, False)]
    with pytest.raises(ConfigError):
        MicroDP(tg=3).replicas(Layout(t=4))


def test_other_protocols() -> None:
    meta, _, _ = _sharded(6, [])
    layout = Layout(d=3)
    assert OneToAll().distribute(meta, layout, None) == [((0, 6),)] * 3
    assert RankZero().distribute(meta, layout, None) == [((0, 6),), None, None]
    assert AllToAll().distribute(meta, layout, None) == [((0, 2),), ((2, 4),), ((4, 6),)]
    vals = [RankResult(rank=r, worker=r, value={"loss": float(r), "n": 2}) for r in range(3)]
    assert Metrics(reduce={"n": "sum"}).collect(vals, layout, None) == {"loss": 1.0, "n": 6.0}
    assert OneToAll().collect(vals, layout, None) == [v.value for v in vals]
    with pytest.raises(SchemaError, match="not a number"):
        Metrics().collect([RankResult(rank=0, worker=0, value={"a": "x"})], Layout(), None)


def test_tensor_shards_give_each_tensor_rank_the_rows_of_its_shard() -> None:
    two, four, one, three = (_sharded(n, [])[0] for n in (2, 4, 1, 3))
    # t = 2 over d = 2 (ranks: dp-major, tp fastest): rank j of t takes row j of 2.
    assert TensorShards().distribute(two, Layout(t=2, d=2), None) == [((0, 1),), ((1, 2),)] * 2
    assert TensorShards().distribute(four, Layout(t=2), None) == [((0, 2),), ((2, 4),)]  # two rows each
    assert TensorShards().distribute(two, Layout(t=4), None) == [((0, 1),), ((0, 1),), ((1, 2),), ((1, 2),)]
    assert TensorShards().distribute(one, Layout(d=3), None) == [((0, 1),)] * 3
    with pytest.raises(ConfigError, match="3 shard rows cannot be split over tensor size 2"):
        TensorShards().distribute(three, Layout(t=2), None)
    vals = [RankResult(rank=r, worker=r, value=r) for r in range(2)]
    assert TensorShards().collect(vals, Layout(t=2), None) == [0, 1]


def test_collect_rejects_ranks_with_different_row_shapes() -> None:
    f1 = Batch({"x": torch.zeros(2, 3)}).field_specs()
    f2 = Batch({"x": torch.zeros(2, 4)}).field_specs()
    results = [RankResult(rank=0, worker=0, key="a", num_rows=2, fields=f1),
               RankResult(rank=1, worker=1, key="a", num_rows=2, fields=f2)]
    with pytest.raises(SchemaError, match="pad rows"):
        AllToAll().collect(results, Layout(d=2), None)


def test_store_counts_and_frees() -> None:
    s = ShardStore()
    s.put("a", Batch({"x": torch.zeros(10, 2)}))
    assert s.slice("a", 2, 5, None)["x"].shape == (3, 2)
    assert s.stats().bytes_served == 24
    assert s.free(["a", "missing"]) == 1
    assert s.stats().shards == 0


def test_batch_validation() -> None:
    with pytest.raises(SchemaError, match="rows"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(SchemaError, match=r"torch\.Tensor"):
        Batch({"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(MissingFieldError, match=r"'z'"):
        Batch({"a": torch.zeros(2)})["z"]


def test_take_picks_rows_in_order_and_keeps_groups() -> None:
    b = Batch({"x": torch.arange(6).view(6, 1), "y": torch.arange(6.0) * 2}, group_size=2)
    taken = b.take([4, 5, 0, 1])
    assert taken["x"].flatten().tolist() == [4, 5, 0, 1] and taken["y"].tolist() == [8.0, 10.0, 0.0, 2.0]
    assert taken.group_size == 2 and taken.num_rows == 4


def test_rename_is_metadata_only_and_pulls_stored_columns() -> None:
    meta, stores, full = _sharded(6, [3])
    renamed = meta.rename({"x": "baseline"})
    assert renamed.field_names == ("baseline", "i")
    plan = plan_pull(renamed, ((1, 5),), ["baseline"])
    assert plan.pieces[0].fields == ("x",)  # the shard still calls it x
    assert torch.equal(assemble(plan, _fetch(plan, stores))["baseline"], full[1:5])
    with pytest.raises(SchemaError, match="duplicate"):
        meta.rename({"x": "i"})
    merged = merge_meta([meta, renamed])  # both columns, from the same shards
    assert merged.field_names == ("x", "i", "baseline")


def test_group_size_travels_with_rows_and_splits_keep_groups() -> None:
    meta, _, _ = _sharded(12, [5])
    grouped = msgspec.structs.replace(meta, group_size=4)
    assert DP().distribute(grouped, Layout(d=2), None) == [((0, 8),), ((8, 12),)]
    assert plan_pull(grouped, ((4, 8),)).group_size == 4
    assert plan_pull(grouped, ((2, 6),)).group_size == 1
    with pytest.raises(SchemaError, match="whole groups"):
        Batch({"a": torch.zeros(5)}, group_size=2)
