"""The hybrid engine's transition from training to generation layout, measured.

    python -m bench.transition --json PATH [--ranks 4|8] [--size small] [--repeats 3] [--bucket-mb 64]

Four (or eight) real processes joined by a gloo group hold the training shards of a Llama-
shaped model of at least 100 M parameters (built locally: each rank draws its own
shards) and move them into the generation layout with each method:
``allgather`` (every rank gathers the whole model: the actor before the hybrid
engine), ``vanilla`` (HybridFlow-V grouping) and ``hybridflow`` (micro-DP groups,
training shards reused in place). Layouts: ``141-1221`` (train p1-t4-d1, generate
pg1-tg2-dg2-d1) and ``122-1122`` (train p1-t2-d2, generate pg1-tg1-dg2-d2); with
8 ranks ``181-1421`` and ``142-1222``.

Per method and layouts: the transition's seconds (median over repeats of the
slowest rank), bytes sent per rank and peak parameter bytes per rank (max over
ranks), and whether the bytes equal the formulas (``hybrid_engine.expected_bytes``).
JSON keys ``<method>_<layouts>_<s|bytes|peak_bytes>``, ``..._matches_formula``,
``hybridflow_vs_<baseline>_<layouts>`` (time ratios), ``model_bytes``, ``params``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from channels import Layout
from hybrid_engine import METHODS, ParamSpec, Resharder, expected_bytes, layout_from, make_plan

LAYOUTS = {
    4: {"141-1221": layout_from(4, 2), "122-1122": layout_from(2, 1, d=2)},
    8: {"181-1421": layout_from(8, 4), "142-1222": layout_from(4, 2, d=2)},
}
"""The benched layouts by number of ranks."""
SIZES = {  # hidden, intermediate, layers, vocab
    "full": (1024, 2816, 6, 32000),
    "small": (64, 128, 2, 256),
}


def model_specs(size: str) -> list[ParamSpec]:
    """A Llama's parameters, split as Megatron splits them: embeddings, lm_head and
    q/k/v/gate/up along rows, o/down along columns, norms whole."""
    hidden, inter, layers, vocab = SIZES[size]
    f32 = torch.float32
    specs = [ParamSpec(name="model.embed_tokens.weight", shape=(vocab, hidden), dtype=f32, dim=0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape, dim in [
            ("self_attn.q_proj.weight", (hidden, hidden), 0), ("self_attn.k_proj.weight", (hidden, hidden), 0),
            ("self_attn.v_proj.weight", (hidden, hidden), 0), ("self_attn.o_proj.weight", (hidden, hidden), 1),
            ("mlp.gate_proj.weight", (inter, hidden), 0), ("mlp.up_proj.weight", (inter, hidden), 0),
            ("mlp.down_proj.weight", (hidden, inter), 1),
            ("input_layernorm.weight", (hidden,), None), ("post_attention_layernorm.weight", (hidden,), None),
        ]:
            specs.append(ParamSpec(name=p + name, shape=shape, dtype=f32, dim=dim))
    specs.append(ParamSpec(name="model.norm.weight", shape=(hidden,), dtype=f32, dim=None))
    specs.append(ParamSpec(name="lm_head.weight", shape=(vocab, hidden), dtype=f32, dim=0))
    return specs


def _shards(layout: Layout, rank: int, specs: list[ParamSpec]) -> dict[str, torch.Tensor]:
    """This rank's training shards, drawn here (no full tensor is ever built)."""
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


def _rank_main(rank: int, world: int, store: str, size: str, repeats: int, bucket: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    specs = model_specs(size)
    rows = []
    for name, layout in LAYOUTS[world].items():
        shards = _shards(layout, rank, specs)
        methods = [m for m in METHODS if m != "vanilla"]
        resharders: dict[str, Resharder] = {m: Resharder(make_plan(layout, specs, method=m, bucket_bytes=bucket), rank, shards, _group)
                      for m in methods}
        vanilla = layout_from(layout.t, layout.generation.tg, d=layout.d, grouping="vanilla")
        resharders["vanilla"] = Resharder(make_plan(vanilla, specs, method="vanilla", bucket_bytes=bucket),
                                          rank, shards, _group)
        for r in resharders.values():
            r.connect()
        for repeat in range(repeats):
            order = METHODS if repeat % 2 == 0 else tuple(reversed(METHODS))  # spread drift evenly
            for method in order:
                r = resharders[method]
                dist.barrier()
                start = time.perf_counter()
                r.to_generation()
                dist.barrier()
                wall = time.perf_counter() - start
                stats = r.stats
                assert stats is not None
                r.to_training()
                exp = expected_bytes(r.plan.layout, specs, method)
                rows.append({"layouts": name, "method": method, "repeat": repeat, "wall_s": wall,
                             "s": stats.seconds, "sent": stats.sent_bytes, "peak": stats.peak_bytes,
                             "matches": stats.sent_bytes == exp.sent and stats.resident_bytes == exp.resident})
        del resharders, shards
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure(world: int, size: str, repeats: int, bucket: int) -> dict[str, object]:
    """Run ``world`` ranks and reduce their rows to the JSON figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), size, repeats, bucket, out),
                           nprocs=world, start_method="spawn", join=True)
        per_rank = json.loads(Path(out).read_text())
    specs = model_specs(size)
    result: dict[str, object] = {"model_bytes": sum(s.nbytes for s in specs),
                                 "params": sum(s.nbytes for s in specs) // 4, "bucket_bytes": bucket,
                                 "ranks": world}
    for name in LAYOUTS[world]:
        for method in METHODS:
            mine = [[r for r in rows if r["layouts"] == name and r["method"] == method] for rows in per_rank]
            seconds = [max(rank[i]["wall_s"] for rank in mine) for i in range(repeats)]
            result[f"{method}_{name}_s"] = statistics.median(seconds)
            result[f"{method}_{name}_bytes"] = max(r["sent"] for rank in mine for r in rank)
            result[f"{method}_{name}_peak_bytes"] = max(r["peak"] for rank in mine for r in rank)
            result[f"{method}_{name}_matches_formula"] = all(r["matches"] for rank in mine for r in rank)
        for base in ("allgather", "vanilla"):
            ours, theirs = result[f"hybridflow_{name}_s"], result[f"{base}_{name}_s"]
            assert isinstance(ours, float) and isinstance(theirs, float)
            result[f"hybridflow_vs_{base}_{name}"] = ours / theirs
    return result


def table(result: dict[str, object]) -> str:
    """The figures as a Markdown table."""
    mb = 1 << 20
    lines = ["| layouts | method | seconds | MB sent / rank | peak MB / rank | bytes = formula |",
             "|---|---|---:|---:|---:|---|"]
    for name in LAYOUTS[int(result["ranks"])]:  # type: ignore[call-overload]
        for method in METHODS:
            k = f"{method}_{name}"
            lines.append(f"| {name} | {method} | {result[k + '_s']:.3f} | {result[k + '_bytes'] / mb:.1f} | "  # type: ignore[operator]
                         f"{result[k + '_peak_bytes'] / mb:.1f} | {result[k + '_matches_formula']} |")  # type: ignore[operator]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=4)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.size, args.repeats, int(args.bucket_mb * (1 << 20)))
    print(f"model: {result['params'] / 1e6:.1f} M parameters, {result['model_bytes'] / (1 << 20):.0f} MB; "  # type: ignore[operator]
          f"{args.ranks} ranks, gloo; bucket {args.bucket_mb:g} MB")
    print(table(result))
    for name in LAYOUTS[args.ranks]:
        print(f"{name}: hybridflow / allgather time {result[f'hybridflow_vs_allgather_{name}']:.2f}, "
              f"hybridflow / vanilla {result[f'hybridflow_vs_vanilla_{name}']:.2f}")
    if not all(v for k, v in result.items() if k.endswith("_matches_formula")):
        print("WARNING: some measured bytes differ from the formulas")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
