"""Pipeline-parallel schedules: build, check and cost them (the training engines
do not run them yet: ``pp > 1`` is still refused there).

- :class:`PipelineModel` describes one model's pipelines over a row of devices;
  :class:`Schedule` gives each device its ordered forward and backward passes.
- :func:`one_f_one_b` builds 1F1B (interleaved with ``chunks > 1``);
  :func:`fused_greedy` and :func:`fused_annealed` build RLHFuse's fused schedules
  of two models trained on the same devices in opposite directions;
  :func:`backfilled` fills the slowest model's 1F1B bubbles with the other's passes;
  :func:`fusion_lower_bound` bounds any fused schedule's finish time and
  :func:`serial_cost` is the unfused baseline (each model's 1F1B in turn).
- :func:`simulate` checks a schedule and gives its finish time and peak activations.
"""

from __future__ import annotations

from workers.engines.pipeline._builders import one_f_one_b
from workers.engines.pipeline._fusion import (
    SerialCost,
    backfilled,
    fused_annealed,
    fused_greedy,
    fusion_lower_bound,
    serial_cost,
)
from workers.engines.pipeline._schedule import (
    PipelineModel,
    Schedule,
    ScheduleError,
    Simulation,
    Task,
    simulate,
)

__all__ = [
    "PipelineModel",
    "Schedule",
    "ScheduleError",
    "SerialCost",
    "Simulation",
    "Task",
    "backfilled",
    "fused_annealed",
    "fused_greedy",
    "fusion_lower_bound",
    "one_f_one_b",
    "serial_cost",
    "simulate",
]
