"""The hybrid engine's transition from training to generation layout, measured.

    python -m bench.transition --json PATH [--ranks 4|8] [--size small] [--repeats 3] [--bucket-mb 64]

Real processes (4, or 8 with ``--ranks 8``) joined by a gloo group hold the
training shards of a Llama-shaped model of 142.6 M parameters in fp32 (built
here: each rank draws only its own shards, no download) and move them into the
generation layout with each method of :mod:`hybrid_engine`: ``allgather`` (every
rank gathers the whole model: the actor before the hybrid engine), ``vanilla``
(HybridFlow-V grouping) and ``hybridflow`` (micro-DP groups, training shards
reused in place). Layouts, named ``<p><t><d>-<pg><tg><dg><d>``: ``141-1221`` and
``122-1122`` on 4 ranks, ``181-1421`` and ``142-1222`` on 8.

One measurement: barrier, ``Resharder.to_generation()``, barrier; the slowest
rank's seconds, the most bytes one rank sent and the highest peak of parameter
and staging bytes on one rank; then ``to_training()``. Each repeat measures every
method, in alternating order, so that the machine's drift spreads over all of
them; seconds are the median over repeats. Every measurement's sent and resident
bytes are checked against ``hybrid_engine.expected_bytes`` (a mismatch warns; the
bench still writes its figures).

JSON keys: ``<method>_<layouts>_<s|bytes|peak_bytes|matches_formula>``,
``<method>_<layouts>_back_s`` (the reverse, ``to_training``: local, no communication),
``hybridflow_vs_<allgather|vanilla>_<layouts>`` (hybridflow's seconds over the
baseline's), ``model_bytes``, ``params``, ``bucket_bytes``, ``ranks``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from channels import Layout
from hybrid_engine import (
    METHODS,
    Method,
    ParamSpec,
    Resharder,
    expected_bytes,
    layout_from,
    make_plan,
)

LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (layout_from(4, 2), layout_from(2, 1, d=2)),
    8: (layout_from(8, 4), layout_from(4, 2, d=2)),
}
"""The benched layouts (``hybridflow`` grouping) by number of ranks."""

SIZES = {  # hidden, intermediate, layers, vocab
    "full": (1024, 2816, 6, 32000),
    "small": (64, 128, 2, 256),
    # bench.async_rl's weight-sync sizes (about 10 M, 100 M and 500 M parameters)
    "10m": (384, 1024, 4, 4000),
    "100m": (768, 2048, 10, 16000),
    "500m": (1536, 4096, 14, 32000),
}


def layouts_name(layout: Layout) -> str:
    """``<p><t><d>-<pg><tg><dg><d>``, as the JSON keys spell a layout."""
    g = layout.generation
    return f"{layout.p}{layout.t}{layout.d}-{g.pg}{g.tg}{layout.dg}{layout.d}"


def for_method(layout: Layout, method: Method) -> Layout:
    """``layout`` with the generation grouping ``method`` needs (``vanilla`` has its own)."""
    g = layout.generation
    return layout_from(layout.t, g.tg, p=layout.p, pg=g.pg, d=layout.d,
                       grouping="vanilla" if method == "vanilla" else "hybridflow")


def model_specs(size: str) -> list[ParamSpec]:
    """A Llama's parameters, split as Megatron splits them: embeddings, lm_head and
    q/k/v/gate/up along rows, o/down along columns, norms whole."""
    hidden, inter, layers, vocab = SIZES[size]
    f32 = torch.float32
    specs = [ParamSpec(name="model.embed_tokens.weight", shape=(vocab, hidden), dtype=f32, dim=0)]
    for i in range(layers):
        for name, shape, dim in [
            ("self_attn.q_proj.weight", (hidden, hidden), 0), ("self_attn.k_proj.weight", (hidden, hidden), 0),
            ("self_attn.v_proj.weight", (hidden, hidden), 0), ("self_attn.o_proj.weight", (hidden, hidden), 1),
            ("mlp.gate_proj.weight", (inter, hidden), 0), ("mlp.up_proj.weight", (inter, hidden), 0),
            ("mlp.down_proj.weight", (hidden, inter), 1),
            ("input_layernorm.weight", (hidden,), None), ("post_attention_layernorm.weight", (hidden,), None),
        ]:
            specs.append(ParamSpec(name=f"model.layers.{i}.{name}", shape=shape, dtype=f32, dim=dim))
    specs.append(ParamSpec(name="model.norm.weight", shape=(hidden,), dtype=f32, dim=None))
    specs.append(ParamSpec(name="lm_head.weight", shape=(vocab, hidden), dtype=f32, dim=0))
    return specs


def _shards(layout: Layout, rank: int, specs: list[ParamSpec]) -> dict[str, torch.Tensor]:
    """This rank's training shards, drawn here from a generator seeded by parameter
    and chunk: no rank ever builds a full tensor it does not hold."""
    tp = layout.coords(rank).tp
    out = {}
    for i, s in enumerate(specs):
        gen = torch.Generator().manual_seed(i * 1000 + (tp if s.dim is not None else 0))
        out[s.name] = torch.randn(s.chunk_shape(layout.t), generator=gen)
    return out


def _group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    group = dist.new_group(list(ranks), use_local_synchronization=True)
    assert group is not None
    return group


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What every rank runs (picklable: it crosses into the spawned processes)."""

    world: int
    size: str
    repeats: int
    bucket_bytes: int
    store: str
    """The file the ranks rendezvous through."""
    out: str
    """Where rank 0 writes the measurements (JSON)."""
    methods: tuple[Method, ...] = METHODS
    layouts: tuple[str, ...] | None = None
    """The layouts measured, by name (None: every one of ``LAYOUTS[world]``)."""


def _measure_one(resharder: Resharder, specs: list[ParamSpec], method: Method) -> list[float]:
    """One transition and its reverse: [seconds, sent bytes, peak bytes, 1 if a
    figure differs from the formulas, seconds of the reverse], each the maximum over
    ranks."""
    dist.barrier()
    start = time.perf_counter()
    resharder.to_generation()
    dist.barrier()
    seconds = time.perf_counter() - start
    stats = resharder.stats
    assert stats is not None
    back = time.perf_counter()
    resharder.to_training()
    dist.barrier()
    back_seconds = time.perf_counter() - back
    exp = expected_bytes(resharder.plan.layout, specs, method)
    differs = stats.sent_bytes != exp.sent or stats.resident_bytes != exp.resident
    # float64 holds every byte count here exactly (< 2**53).
    figures = torch.tensor([seconds, stats.sent_bytes, stats.peak_bytes, float(differs), back_seconds],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures.tolist()


def _rank_main(rank: int, job: _Job) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job.store}", rank=rank, world_size=job.world)
    specs = model_specs(job.size)
    rows = []
    for layout in _layouts(job.world, job.layouts):
        name, shards = layouts_name(layout), _shards(layout, rank, specs)
        # The three share the shards: hybridflow rebinds them in place and its
        # to_training gives them their own storage back before the next method runs.
        resharders = {m: Resharder(make_plan(for_method(layout, m), specs, method=m, bucket_bytes=job.bucket_bytes),
                                   rank, shards, _group) for m in job.methods}
        for r in resharders.values():
            r.connect()  # group creation is not part of a transition
        for repeat in range(job.repeats):
            for method in job.methods if repeat % 2 == 0 else job.methods[::-1]:
                seconds, sent, peak, differs, back = _measure_one(resharders[method], specs, method)
                rows.append({"layouts": name, "method": method, "s": seconds, "bytes": int(sent),
                             "peak_bytes": int(peak), "matches_formula": not differs, "back_s": back})
        del resharders, shards
    if rank == 0:
        Path(job.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _layouts(world: int, names: tuple[str, ...] | None) -> tuple[Layout, ...]:
    return tuple(layout for layout in LAYOUTS[world] if names is None or layouts_name(layout) in names)


def measure(*, world: int, size: str, repeats: int, bucket_bytes: int, methods: tuple[Method, ...] = METHODS,
            layouts: tuple[str, ...] | None = None) -> dict[str, float | int | bool]:
    """Run ``world`` ranks; the JSON record (keys in the module text), for
    ``methods`` and the ``layouts`` named (default: all)."""
    specs = model_specs(size)
    record: dict[str, float | int | bool] = {
        "model_bytes": sum(s.nbytes for s in specs), "params": sum(math.prod(s.shape) for s in specs),
        "bucket_bytes": bucket_bytes, "ranks": world}
    with tempfile.TemporaryDirectory() as tmp:
        job = _Job(world=world, size=size, repeats=repeats, bucket_bytes=bucket_bytes,
                   store=os.path.join(tmp, "store"), out=os.path.join(tmp, "rows.json"), methods=methods,
                   layouts=layouts)
        mp.start_processes(_rank_main, args=(job,), nprocs=world, start_method="spawn", join=True)
        rows = json.loads(Path(job.out).read_text())
    for layout in _layouts(world, layouts):
        name = layouts_name(layout)
        for method in methods:
            mine = [r for r in rows if r["layouts"] == name and r["method"] == method]
            key = f"{method}_{name}"
            record[f"{key}_s"] = statistics.median(r["s"] for r in mine)
            record[f"{key}_back_s"] = statistics.median(r["back_s"] for r in mine)
            record[f"{key}_bytes"] = max(r["bytes"] for r in mine)
            record[f"{key}_peak_bytes"] = max(r["peak_bytes"] for r in mine)
            record[f"{key}_matches_formula"] = all(r["matches_formula"] for r in mine)
        for base in ("allgather", "vanilla"):
            if "hybridflow" in methods and base in methods:
                record[f"hybridflow_vs_{base}_{name}"] = record[f"hybridflow_{name}_s"] / record[f"{base}_{name}_s"]
    return record


def table(record: dict[str, float | int | bool]) -> str:
    """The figures as a Markdown table: one row per layouts and method."""
    mb = 1 << 20
    lines = ["| layouts | method | seconds | back s | MB sent / rank | peak MB / rank | bytes = formula |",
             "|---|---|---:|---:|---:|---:|---|"]
    for layout in LAYOUTS[int(record["ranks"])]:
        name = layouts_name(layout)
        for method in METHODS:
            k = f"{method}_{name}"
            lines.append(f"| {name} | {method} | {record[k + '_s']:.3f} | {record[k + '_back_s']:.3f} | "
                         f"{record[k + '_bytes'] / mb:.1f} | "
                         f"{record[k + '_peak_bytes'] / mb:.1f} | {record[k + '_matches_formula']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", type=Path, help="write the figures here as flat JSON")
    parser.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=4, help="gloo processes")
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="full: 142.6 M parameters; small: a tiny model for the tests")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per method and layouts (median)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="most gathered MB of one bucket")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.bucket_mb <= 0:
        parser.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    record = measure(world=args.ranks, size=args.size, repeats=args.repeats,
                     bucket_bytes=int(args.bucket_mb * (1 << 20)))
    print(f"model: {record['params'] / 1e6:.1f} M parameters, {record['model_bytes'] / (1 << 20):.1f} MB fp32; "
          f"{args.ranks} ranks on {os.cpu_count()} CPU cores, gloo; bucket {args.bucket_mb:g} MB; "
          f"median of {args.repeats}")
    print(table(record))
    for layout in LAYOUTS[args.ranks]:
        name = layouts_name(layout)
        print(f"{name}: hybridflow / allgather time {record[f'hybridflow_vs_allgather_{name}']:.2f}, "
              f"hybridflow / vanilla {record[f'hybridflow_vs_vanilla_{name}']:.2f}")
    wrong = [k for k, v in record.items() if k.endswith("_matches_formula") and not v]
    if wrong:
        print(f"WARNING: measured bytes differ from hybrid_engine.expected_bytes: {', '.join(wrong)}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
