"""End-to-end GRPO: asyncflow against TRL's ``GRPOTrainer`` on the same workload.

Run as ``python -m bench.e2e --json PATH``. The workload (``bench._e2e_job``): a
tiny random Llama, 16 prompts x 4 samples of exactly 32 tokens per step, KL to a
reference at 0.04, one optimizer step per batch, a rule reward. asyncflow runs it
with ``asyncflow.algos.grpo_step`` under each placement that fits two cores
(``bench._e2e_placements.PLACEMENTS``); when the optional ``compare`` extra (TRL)
is installed, TRL's ``GRPOTrainer`` runs it too. Every run is its own process
(``python -m bench._e2e_asyncflow`` / ``bench._e2e_trl``), the frameworks
alternating round by round, so both see the same machine. Per run: seconds per
step (the median of ``--steps`` after ``--warmup`` steps), generated tokens/s,
asyncflow's per-stage milliseconds (traced in three steps after the timed ones,
which run untraced) and where its start-up seconds went. The
workload's model is saved once, before the runs, and every run loads it from that
directory (``--model-dir``), as a user's script loads a checkpoint: no run's
start-up includes building it (and asyncflow's driver, which loads no model, then
imports no transformers).

``--device cuda`` runs the one-GPU workload (a random Qwen2.5-0.5B-shaped
Llama, 64 prompts x 8 samples x 256 tokens, bf16; ``bench._e2e_job``) with every
role on one GPU (placement ``one``) and TRL on the same GPU, without the floor.

Each round also runs the workload in plain PyTorch with no framework
(``bench._e2e_floor``: one process, and two processes splitting the prompts with
one gradient all-reduce): about the fastest the eager arithmetic runs on this
machine, which a framework's scheduling only adds to. ``--no-floor`` skips it.

``--threads N`` gives every process N torch threads (every side); without it
each keeps its own default. ``--load K`` runs K busy processes beside the runs
(a shared machine).

``--paired`` measures the ratio to the floor instead in runs where asyncflow and
both floors take their steps in turn (``bench._e2e_paired``: one run per
placement per round), so that a machine changing speed from one minute to the
next moves both sides alike; keys ``<placement>_vs_floor_paired`` (the median
over rounds of each run's median ratio of step times) and
``asyncflow_vs_floor_paired`` (the best placement's), with ``paired_runs``.

Top-level keys: ``asyncflow_tokens_per_s`` (best placement), ``trl_tokens_per_s``
and ``ratio`` (their quotient), ``<placement>_s_per_step``, ``trl_s_per_step``,
``best_placement``, ``<run>_first_step_s`` (every run, the floor's and TRL's too:
the median seconds from process start to the end of its first step) and
``asyncflow_first_step_s`` (the best placement's); with the floor, ``floor_s_per_step`` and
``floor_tokens_per_s`` (the faster of its two), ``floor_<ranks>_s_per_step``,
``asyncflow_vs_floor`` (asyncflow's tokens/s over the floor's) and, with TRL,
``floor_ratio`` (the floor's tokens/s over TRL's: about the highest ``ratio``
a framework could reach here in eager PyTorch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncflow.tracing import markdown_table
from bench._e2e_job import E2EJob
from bench._e2e_placements import PLACEMENTS

FLOOR_RANKS = (1, 2)
"""The floor's runs: one process with every core's threads, two splitting the prompts."""


def run_one(module: str, args: list[str]) -> dict[str, Any]:
    """Run ``python -m module args`` and return the JSON record on its last line."""
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def _burn() -> None:
    while True:
        pass


def measure(placements: list[str], *, rounds: int, steps: int, warmup: int, threads: int | None,
            trl: bool, load: int, floor: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Every placement (and TRL, and the floor) once per round, alternating, on one
    saved model; the record."""
    job = E2EJob.on(device)
    floors = {f"floor_{ranks}": ranks for ranks in FLOOR_RANKS} if floor else {}
    with job.model_dir(None) as saved:
        model = ["--model-dir", saved]
        runs = _alternate(placements, model=model, rounds=rounds, steps=steps, warmup=warmup, threads=threads,
                          trl=trl, load=load, floors=floors, device=device)
    record: dict[str, Any] = {"job": job.as_dict(), "device": device, "rounds": rounds, "steps": steps, "warmup": warmup,
                              "threads": threads, "load": load, "runs": runs}
    for name, got in runs.items():
        record[f"{name}_s_per_step"] = statistics.median(r["s_per_step"] for r in got)
        record[f"{name}_first_step_s"] = first_step_s(got)
    best = min(placements, key=lambda p: record[f"{p}_s_per_step"])
    record["best_placement"] = best
    record["asyncflow_tokens_per_s"] = job.tokens_per_step / record[f"{best}_s_per_step"]
    record["asyncflow_first_step_s"] = record[f"{best}_first_step_s"]
    if trl:
        record["trl_tokens_per_s"] = job.tokens_per_step / record["trl_s_per_step"]
        record["ratio"] = record["asyncflow_tokens_per_s"] / record["trl_tokens_per_s"]
    if floors:
        record["floor_s_per_step"] = min(record[f"{name}_s_per_step"] for name in floors)
        record["floor_tokens_per_s"] = job.tokens_per_step / record["floor_s_per_step"]
        record["asyncflow_vs_floor"] = record["asyncflow_tokens_per_s"] / record["floor_tokens_per_s"]
        if trl:
            record["floor_ratio"] = record["floor_tokens_per_s"] / record["trl_tokens_per_s"]
    record["load_avg"] = os.getloadavg()
    return record


def _alternate(placements: list[str], *, model: list[str], rounds: int, steps: int, warmup: int,
               threads: int | None, trl: bool, load: int, floors: dict[str, int],
               device: str) -> dict[str, list[dict[str, Any]]]:
    """Each run's records (``floors``: the floor's runs by name, their ranks), the runs
    alternating round by round (with ``load`` busy processes beside them)."""
    common = ["--steps", str(steps), "--warmup", str(warmup)] + (["--threads", str(threads)] if threads else [])
    common += model
    sides = ["--device", device]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in [*placements, *(["trl"] if trl else []), *floors]}
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(load)]
    for b in burners:
        b.start()
    try:
        for _ in range(rounds):
            for placement in placements:
                runs[placement].append(run_one("bench._e2e_asyncflow", ["--placement", placement, *common, *sides]))
            if trl:
                runs["trl"].append(run_one("bench._e2e_trl", [*common, *sides]))
            for name, ranks in floors.items():
                runs[name].append(run_one("bench._e2e_floor", ["--ranks", str(ranks), *common]))
    finally:
        for b in burners:
            b.terminate()
    return runs


def measure_paired(placements: list[str], *, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Each placement's paired run (``bench._e2e_paired``) once per round, on one saved model; the record."""
    job = E2EJob.on("cpu")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in placements}
    with job.model_dir(None) as saved:
        for _ in range(rounds):
            for placement in placements:
                runs[placement].append(run_one("bench._e2e_paired", [
                    "--placement", placement, "--steps", str(steps), "--warmup", str(warmup), "--model-dir", saved]))
    record: dict[str, Any] = {"job": job.as_dict(), "device": "cpu", "rounds": rounds, "steps": steps,
                              "warmup": warmup, "paired_runs": runs}
    for placement, got in runs.items():
        record[f"{placement}_vs_floor_paired"] = statistics.median(r["asyncflow_vs_floor"] for r in got)
    best = max(placements, key=lambda p: record[f"{p}_vs_floor_paired"])
    record["best_placement"] = best
    record["asyncflow_vs_floor_paired"] = record[f"{best}_vs_floor_paired"]
    record["load_avg"] = os.getloadavg()
    return record


def paired_table(record: dict[str, Any]) -> str:
    """Each paired run's medians and ratio."""
    rows = [{"placement": p, "round": i + 1, "asyncflow s/step": r["asyncflow_s_per_step"],
             "floor_1 s/step": r["floor_1_s_per_step"], "floor_2 s/step": r["floor_2_s_per_step"],
             "asyncflow / best floor (paired)": r["asyncflow_vs_floor"]}
            for p, got in record["paired_runs"].items() for i, r in enumerate(got)]
    return markdown_table(rows, list(rows[0]))


def first_step_s(runs: list[dict[str, Any]]) -> float:
    """The median over ``runs`` of the seconds from process start to the end of the first step."""
    return statistics.median(r["startup_s"]["first_step_done"] for r in runs)


def table(record: dict[str, Any]) -> str:
    """Seconds per step (the rounds' median, and each round's: the machine's spells
    show as one slow round), tokens/s and asyncflow's per-stage breakdown."""
    stages_key = "stages (ms/step summed over ranks, run 1)"
    rows = []
    for name, got in record["runs"].items():
        s = record[f"{name}_s_per_step"]
        stages = got[0].get("stage_ms", {})
        rows.append({"run": name, "s/step": s, "rounds' s/step": ", ".join(f"{r['s_per_step']:.3f}" for r in got),
                     "tokens/s": record["job"]["tokens_per_step"] / s, "first step at s": first_step_s(got),
                     stages_key: ", ".join(f"{k} {v:.0f}" for k, v in stages.items())})
    return markdown_table(rows, ["run", "s/step", "rounds' s/step", "tokens/s", "first step at s", stages_key])


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.e2e``."""
    parser = argparse.ArgumentParser(prog="bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--placement", action="append", choices=sorted(PLACEMENTS),
                        help="repeatable; default: every placement")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating (the median is kept)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process, every side")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when it is installed")
    parser.add_argument("--no-floor", action="store_true", help="skip the plain-PyTorch floor")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the one-GPU workload, placement 'one', no floor")
    parser.add_argument("--paired", action="store_true",
                        help="the ratio to the floor from runs where both sides step in turn (CPU)")
    args = parser.parse_args(argv)
    if args.paired:
        if args.device != "cpu" or args.no_floor or args.threads or args.load:
            parser.error("--paired runs the CPU workload against the floor, with default threads and no load")
        record = measure_paired(args.placement or list(PLACEMENTS), rounds=args.rounds, steps=args.steps,
                                warmup=args.warmup)
        print(paired_table(record))
        print(f"\nasyncflow / plain-PyTorch floor, paired ({record['best_placement']}): "
              f"{record['asyncflow_vs_floor_paired']:.2f}x")
        _write(args.json, record)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU")
        args.placement, args.no_floor = ["one"], True
    trl = not args.no_trl and importlib.util.find_spec("trl") is not None
    if not trl and not args.no_trl:
        print("TRL is not installed (pip install -e '.[compare]'): asyncflow only", file=sys.stderr)
    record = measure(args.placement or list(PLACEMENTS), rounds=args.rounds, steps=args.steps,
                     warmup=args.warmup, threads=args.threads, trl=trl, load=args.load, floor=not args.no_floor,
                     device=args.device)
    print(table(record))
    if trl:
        print(f"\nasyncflow ({record['best_placement']}) / TRL tokens/s: {record['ratio']:.2f}x")
    if "floor_tokens_per_s" in record:
        print(f"asyncflow / plain-PyTorch floor tokens/s: {record['asyncflow_vs_floor']:.2f}x")
    if "floor_ratio" in record:
        print(f"floor / TRL tokens/s (about the most a framework could reach here): {record['floor_ratio']:.2f}x")
    _write(args.json, record)


def _write(path: Path | None, record: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
