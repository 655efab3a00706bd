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

Then, measured (``--ranks R``, default 4; 0 skips it): a real actor (a random
Llama, ``--layers`` layers) and a critic of half its width, each split into ``R``
pipeline stages over ``R`` gloo processes (the critic's pipeline reversed), update
on one batch either one after the other (two 1F1B ``train_step``\ s) or in one fused
schedule (:func:`workers.engines.fused_train_steps`); each repeat times both, in
alternating order, and the medians are kept. The ranks share the machine's cores:
on fewer cores than ranks an idle stage frees a core for a busy one, so a bubble
costs less than on devices of their own, and fusion gains less than it would there.

JSON keys: ``settings`` (one record per setting: ``greedy_vs_serial``,
``annealed_vs_serial``, ``bound_vs_serial`` (time over serial 1F1B's),
``greedy_memory``, ``annealed_memory`` (peak held activations over serial 1F1B's),
``budgeted_vs_serial``, ``budgeted_memory`` (the annealed schedule searched under
the paper's annealed peak as RLHFuse's per-stage memory capacity; None when no
start fits it),
the paper's ``paper_speedup_*`` and ``paper_memory_*``, and the search's seconds),
and their means over the settings: ``greedy_vs_serial``, ``annealed_vs_serial``,
``bound_vs_serial``; measured: ``serial_s``, ``fused_s`` (median seconds of the two
updates), ``measured_fused_vs_serial`` (their ratio), ``ranks``, ``layers``,
``micro_batches``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from workers.engines.pipeline import (
    PipelineModel,
    ScheduleError,
    Simulation,
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
    # RLHFuse searches under a per-stage memory capacity: the paper's own peak here.
    budget = paper_memory[1] * serial.peak
    try:
        budgeted: Simulation | None = simulate(fused_annealed(models, iterations=iterations, memory_limit=budget))
    except ScheduleError:
        budgeted = None
    return {
        "models": f"{first}/{second}", "pp0": pp0, "pp1": pp1, "micro_batches": micro_batches,
        "greedy_vs_serial": greedy.finish_s / serial.finish_s,
        "annealed_vs_serial": annealed.finish_s / serial.finish_s,
        "bound_vs_serial": fusion_lower_bound(models) / serial.finish_s,
        "greedy_memory": greedy.peak / serial.peak, "annealed_memory": annealed.peak / serial.peak,
        "budgeted_vs_serial": None if budgeted is None else budgeted.finish_s / serial.finish_s,
        "budgeted_memory": None if budgeted is None else budgeted.peak / serial.peak,
        "paper_speedup_greedy": paper_speedup[0], "paper_speedup_annealed": paper_speedup[1],
        "paper_speedup_bound": paper_speedup[2],
        "paper_memory_greedy": paper_memory[0], "paper_memory_annealed": paper_memory[1],
        "search_s": search_s,
    }


def _measure_rank(rank: int, world: int, store: str, layers: int, repeats: int, out: Any) -> None:
    """One rank of the measured part; rank 0 puts the record on ``out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workers.engines import (
        MESH_DIM_NAMES,
        TrainingConfig,
        TrainingEngine,
        ValueHead,
        fused_train_steps,
    )
    from workers.models import TinyModelConfig, ValueModel, build_tiny_model
    from workers.objectives import PolicyLoss, ValueLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=MESH_DIM_NAMES)
    shape = TinyModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=64, vocab_size=512)
    small = dataclasses.replace(shape, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                num_key_value_heads=2)  # the critic: half as wide
    config = TrainingConfig(lr=1e-5, micro_batch_size=4)
    actor = TrainingEngine(build_tiny_model(shape), config=config, mesh=mesh, loss=PolicyLoss())
    critic = TrainingEngine(ValueModel.from_causal_lm(build_tiny_model(small)),
                            config=TrainingConfig(lr=1e-5, micro_batch_size=4, pipeline_reversed=True),
                            mesh=mesh, head=ValueHead(), loss=ValueLoss())
    rows, prompt, response = 32, 16, 48
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(1, 512, (rows, prompt), generator=g),
             "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
             "response_ids": torch.randint(1, 512, (rows, response), generator=g),
             "response_mask": torch.ones(rows, response, dtype=torch.long),
             "old_logprobs": -torch.rand(rows, response, generator=g) - 2,
             "advantages": torch.randn(rows, response, generator=g),
             "old_values": torch.randn(rows, response, generator=g),
             "returns": torch.randn(rows, response, generator=g)}

    def serial() -> None:
        actor.train_step(batch)
        critic.train_step(batch)

    def fused() -> None:
        fused_train_steps(actor, batch, critic, batch)

    times: dict[str, list[float]] = {"serial": [], "fused": []}
    serial()
    fused()  # warm: the fused schedule is searched once per shape
    for k in range(repeats):
        for name, run in (("serial", serial), ("fused", fused)) if k % 2 == 0 else (("fused", fused),
                                                                                   ("serial", serial)):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    if rank == 0:
        out.put({"serial_s": statistics.median(times["serial"]), "fused_s": statistics.median(times["fused"]),
                 "ranks": world, "layers": layers, "micro_batches": rows // 4,
                 "serial_runs_s": times["serial"], "fused_runs_s": times["fused"]})


def measure_real(*, ranks: int, layers: int, repeats: int) -> dict[str, Any]:
    """The measured part: serial and fused updates of a real actor and critic."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-fusion-") as tmp:
        procs = [ctx.Process(target=_measure_rank, args=(r, ranks, f"{tmp}/store", layers, repeats, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=1200)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a measuring rank failed: exit codes {[p.exitcode for p in procs]}")
        record: dict[str, Any] = out.get(timeout=10)
    record["measured_fused_vs_serial"] = record["fused_s"] / record["serial_s"]
    return record


def main(argv: list[str] | None = None) -> None:
    """Simulate the settings; print a table, write the record."""
    parser = argparse.ArgumentParser(prog="bench.fusion", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--iterations", type=int, default=4000, help="annealing moves per phase")
    parser.add_argument("--settings", type=int, default=len(TABLE_3), help="the first N settings of Table 3")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks of the measured part; 0 skips it")
    parser.add_argument("--layers", type=int, default=8, help="the measured models' decoder layers")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each measured update")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'setting':<22} {'speedup over serial 1F1B: greedy / annealed / bound':<52} "
          f"{'memory: greedy / annealed':<38} annealed within the paper's memory")
    for setting in TABLE_3[: args.settings]:
        row = measure(setting, iterations=args.iterations)
        rows.append(row)
        name = f"{row['models']} {row['pp0']}/{row['pp1']} x{row['micro_batches']}"
        speed = (f"{1 / row['greedy_vs_serial']:.2f} / {1 / row['annealed_vs_serial']:.2f} / "
                 f"{1 / row['bound_vs_serial']:.2f} (paper {row['paper_speedup_greedy']:.2f} / "
                 f"{row['paper_speedup_annealed']:.2f} / {row['paper_speedup_bound']:.2f})")
        memory = (f"{row['greedy_memory']:.2f} / {row['annealed_memory']:.2f} (paper "
                  f"{row['paper_memory_greedy']:.2f} / {row['paper_memory_annealed']:.2f})")
        budgeted = ("none found" if row["budgeted_vs_serial"] is None else
                    f"{1 / row['budgeted_vs_serial']:.2f} at {row['budgeted_memory']:.2f}")
        print(f"{name:<22} {speed:<52} {memory:<38} {budgeted}", flush=True)
    record: dict[str, Any] = {"settings": rows, "iterations": args.iterations}
    for key in ("greedy_vs_serial", "annealed_vs_serial", "bound_vs_serial"):
        record[key] = statistics.mean(r[key] for r in rows)
    print(f"mean time over serial 1F1B: greedy {record['greedy_vs_serial']:.3f}, annealed "
          f"{record['annealed_vs_serial']:.3f}, bound {record['bound_vs_serial']:.3f}")
    if args.ranks:
        record |= measure_real(ranks=args.ranks, layers=args.layers, repeats=args.repeats)
        print(f"measured on {args.ranks} gloo ranks: serial {record['serial_s']:.3f} s, fused "
              f"{record['fused_s']:.3f} s per actor+critic update (fused / serial "
              f"{record['measured_fused_vs_serial']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
