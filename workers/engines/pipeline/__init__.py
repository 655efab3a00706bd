"""Pipeline parallelism: schedules as data (build, check, cost), a model cut into
stages, and the runtime that runs a schedule's passes on this rank.

- :class:`PipelineModel` describes one model's pipelines over a row of devices;
  :class:`Schedule` gives each device its ordered forward and backward passes.
- :func:`one_f_one_b` builds 1F1B (interleaved with ``chunks > 1``);
  :func:`fused_greedy` and :func:`fused_annealed` build RLHFuse's fused schedules
  of two models trained on the same devices in opposite directions;
  :func:`backfilled` fills the slowest model's 1F1B bubbles with the other's passes
  (the slowest model's passes as late as its own finish allows);
  :func:`fusion_lower_bound` bounds any fused schedule's finish time and
  :func:`serial_cost` is the unfused baseline (each model's 1F1B in turn).
- :func:`simulate` checks a schedule and gives its finish time and peak activations.
- :func:`split_stages` cuts a transformers model into this rank's stages;
  :func:`run_schedule` runs a schedule's passes here, sending hidden states and
  gradients between ranks (the training engine's ``pp > 1``).
"""

from __future__ import annotations

from workers.engines.pipeline._annealing import fused_annealed
from workers.engines.pipeline._builders import one_f_one_b
from workers.engines.pipeline._fusion import (
    SerialCost,
    backfilled,
    fused_greedy,
    fusion_lower_bound,
    serial_cost,
)
from workers.engines.pipeline._runtime import StageWork, forward_order, run_schedule
from workers.engines.pipeline._schedule import (
    PipelineModel,
    Schedule,
    ScheduleError,
    Simulation,
    Task,
    simulate,
)
from workers.engines.pipeline._stages import Inbox, Stage, layer_bounds, split_stages, tied_heads

__all__ = [
    "Inbox",
    "PipelineModel",
    "Schedule",
    "ScheduleError",
    "SerialCost",
    "Simulation",
    "Stage",
    "StageWork",
    "Task",
    "backfilled",
    "forward_order",
    "fused_annealed",
    "fused_greedy",
    "fusion_lower_bound",
    "layer_bounds",
    "one_f_one_b",
    "run_schedule",
    "serial_cost",
    "simulate",
    "split_stages",
    "tied_heads",
]
