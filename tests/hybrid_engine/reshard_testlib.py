"""Rank code of the resharding tests: every case runs on one gloo world of real
processes (forked from a server that imported torch once)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import start_ranks
from torch import Tensor

from channels import Layout
from hybrid_engine import ParamSpec, Resharder, expected_bytes, make_plan
from workers.host._meshes import new_reconnectable_group


def specs_for(layout: Layout) -> list[ParamSpec]:
    """Split along rows and columns, whole, in several dtypes, spread over the stages."""
    shapes: list[tuple[tuple[int, ...], int | None, torch.dtype]] = [
        ((16, 8), 0, torch.float32), ((8, 24), 1, torch.float32), ((8,), None, torch.float32),
        ((32, 4), 0, torch.bfloat16), ((4, 4, 8), 2, torch.float32), ((12, 8), 1, torch.int64),
    ]
    out = []
    for i, (shape, dim, dtype) in enumerate(shapes * 2):
        out.append(ParamSpec(name=f"w{i}", shape=shape, dtype=dtype, dim=dim, stage=i % layout.p))
    return out


def full_tensors(specs: list[ParamSpec]) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for s in specs:
        x = torch.randn(s.shape, generator=gen) * 100
        out[s.name] = x.to(s.dtype)
    return out


def training_shards(layout: Layout, rank: int, specs: list[ParamSpec], full: dict[str, Tensor]) -> dict[str, Tensor]:
    c = layout.coords(rank)
    out = {}
    for s in specs:
        if s.stage != c.pp:
            continue
        x = full[s.name]
        out[s.name] = (x.chunk(layout.t, s.dim)[c.tp] if s.dim is not None else x).clone()
    return out


def local_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The members' group, made by its members only. ``dist.new_group`` names a group
    from this rank's count of groups made, which differs between ranks that took
    part in different layouts; the workers' reconnectable groups are named by their
    ranks (and made once)."""
    return new_reconnectable_group(ranks, timedelta(seconds=60))


def check_case(rank: int, layout: Layout, method: str, bucket_bytes: int) -> dict[str, int]:
    """One transition and its reverse on this rank; asserts what every rank must see."""
    specs = specs_for(layout)
    full = full_tensors(specs)
    training = training_shards(layout, rank, specs, full)
    before = {k: v.clone() for k, v in training.items()}
    plan = make_plan(layout, specs, method=method, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
    resharder = Resharder(plan, rank, training, local_group)
    generation = resharder.to_generation()
    t = layout.t
    for s in specs:
        chunks = plan.generation_chunks(rank, s)
        if not chunks:
            assert s.name not in generation, (layout, method, rank, s.name)
            continue
        want = full[s.name]
        if s.dim is not None:
            width = s.shape[s.dim] // t
            want = want.narrow(s.dim, chunks.start * width, len(chunks) * width)
        assert torch.equal(generation[s.name], want), (str(layout), method, rank, s.name)
        own = plan.training_chunk(rank, s)
        if method == "hybridflow" and own is not None:
            # Zero redundancy: the training shard lives inside the generation shard.
            g, x = generation[s.name], training[s.name]
            assert g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), (str(layout), rank, s.name)
    stats = resharder.stats
    assert stats is not None
    resharder.to_training()
    for k, v in training.items():
        assert torch.equal(v, before[k]) and v.is_contiguous(), (str(layout), method, rank, k)
        g = generation.get(k)
        if g is not None and g is not v:
            assert v.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    exp = expected_bytes(layout, specs, method)  # type: ignore[arg-type]
    return {"sent": stats.sent_bytes, "received": stats.received_bytes, "peak": stats.peak_bytes,
            "resident": stats.resident_bytes, "staging": stats.staging_bytes,
            "expected_sent": exp.sent, "expected_resident": exp.resident,
            "largest_shard": max((x.nbytes for x in before.values()), default=0)}


def _rank_main(rank: int, world: int, store: str, fn: Callable[[int, Path], None], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=world)
    try:
        fn(rank, Path(out))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[[int, Path], None], tmp: Path) -> Path:
    """Run the module-level ``fn(rank, out_dir)`` on ``world`` processes joined by gloo."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    start_ranks(_rank_main, (world, str(tmp), fn, str(out)), world)
    return out


def _follow(rank: int, case: tuple[Layout, str, int] | None) -> list[str] | None:
    """Take rank 0's case (None: the end), run it if this rank is in its layout, and
    gather every rank's error text; None at the end."""
    box: list[object] = [case]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    layout, method, bucket = box[0]  # type: ignore[misc]
    error = ""
    if rank < layout.world:
        try:
            check_case(rank, layout, method, bucket)
        except Exception as e:  # reported to rank 0, which fails the example
            error = f"rank {rank}: {type(e).__name__}: {e}"
    verdicts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, error)
    return [str(v) for v in verdicts if v]


def hypothesis_driver(rank: int, out: Path, examples: int) -> None:
    """Rank 0 draws layouts that fit the world with hypothesis and broadcasts each;
    the ranks of the layout run it (the others wait) and every rank's verdict comes
    back to rank 0, so a failure on any rank fails (and is shrunk by) hypothesis."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from channels import GenerationLayout

    if rank != 0:
        while _follow(rank, None) is not None:
            pass
        return
    world = dist.get_world_size()

    @st.composite
    def cases(draw: st.DrawFn) -> tuple[Layout, str, int]:
        p = draw(st.sampled_from([1, 2, 4]))
        t = draw(st.sampled_from([t for t in (1, 2, 4, 8) if p * t <= world]))
        d = draw(st.integers(1, world // (p * t)))
        pg = draw(st.sampled_from([q for q in (1, 2, 4) if p % q == 0]))
        tg = draw(st.sampled_from([q for q in (1, 2, 4, 8) if t % q == 0]))
        grouping = draw(st.sampled_from(["hybridflow", "vanilla"]))
        layout = Layout(p=p, t=t, d=d, gen=GenerationLayout(pg=pg, tg=tg, grouping=grouping))  # type: ignore[arg-type]
        method = "vanilla" if grouping == "vanilla" else draw(st.sampled_from(["hybridflow", "allgather"]))
        return layout, method, draw(st.sampled_from([1024, 1 << 20]))  # 1024: one row from 8 ranks

    @settings(max_examples=examples, deadline=None, database=None)
    @given(cases())
    def every_rank_agrees(case: tuple[Layout, str, int]) -> None:
        errors = _follow(0, case)
        assert not errors, errors

    try:
        every_rank_agrees()
        (out / "ok").write_text("ok")
    finally:
        _follow(0, None)
