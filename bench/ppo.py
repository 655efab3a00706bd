"""Overlapped PPO: placement alone decides what overlaps.

Run as ``python -m bench.ppo --json PATH``;
the Markdown table goes to stdout, a timeline PNG and a Perfetto trace per run
next to the JSON (``--out`` to put them elsewhere).

The workload (``bench._ppo_job``): PPO with an actor, a reference, a critic and a
reward model, synthetic prompts and fixed response budgets, so every run does the
same work. Placements on two devices (``bench._ppo_job.PLACEMENTS``):

- ``colocate``: one 2-rank pool hosts all four roles (every call uses both ranks);
- ``split``: actor+ref on one 1-rank pool, critic+reward on another;
- ``standalone``: four 1-rank pools (four processes share the two cores).

Each placement runs the same loop (``asyncflow.algos.ppo_step``) three ways, in
rounds: every round gives each placement a fresh session running each mode once,
placements one after the other, so machine drift weighs on all alike:

- ``sequential``: one call at a time (``session.serial``): every call awaited
  before the next;
- ``overlapped``: the plain async loop: calls on different pools overlap;
- ``stream``: the loop with ``stream=``: reference, critic and reward take the
  responses micro-batch by micro-batch as they finish.

Every run is traced. Per run: seconds per step, generated tokens/s, busy seconds
per pool and per stage, each pool's idle fraction, and the critical-path bound:
max(the longest dependency chain of the measured call times, the busiest pool's
busy time, and per step the busiest rank counted from the earliest its inputs
let it start) (``asyncflow.tracing.summarise``); ``chain_or_busiest_s`` keeps the
first two only. ``--plan`` also profiles the
workload and records the planner's predictions (``asyncflow.plan``) beside the
measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import asyncflow as af
from asyncflow.tracing import (
    Trace,
    markdown_table,
    summarise,
    write_chrome_trace,
    write_timeline_png,
)
from bench._ppo_job import PLACEMENTS, Models, PPOJob, Runner

MODES = ("sequential", "overlapped", "stream")


async def _run(runner: Runner, mode: str, steps: int) -> tuple[float, Trace]:
    session = runner.session
    session.serial = mode == "sequential"
    await session.start_trace()
    try:
        wall = await runner.steps(steps, stream=mode == "stream")
    finally:
        trace = session.stop_trace()
        session.serial = False
    return wall, trace


def describe(job: PPOJob, placement: str, mode: str, wall: float, trace: Trace, steps: int) -> dict[str, Any]:
    """One run's figures (per step)."""
    s = summarise(trace)
    return {
        "placement": placement, "mode": mode, "steps": steps,
        "s_per_step": wall / steps,
        "tokens_per_s": job.tokens_per_step() * steps / wall,
        "critical_path_s": s.bound_s / steps,
        "chain_s": s.chain_s / steps,
        "load_bound_s": s.load_bound_s / steps,
        "chain_or_busiest_s": max(s.chain_s, max(s.busy_s.values(), default=0.0)) / steps,
        "over_bound": wall / s.bound_s if s.bound_s else None,
        "busy_s": {p: b / steps for p, b in s.busy_s.items()},
        "stage_busy_s": {k: b / steps for k, b in sorted(s.stage_busy_s.items())},
        "idle_fraction": s.idle_fraction,
        "calls_per_step": s.calls / steps,
        "critical_path": s.critical_path[-12:],
    }


async def _round(job: PPOJob, models: Models, placement: str, steps: int) -> dict[str, tuple[float, Trace]]:
    """One session on ``placement``: warm-up steps, then each mode once."""
    async with af.Session() as session:
        runner = await Runner.start(job, models, PLACEMENTS[placement], session)
        await runner.steps(1)  # warm-up: first calls load kernels and allocate
        await runner.steps(1, stream=True)
        got = {mode: await _run(runner, mode, steps) for mode in MODES}
    af.shutdown_ray()
    return got


async def measure(job: PPOJob, placements: list[str], *, steps: int, repeats: int,
                  out: Path | None) -> dict[str, dict[str, Any]]:
    """Every placement and mode, ``repeats`` rounds; the median repeat of each.

    Each round runs every placement in turn, each in a fresh session, so a drift of
    the machine's speed (other tenants, clock) weighs on every placement alike
    rather than on whichever ran during it."""
    runs: dict[str, dict[str, list[tuple[float, Trace]]]] = {p: {m: [] for m in MODES} for p in placements}
    with Models(job) as models:
        for _ in range(repeats):
            for placement in placements:
                for mode, timed in (await _round(job, models, placement, steps)).items():
                    runs[placement][mode].append(timed)
    found: dict[str, dict[str, Any]] = {}
    for placement, by_mode in runs.items():
        found[placement] = {}
        for mode, got in by_mode.items():
            wall, median = sorted(got, key=lambda r: r[0])[len(got) // 2]
            f = found[placement][mode] = describe(job, placement, mode, wall, median, steps)
            f["repeats_s"] = [w / steps for w, _ in got]
            if out is not None:
                title = f"PPO, {placement} ({PLACEMENTS[placement].describe()}), {mode}"
                f["timeline"] = str(write_timeline_png(median, out / f"ppo_{placement}_{mode}.png", title=title))
                f["trace"] = str(write_chrome_trace(median, out / f"ppo_{placement}_{mode}.json"))
    return found


async def run(job: PPOJob, placements: list[str], *, steps: int, repeats: int, out: Path | None,
              plan: bool) -> dict[str, Any]:
    """The whole record: top-level keys ``<placement>_<figure>`` plus every run."""
    record: dict[str, Any] = {"job": {"prompts": job.prompts, "median_len": job.median_len,
                                      "max_len": job.max_len, "micro_batch": job.micro_batch,
                                      "tokens_per_step": job.tokens_per_step()},
                              "steps": steps, "repeats": repeats, "runs": {}}
    measured = await measure(job, placements, steps=steps, repeats=repeats, out=out)
    for placement, found in measured.items():
        record["runs"][placement] = found
        seq, ovl, st = (found[m]["s_per_step"] for m in MODES)
        record.update({
            f"{placement}_sequential_s": seq, f"{placement}_overlapped_s": ovl, f"{placement}_stream_s": st,
            f"{placement}_critical_path_s": found["overlapped"]["critical_path_s"],
            f"{placement}_chain_or_busiest_s": found["overlapped"]["chain_or_busiest_s"],
            f"{placement}_stream_critical_path_s": found["stream"]["critical_path_s"],
            f"{placement}_overlapped_over_bound": found["overlapped"]["over_bound"],
            f"{placement}_stream_over_bound": found["stream"]["over_bound"],
            f"{placement}_overlap_speedup": seq / ovl, f"{placement}_stream_speedup": seq / st,
            f"{placement}_tokens_per_s": found["overlapped"]["tokens_per_s"],
        })
    if plan:
        from bench._ppo_plan import predictions

        record.update(await predictions(job, placements, measured=record))
    record["load_avg"] = os.getloadavg()
    return record


def table(record: dict[str, Any]) -> str:
    """The runs as a Markdown table."""
    rows = []
    for placement, found in record["runs"].items():
        for mode in MODES:
            r = found[mode]
            busy = ", ".join(f"{p} {b:.2f}" for p, b in r["busy_s"].items())
            idle = ", ".join(f"{p} {f:.0%}" for p, f in r["idle_fraction"].items())
            rows.append({"placement": placement, "mode": mode, "s/step": r["s_per_step"],
                         "vs sequential": found["sequential"]["s_per_step"] / r["s_per_step"],
                         "bound s/step": r["critical_path_s"], "/bound": r["over_bound"],
                         "tokens/s": r["tokens_per_s"], "busy s/step": busy, "idle": idle,
                         "predicted s/step": record.get(f"{placement}_{mode}_predicted_s")})
    columns = ["placement", "mode", "s/step", "vs sequential", "bound s/step", "/bound", "tokens/s",
               "busy s/step", "idle"]
    if any(r["predicted s/step"] is not None for r in rows):
        columns.append("predicted s/step")
    return markdown_table(rows, columns)


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.ppo``."""
    parser = argparse.ArgumentParser(prog="bench.ppo", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--out", type=Path, help="timelines and traces (default: beside --json)")
    parser.add_argument("--placement", action="append", choices=sorted(PLACEMENTS),
                        help="repeatable; default: colocate, split, standalone")
    parser.add_argument("--steps", type=int, default=2, help="steps per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds: each runs every placement and mode once (the median is kept)")
    parser.add_argument("--prompts", type=int, default=PPOJob.prompts)
    parser.add_argument("--plan", action="store_true", help="also record the planner's predictions")
    a = parser.parse_args(argv)
    out = a.out or (a.json.parent if a.json is not None else None)
    job = PPOJob(prompts=a.prompts)
    record = asyncio.run(run(job, a.placement or list(PLACEMENTS), steps=a.steps, repeats=a.repeats,
                             out=out, plan=a.plan))
    print(table(record))
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

