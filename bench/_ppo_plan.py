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


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Round by round, placement a's time over placement b's (the rounds pair them:
    each round runs every placement back to back, so the machine's drift between
    rounds divides out)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two placements' repeated timings tell them apart: the interquartile
    range of their round-by-round ratios lies wholly on one side of 1."""
    low, high = _quartiles(paired_ratios(a, b))
    return high < 1.0 or low > 1.0


def measured_order(repeats: Mapping[str, Sequence[float]]) -> list[str]:
    """Placements fastest first, by the median over rounds of each one's time
    relative to its round (divided by the geometric mean of the round's times)."""
    names = sorted(repeats)
    rounds = list(zip(*(repeats[p] for p in names), strict=True))
    scale = [statistics.geometric_mean(r) for r in rounds]
    relative = {p: statistics.median(repeats[p][i] / scale[i] for i in range(len(rounds))) for p in names}
    return sorted(names, key=relative.__getitem__)


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
            elif (statistics.median(paired_ratios(repeats[a], repeats[b])) < 1.0) != (predicted[a] < predicted[b]):
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
                           "plan_oversubscription": found.oversubscription,
                           "plan_profiled_overlapped_s": found.overlapped_s}
    for p in placements:
        placement = PLACEMENTS[p]
        out[f"{p}_sequential_predicted_s"] = sequential_s(found, placement, cores=CORES)
        out[f"{p}_overlapped_predicted_s"] = predict(found, placement, cores=CORES).step_s
        out[f"{p}_stream_predicted_s"] = predict(found, placement, cores=CORES, stream=True).step_s
        for mode in ("sequential", "overlapped", "stream"):
            got = measured.get(f"{p}_{mode}_s")
            if got:
                out[f"{p}_{mode}_predicted_error"] = out[f"{p}_{mode}_predicted_s"] / got - 1
    for mode in ("overlapped", "stream"):
        predicted = {p: out[f"{p}_{mode}_predicted_s"] for p in placements}
        repeats = {p: measured["runs"][p][mode]["repeats_s"] for p in placements}
        by_predicted, by_measured = sorted(placements, key=predicted.__getitem__), measured_order(repeats)
        agrees, tied = order_agrees(repeats, predicted)
        out.update({f"plan_{mode}_order_predicted": by_predicted, f"plan_{mode}_order_measured": by_measured,
                    f"plan_{mode}_order_matches": by_measured == by_predicted,
                    f"plan_{mode}_order_agrees": agrees, f"plan_{mode}_tied": tied})
    ranked = rank_profiled(found, candidates(list(ROLES), 2, cores=CORES), cores=CORES)
    out["plan_ranked"] = [{"placement": pl.describe(), "predicted_s": pr.step_s} for pl, pr in ranked]
    return out
