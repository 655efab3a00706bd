"""The main job with every built-in algorithm, on CUDA: one line per run.

Run as ``python -m bench.gpu_check [--json PATH]`` (``make gpu-check`` runs it after
the GPU-marked tests). It warm-starts the main job's policy once (its ``[sft]``
section, cached in ``<out>/sft_model-<hash>``), then trains it with GRPO, PPO, DAPO,
RLOO, ReMax and Safe-RLHF through Ray on the machine's GPUs, each for ``--steps``
steps in ``--precision`` (bf16 by default), batch and, where the algorithm streams
(GRPO, PPO, RLOO), streamed. Every run prints one line: its median step time
(the first step excluded: it warms up), generated tokens per second, the held-out
accuracy before and after, and the rollout/training log-prob mismatch.

``--device cpu`` runs the same on the CPU (for trying it, and for the test that
keeps this script working on machines without a GPU).

JSON: ``device``, ``precision``, ``steps`` and ``runs``: one record per run with
``algorithm``, ``stream``, ``s_per_step``, ``tokens_per_s``, ``accuracy_before``,
``accuracy_after``, ``logprob_mismatch`` (mean over the steps), ``error`` (None,
or what went wrong). The command exits 1 when a run failed or reported a
non-finite metric.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ALGORITHMS = ("grpo", "ppo", "dapo", "rloo", "remax", "safe_rlhf")
"""Every built-in algorithm."""
STREAMING = frozenset({"grpo", "ppo", "rloo"})
"""The algorithms whose steps stream (``train.stream``)."""
PER_ALGORITHM: dict[str, dict[str, object]] = {
    "remax": {"algorithm.sampling.n": 1},  # one sample per prompt, beside the greedy baseline
    "safe_rlhf": {"cost.function": "bench.gpu_check:long_answer_cost"},
}
"""What an algorithm needs beyond the main job's settings."""


def long_answer_cost(prompts: list[str], completions: list[str], **columns: object) -> list[float]:
    """Safe-RLHF's cost here: 1 for an answer longer than three characters (the
    task's sums have at most three digits), else 0."""
    return [1.0 if len(c.strip()) > 3 else 0.0 for c in completions]


def _overrides(args: argparse.Namespace, algorithm: str, stream: bool, model_dir: str, out: Path
               ) -> dict[str, object]:
    return {
        "output_dir": str(out), "sft": None, "model.path": model_dir,
        "algorithm.name": algorithm, **PER_ALGORITHM.get(algorithm, {}),
        "train.steps": args.steps, "train.stream": stream, "train.eval_every": 0,
        "train.eval_size": args.eval_size, "train.checkpoint_every": 0, "train.trace_steps": 0,
        "train.max_seconds": 0, "train.export_hf": "never",
        "actor.precision": args.precision, "critic.precision": args.precision,
        "pools.main.device": args.device,
    }


def run_one(args: argparse.Namespace, algorithm: str, stream: bool, model_dir: str) -> dict[str, Any]:
    """Train one algorithm; its record (see the module docstring)."""
    from asyncflow.train import Trainer, load_config, read_metrics

    out = Path(args.out) / f"{algorithm}-{'stream' if stream else 'batch'}"
    record: dict[str, Any] = {"algorithm": algorithm, "stream": stream, "error": None}
    try:
        config = load_config(args.config, _overrides(args, algorithm, stream, model_dir, out))
        result = asyncio.run(Trainer(config, say=lambda line: None, progress_bar=False).run())
    except Exception as e:  # one failed algorithm must not hide the others' results
        record["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        return record
    rows = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "time/step_s" in r]  # not step 0's evaluation
    timed = rows[1:] or rows  # the first step warms up (allocations, kernels)
    record |= {
        "steps": len(rows),
        "s_per_step": statistics.median(r["time/step_s"] for r in timed),
        "tokens_per_s": statistics.median(r["throughput/tokens_per_s"] for r in timed),
        "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after,
        "logprob_mismatch": statistics.fmean(r.get("actor/logprob_mismatch", math.nan) for r in rows),
    }
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    if not finite:
        record["error"] = "a metric was not finite"
    return record


def line(record: dict[str, Any]) -> str:
    """One human-readable line for a run."""
    head = f"{record['algorithm']:<10} {'stream' if record['stream'] else 'batch':<6}"
    if record["error"] is not None and "s_per_step" not in record:
        return f"{head} FAILED: {record['error']}"
    text = (f"{head} {record['steps']:>3} steps  {record['s_per_step']:.3f} s/step  "
            f"{record['tokens_per_s']:>8.0f} tokens/s  accuracy {record['accuracy_before']:.2f} -> "
            f"{record['accuracy_after']:.2f}  log-prob mismatch {record['logprob_mismatch']:.2e}")
    return text if record["error"] is None else f"{text}  FAILED: {record['error']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/arith_grpo.toml", help="the main job's config")
    parser.add_argument("--out", default="runs/gpu-check", help="where the runs write")
    parser.add_argument("--steps", type=int, default=15, help="RL steps per run")
    parser.add_argument("--eval-size", type=int, default=500, help="held-out problems evaluated")
    parser.add_argument("--precision", choices=("bf16", "fp32", "auto"), default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated names")
    parser.add_argument("--stream", choices=("both", "on", "off"), default="both")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_check: no CUDA device here; run it on a GPU machine (or pass --device cpu)",
              file=sys.stderr)
        return 2
    from asyncflow.train import Trainer, load_config

    started = time.monotonic()
    sft = load_config(args.config, {"output_dir": args.out, "pools.main.device": args.device})
    model_dir = Trainer(sft, say=lambda text: print(text, flush=True)).model_dir()
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.stream]
    records = []
    for algorithm in args.algorithms.split(","):
        for stream in modes:
            if stream and algorithm not in STREAMING:
                continue
            record = run_one(args, algorithm, stream, model_dir)
            print(line(record), flush=True)
            records.append(record)
    failed = [r for r in records if r["error"] is not None]
    print(f"{len(records) - len(failed)} of {len(records)} runs passed in {time.monotonic() - started:.0f} s "
          f"({args.device}, {args.precision})", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": args.device, "precision": args.precision, "steps": args.steps,
                                         "runs": records}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
