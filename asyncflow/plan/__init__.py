"""Placement planning: which roles share a pool, and how many devices each pool gets.

HybridFlow's auto-mapping (its Algorithm 1) on measured costs instead of an
analytical model: a :class:`Workload` (one traced step's call graph) and a
:class:`CostModel` (call durations fitted from profile traces) drive
:func:`simulate`, which replays the runtime's scheduling rules under a
:class:`Placement`; :func:`candidates` enumerates placements and :func:`rank`
sorts them by predicted seconds per step::

    workload = Workload.from_trace(trace)
    costs = CostModel.from_traces(trace)
    best, prediction = rank(workload, costs, candidates(workload.roles, 2, cores=2),
                            cores=2)[0]
    block = best.config_block()   # [pools] and [placement] TOML

The simulator, the cost model and the enumerator are pure Python (no Ray, no
torch); :func:`profile` runs the job on Ray (imported when called).
"""

from __future__ import annotations

from asyncflow.plan._candidates import Placement, candidates, compositions, set_partitions
from asyncflow.plan._profile import (
    PlanJob,
    Profile,
    Stepper,
    fit_interference,
    fit_oversubscription,
    predict,
    profile,
    profile_placements,
    rank_profiled,
    sequential_s,
)
from asyncflow.plan._simulate import Prediction, SimSpan, oversubscribed, rank, simulate
from asyncflow.plan._workload import (
    CostModel,
    CostSample,
    MissingCostError,
    StreamPart,
    WorkCall,
    Workload,
)

__all__ = [
    "CostModel",
    "CostSample",
    "MissingCostError",
    "Placement",
    "PlanJob",
    "Prediction",
    "Profile",
    "SimSpan",
    "Stepper",
    "StreamPart",
    "WorkCall",
    "Workload",
    "candidates",
    "compositions",
    "fit_interference",
    "fit_oversubscription",
    "oversubscribed",
    "predict",
    "profile",
    "profile_placements",
    "rank",
    "rank_profiled",
    "sequential_s",
    "set_partitions",
    "simulate",
]
