"""The planner's predictions for the PPO benchmark's placements (``bench.ppo --plan``)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import asyncflow as af
from asyncflow.plan import Placement, candidates, predict, profile, rank_profiled, sequential_s
from bench._ppo_job import PLACEMENTS, ROLES, Models, PPOJob, Runner

CORES = 2
"""The machine's cores (the benchmark's placements use two devices)."""


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two placements' repeated timings tell them apart: one's upper
    quartile is below the other's lower quartile."""
    qa, qb = _quartiles(a), _quartiles(b)
    return qa[1] < qb[0] or qb[1] < qa[0]


def order_agrees(repeats: Mapping[str, Sequence[float]],
                 predicted: Mapping[str, float]) -> tuple[bool, list[list[str]]]:
    """Whether ``predicted`` orders every pair of placements the measurements
    separate (:func:`separated`) as they do; and the pairs they do not separate
    (ties: any order of those agrees)."""
    names = sorted(repeats)
    agrees, tied = True, []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if not separated(repeats[a], repeats[b]):
                tied.append([a, b])
            elif (statistics.median(repeats[a]) < statistics.median(repeats[b])) != (predicted[a] < predicted[b]):
                agrees = False
    return agrees, tied


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


class PPOPlanJob:
    """The benchmark's workload as the planner profiles it."""

    roles = ROLES

    def __init__(self, job: PPOJob, models: Models) -> None:
        self.job, self.models = job, models

    async def start(self, placement: Placement, session: af.Session) -> Runner:
        return await Runner.start(self.job, self.models, placement, session)


async def predictions(job: PPOJob, placements: list[str], *, measured: dict[str, Any]) -> dict[str, Any]:
    """Profile the workload, predict every benched placement and mode, compare."""
    with Models(job) as models:
        found = await profile(PPOPlanJob(job, models), devices=2, cores=CORES)
    out: dict[str, Any] = {"plan_step_overhead_s": found.step_overhead_s,
                           "plan_interference": found.interference,
                           "plan_profiled_overlapped_s": found.overlapped_s}
    for p in placements:
        placement = PLACEMENTS[p]
        out[f"{p}_sequential_predicted_s"] = sequential_s(found, placement)
        out[f"{p}_overlapped_predicted_s"] = predict(found, placement, cores=CORES).step_s
        out[f"{p}_stream_predicted_s"] = predict(found, placement, cores=CORES, stream=True).step_s
        for mode in ("sequential", "overlapped", "stream"):
            got = measured.get(f"{p}_{mode}_s")
            if got:
                out[f"{p}_{mode}_predicted_error"] = out[f"{p}_{mode}_predicted_s"] / got - 1
    for mode in ("overlapped", "stream"):
        by_measured = sorted(placements, key=lambda p: measured.get(f"{p}_{mode}_s", 0.0))
        by_predicted = sorted(placements, key=lambda p: out[f"{p}_{mode}_predicted_s"])
        out[f"plan_{mode}_order_measured"] = by_measured
        out[f"plan_{mode}_order_predicted"] = by_predicted
        out[f"plan_{mode}_order_matches"] = by_measured == by_predicted
        runs = measured.get("runs", {})
        if all(p in runs for p in placements):
            repeats = {p: runs[p][mode]["repeats_s"] for p in placements}
            agrees, tied = order_agrees(repeats, {p: out[f"{p}_{mode}_predicted_s"] for p in placements})
            out[f"plan_{mode}_order_agrees"] = agrees
            out[f"plan_{mode}_tied"] = tied
    ranked = rank_profiled(found, candidates(list(ROLES), 2, cores=CORES), cores=CORES)
    out["plan_ranked"] = [{"placement": pl.describe(), "predicted_s": pr.step_s} for pl, pr in ranked]
    return out
