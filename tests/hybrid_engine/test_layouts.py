"""Property tests of the generation layouts and transition plans over every valid
(p, t, d, pg, tg): the rank arithmetic, the hybridflow grouping's containment, and
that each plan delivers every rank exactly its generation shard."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from channels import ConfigError, GenerationLayout, Layout, MicroDP
from hybrid_engine import ParamSpec, make_plan


@st.composite
def layouts(draw: st.DrawFn, grouping: str | None = None) -> Layout:
    p = draw(st.sampled_from([1, 2, 4]))
    t = draw(st.sampled_from([1, 2, 4, 8]))
    d = draw(st.integers(1, 3))
    pg = draw(st.sampled_from([q for q in (1, 2, 4) if p % q == 0]))
    tg = draw(st.sampled_from([q for q in (1, 2, 4, 8) if t % q == 0]))
    grouping = grouping or draw(st.sampled_from(["hybridflow", "vanilla"]))
    return Layout(p=p, t=t, d=d, gen=GenerationLayout(pg=pg, tg=tg, grouping=grouping))  # type: ignore[arg-type]


def _specs(layout: Layout, draw: Callable[[st.SearchStrategy[Any]], Any]) -> list[ParamSpec]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        dim = draw(st.sampled_from([0, 1, None]))
        rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        shape = (rows * (layout.t if dim == 0 else 1), cols * (layout.t if dim == 1 else 1))
        out.append(ParamSpec(name=f"w{i}", shape=shape, dtype=torch.float32, dim=dim,
                             stage=draw(st.integers(0, layout.p - 1))))
    return out


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_generation_groups_partition_the_ranks(layout: Layout) -> None:
    gen = layout.generation
    assert layout.dg == (layout.p * layout.t) // (gen.pg * gen.tg)
    for kind, size in (("tp", gen.tg), ("pp", gen.pg), ("micro_dp", layout.dg)):
        groups = layout.gen_groups(kind)  # type: ignore[arg-type]
        assert sorted(r for g in groups for r in g) == list(range(layout.world))
        assert all(len(g) == size for g in groups), (kind, groups)
    coords = [layout.gen_coords(r) for r in range(layout.world)]
    assert Counter(c.replica for c in coords) == {i: gen.pg * gen.tg for i in range(layout.d * layout.dg)}
    assert len({(c.replica, c.pp, c.tp) for c in coords}) == layout.world
    # A replica lies inside one training replica.
    for r in range(layout.world):
        assert coords[r].replica // layout.dg == layout.coords(r).dp
    # The transfer protocol sends each replica's rows to its members, one output rank
    # each (generation TP rank 0 of the last generation stage), the replicas numbered
    # as the grouping says, from the rank's own digits.
    replicas = MicroDP().replicas(layout)
    assert replicas == [_expected_replica(layout.p, layout.t, layout.d, gen.pg, gen.tg, gen.grouping, r)
                        for r in range(layout.world)]
    assert Counter(i for i, out in replicas if out) == {i: 1 for i in range(layout.d * layout.dg)}
    # MicroDP(tg=...) on a layout without its own gen: hybridflow, pg = 1.
    bare = Layout(p=layout.p, t=layout.t, d=layout.d)
    assert MicroDP(tg=gen.tg).replicas(bare) == [
        _expected_replica(layout.p, layout.t, layout.d, 1, gen.tg, "hybridflow", r) for r in range(layout.world)]
    # No gen and no tg: every rank is a replica of its own (whole weights) and outputs.
    pt = layout.p * layout.t
    assert MicroDP().replicas(bare) == [((r // layout.t % layout.d) * pt + r // (layout.t * layout.d) * layout.t
                                         + r % layout.t, True) for r in range(layout.world)]


def _expected_replica(p: int, t: int, d: int, pg: int, tg: int, grouping: str, rank: int) -> tuple[int, bool]:
    """Rank ``rank``'s micro-DP replica and whether it outputs, from the rank's digits
    (``rank = (pp * d + dp) * t + tp``) and the grouping's definition alone: hybridflow
    takes TP ranks (stages) at stride ``t/tg`` (``p/pg``), so a replica is one residue;
    vanilla takes consecutive ones, so a replica is one block."""
    pp, dp, tp = rank // (t * d), rank // t % d, rank % t
    ap, at = p // pg, t // tg
    if grouping == "hybridflow":
        gpp, gtp, micro = pp // ap, tp // at, (pp % ap) * at + tp % at
    else:
        gpp, gtp, micro = pp % pg, tp % tg, (pp // pg) * at + tp // tg
    return dp * ap * at + micro, gtp == 0 and gpp == pg - 1


@settings(max_examples=200, deadline=None)
@given(layouts(grouping="hybridflow"))
def test_hybridflow_generation_shards_contain_the_training_shards(layout: Layout) -> None:
    gen = layout.generation
    ap, at = layout.p // gen.pg, layout.t // gen.tg
    for r in range(layout.world):
        c, g = layout.coords(r), layout.gen_coords(r)
        assert g.pp * ap <= c.pp < (g.pp + 1) * ap
        assert g.tp * at <= c.tp < (g.tp + 1) * at
    # Micro-DP groups are consecutive tensor ranks; generation TP groups stride t/tg.
    for group in layout.gen_groups("tp"):
        tps = [layout.coords(r).tp for r in group]
        assert all(b - a == at for a, b in itertools.pairwise(tps)), group


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_plan_delivers_exactly_the_generation_shards(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    specs = _specs(layout, data.draw)
    methods = ["hybridflow", "allgather"] if layout.generation.grouping == "hybridflow" else ["vanilla"]
    for method in methods:
        plan = make_plan(layout, specs, method=method, bucket_bytes=data.draw(st.integers(400, 4096)))  # type: ignore[arg-type]
        # What each rank has after the plan: its own chunk plus every slab gathered
        # in a bucket it belongs to, as (param, chunk, row) triples.
        have: dict[int, set[tuple[str, int, int]]] = {}
        for r in range(layout.world):
            have[r] = set()
            for s in specs:
                own = plan.training_chunk(r, s)
                if own is not None:
                    rows = s.chunk_shape(layout.t)[0]
                    have[r] |= {(s.name, own, i) for i in range(rows)}
        for bucket in plan.buckets:
            assert bucket.nbytes <= plan.bucket_bytes
            assert set(bucket.slabs) <= set(bucket.group)
            sent = {(x.param, x.chunk, i) for slabs in bucket.slabs.values() for x in slabs for i in range(x.lo, x.hi)}
            for member, slabs in bucket.slabs.items():  # a member sends only what it holds
                mine = {(x.param, x.chunk, i) for x in slabs for i in range(x.lo, x.hi)}
                assert mine <= have_initial(plan, member, specs), (member, slabs)
            for member in bucket.group:
                have[member] |= sent
        for r in range(layout.world):
            need_all: set[tuple[str, int, int]] = set()
            for s in specs:
                rows = s.chunk_shape(layout.t)[0]
                need = {(s.name, c, i) for c in plan.generation_chunks(r, s) for i in range(rows)}
                assert need <= have[r], (str(layout), method, r, s)
                need_all |= need
            if method == "hybridflow":  # zero redundancy: nothing arrives that the rank neither had nor needs
                extra = have[r] - have_initial(plan, r, specs) - need_all
                assert not extra, (str(layout), method, r, sorted(extra))


def have_initial(plan, rank: int, specs: list[ParamSpec]) -> set[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    out = set()
    for s in specs:
        own = plan.training_chunk(rank, s)
        if own is not None:
            out |= {(s.name, own, i) for i in range(s.chunk_shape(plan.layout.t)[0])}
    return out


@pytest.mark.parametrize(("p", "t", "pg", "tg", "message"), [
    (1, 4, 1, 3, "generation tg=3 must divide the training tensor size t=4"),
    (2, 2, 4, 1, "generation pg=4 must divide the training pipeline size p=2"),
])
def test_impossible_generation_layouts_are_refused(p: int, t: int, pg: int, tg: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Layout(p=p, t=t, gen=GenerationLayout(pg=pg, tg=tg))


def test_a_method_must_match_the_grouping_and_buckets_hold_a_row() -> None:
    layout = Layout(t=2, gen=GenerationLayout(tg=1, grouping="vanilla"))
    spec = ParamSpec(name="w", shape=(4, 64), dtype=torch.float32, dim=0)
    with pytest.raises(ConfigError, match="needs the 'hybridflow' grouping"):
        make_plan(layout, [spec], method="hybridflow")
    with pytest.raises(ConfigError, match="cannot hold one row of 'w'"):
        make_plan(layout, [spec], method="vanilla", bucket_bytes=100)
    with pytest.raises(ConfigError, match="not divisible by the training tensor size t=2"):
        make_plan(layout, [ParamSpec(name="v", shape=(3,), dtype=torch.float32, dim=0)], method="vanilla")
