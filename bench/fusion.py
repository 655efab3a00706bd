"""RLHFuse's fused actor+critic training schedules, simulated on the settings of its
Table 3.

    python -m bench.fusion --json PATH [--iterations 4000] [--settings 12]

For each setting (two LLaMA sizes, their pipeline sizes, the larger model's
micro-batch count), the models are described as :class:`PipelineModel`\\ s: per
stage, a forward costs the model's parameters over its stage count (backward: twice
that) and a micro-batch's held activations are its layers per stage times its hidden
size. A model with fewer stages runs ``PP0 / PP1`` pipelines side by side (RLHFuse's
fusion factor) with that many times fewer micro-batches each. The bench simulates
serial 1F1B (each model's 1F1B, one after the other), the greedy and the annealed
fused schedules, and computes the lower bound; each figure is a ratio to serial
1F1B, next to the paper's.

JSON keys: ``settings`` (one record per setting: ``greedy_vs_serial``,
``annealed_vs_serial``, ``bound_vs_serial`` (time over serial 1F1B's),
``greedy_memory``, ``annealed_memory`` (peak held activations over serial 1F1B's),
the paper's ``paper_speedup_*`` and ``paper_memory_*``, and the search's seconds),
and their means over the settings: ``greedy_vs_serial``, ``annealed_vs_serial``,
``bound_vs_serial``. The measured part of the issue (serial and fused training of a
real actor and critic on gloo ranks) is planned: it needs the pipelined training
engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from workers.engines.pipeline import (
    PipelineModel,
    fused_annealed,
    fused_greedy,
    fusion_lower_bound,
    serial_cost,
    simulate,
)

SIZES: dict[str, tuple[float, int, int]] = {
    "13B": (13.0, 40, 5120),
    "33B": (32.5, 60, 6656),
    "65B": (65.2, 80, 8192),
}
"""LLaMA sizes: billions of parameters, layers, hidden size."""

TABLE_3: list[tuple[str, str, int, int, int, tuple[float, float, float], tuple[float, float]]] = [
    ("33B", "13B", 8, 4, 8, (1.29, 1.38, 1.38), (1.51, 1.0)),
    ("33B", "13B", 8, 4, 16, (1.12, 1.30, 1.30), (2.14, 1.0)),
    ("33B", "13B", 8, 4, 32, (1.10, 1.15, 1.15), (2.75, 1.26)),
    ("33B", "13B", 8, 8, 8, (1.4, 1.4, 1.4), (1.51, 1.0)),
    ("33B", "13B", 8, 8, 16, (1.15, 1.32, 1.32), (2.00, 1.19)),
    ("33B", "13B", 8, 8, 32, (1.08, 1.17, 1.17), (2.75, 1.31)),
    ("65B", "33B", 16, 8, 16, (1.28, 1.48, 1.48), (1.61, 1.0)),
    ("65B", "33B", 16, 8, 32, (1.14, 1.27, 1.27), (2.23, 1.0)),
    ("65B", "33B", 16, 8, 64, (1.12, 1.15, 1.15), (2.88, 1.26)),
    ("65B", "33B", 16, 16, 16, (1.27, 1.5, 1.5), (1.57, 1.0)),
    ("65B", "33B", 16, 16, 32, (1.16, 1.33, 1.33), (2.00, 1.22)),
    ("65B", "33B", 16, 16, 64, (1.09, 1.16, 1.17), (2.88, 1.47)),
]
"""RLHFuse's Table 3: models, PP0, PP1, micro-batches, its speedups over serial 1F1B
(greedy, annealed, bound) and its peak activation memory over serial 1F1B's
(greedy, annealed)."""


def models_of(first: str, second: str, pp0: int, pp1: int, micro_batches: int) -> list[PipelineModel]:
    """The two models of one setting; the second's pipelines run the other way."""
    out = []
    for name, stages, reverse in ((first, pp0, False), (second, pp1, True)):
        params, layers, hidden = SIZES[name]
        pipelines = pp0 // stages
        out.append(PipelineModel(name=name, stages=stages, pipelines=pipelines,
                                 micro_batches=micro_batches // pipelines, forward_s=params / stages,
                                 backward_s=2 * params / stages, activation=layers / stages * hidden / 1e3,
                                 reverse=reverse))
    return out


def measure(setting: tuple[Any, ...], *, iterations: int) -> dict[str, Any]:
    """One setting's record."""
    first, second, pp0, pp1, micro_batches, paper_speedup, paper_memory = setting
    models = models_of(first, second, pp0, pp1, micro_batches)
    serial = serial_cost(models)
    greedy = simulate(fused_greedy(models))
    start = time.perf_counter()
    annealed = simulate(fused_annealed(models, iterations=iterations))
    search_s = time.perf_counter() - start
    return {
        "models": f"{first}/{second}", "pp0": pp0, "pp1": pp1, "micro_batches": micro_batches,
        "greedy_vs_serial": greedy.finish_s / serial.finish_s,
        "annealed_vs_serial": annealed.finish_s / serial.finish_s,
        "bound_vs_serial": fusion_lower_bound(models) / serial.finish_s,
        "greedy_memory": greedy.peak / serial.peak, "annealed_memory": annealed.peak / serial.peak,
        "paper_speedup_greedy": paper_speedup[0], "paper_speedup_annealed": paper_speedup[1],
        "paper_speedup_bound": paper_speedup[2],
        "paper_memory_greedy": paper_memory[0], "paper_memory_annealed": paper_memory[1],
        "search_s": search_s,
    }


def main(argv: list[str] | None = None) -> None:
    """Simulate the settings; print a table, write the record."""
    parser = argparse.ArgumentParser(prog="bench.fusion", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--iterations", type=int, default=4000, help="annealing moves per phase")
    parser.add_argument("--settings", type=int, default=len(TABLE_3), help="the first N settings of Table 3")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'setting':<22} {'speedup over serial 1F1B: greedy / annealed / bound':<52} memory: greedy / annealed")
    for setting in TABLE_3[: args.settings]:
        row = measure(setting, iterations=args.iterations)
        rows.append(row)
        name = f"{row['models']} {row['pp0']}/{row['pp1']} x{row['micro_batches']}"
        speed = (f"{1 / row['greedy_vs_serial']:.2f} / {1 / row['annealed_vs_serial']:.2f} / "
                 f"{1 / row['bound_vs_serial']:.2f} (paper {row['paper_speedup_greedy']:.2f} / "
                 f"{row['paper_speedup_annealed']:.2f} / {row['paper_speedup_bound']:.2f})")
        memory = (f"{row['greedy_memory']:.2f} / {row['annealed_memory']:.2f} (paper "
                  f"{row['paper_memory_greedy']:.2f} / {row['paper_memory_annealed']:.2f})")
        print(f"{name:<22} {speed:<52} {memory}", flush=True)
    record: dict[str, Any] = {"settings": rows, "iterations": args.iterations}
    for key in ("greedy_vs_serial", "annealed_vs_serial", "bound_vs_serial"):
        record[key] = statistics.mean(r[key] for r in rows)
    print(f"mean time over serial 1F1B: greedy {record['greedy_vs_serial']:.3f}, annealed "
          f"{record['annealed_vs_serial']:.3f}, bound {record['bound_vs_serial']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
