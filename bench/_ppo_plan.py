"""The planner's predictions for the PPO benchmark's placements (``bench.ppo --plan``)."""

from __future__ import annotations

from typing import Any

import asyncflow as af
from asyncflow.plan import Placement, candidates, predict, profile, rank, sequential_s
from bench._ppo_job import PLACEMENTS, ROLES, Models, PPOJob, Runner

CORES = 2
"""The machine's cores (the benchmark's placements use two devices)."""


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
        found = await profile(PPOPlanJob(job, models), devices=2)
    out: dict[str, Any] = {"plan_step_overhead_s": found.step_overhead_s}
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
    ranked = rank(found.batch, found.costs, candidates(list(ROLES), 2, cores=CORES), cores=CORES,
                  step_overhead_s=found.step_overhead_s)
    out["plan_ranked"] = [{"placement": pl.describe(), "predicted_s": pr.step_s} for pl, pr in ranked]
    return out
