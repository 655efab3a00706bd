"""One update of two engines in one fused pipeline schedule (RLHFuse's intra-stage
fusion): the actor's and the critic's pipelines on the same ranks, in opposite
directions, each filling the other's bubbles.

Each engine prepares its step as :meth:`TrainingEngine.train_step` does (micro-batch
plan, loss normaliser, metrics), then one schedule runs both models' forwards and
backwards (:func:`workers.engines.pipeline.fused_annealed`, the same on every rank:
the search is seeded), then each engine ends its step (gradients reduced and
clipped, optimizer step). The results equal the two engines' ``train_step`` one
after the other: only the order of independent passes changes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from torch import Tensor

from workers.engines._engine import TrainingEngine
from workers.engines._errors import EngineConfigError
from workers.engines._pipelined import PipelineStages
from workers.engines.pipeline import PipelineModel, Schedule, fused_annealed
from workers.objectives import LossFn

__all__ = ["fused_train_steps"]


def fused_train_steps(
    first: TrainingEngine,
    first_batch: Mapping[str, Tensor],
    second: TrainingEngine,
    second_batch: Mapping[str, Tensor],
    *,
    first_loss: LossFn | None = None,
    second_loss: LossFn | None = None,
    search_iterations: int = 2000,
) -> tuple[dict[str, float], dict[str, float]]:
    """``first.train_step(first_batch)`` and ``second.train_step(second_batch)`` as
    one fused pipeline schedule.

    Collective over both engines' ranks, like ``train_step``.

    Args:
        first: an engine with pipeline stages (the actor).
        first_batch: its batch, as for ``train_step``.
        second: an engine over the same pipeline ranks, built with
            ``TrainingConfig.pipeline_reversed`` set opposite to ``first``'s.
        second_batch: its batch.
        first_loss: ``first``'s objective for this step (default its own).
        second_loss: ``second``'s.
        search_iterations: the schedule search's moves per phase (the schedule of
            a shape is searched once and kept).

    Returns:
        Each engine's metrics, as ``train_step`` returns them.

    Raises:
        EngineConfigError: if an engine has no pipeline stages or several chunks, the
            engines' pipelines are not on the same ranks, or they run the same way.
    """
    one, two = first._layout, second._layout
    if not isinstance(one, PipelineStages) or not isinstance(two, PipelineStages):
        raise EngineConfigError("fused_train_steps needs two engines with pipeline stages (a mesh with pp > 1)")
    stages = [one, two]
    if stages[0].ranks != stages[1].ranks:
        raise EngineConfigError(
            f"fused_train_steps needs both engines' pipelines on the same ranks; got {stages[0].ranks} and "
            f"{stages[1].ranks}")
    if stages[0].reverse == stages[1].reverse:
        raise EngineConfigError(
            "fused_train_steps needs the engines' pipelines in opposite directions: build the second with "
            "TrainingConfig(pipeline_reversed=True)")
    if stages[0].chunks != 1 or stages[1].chunks != 1:
        raise EngineConfigError("fused_train_steps runs one chunk per stage (pipeline_chunks=1) for now")
    steps = [first._prepare_step(first_batch, first_loss), second._prepare_step(second_batch, second_loss)]
    models = (stages[0].pipeline(len(steps[0].inputs), name="first"),
              stages[1].pipeline(len(steps[1].inputs), name="second"))
    works = [s.work(step.inputs, step.micro_loss, context=engine._precision.context)
             for s, step, engine in zip(stages, steps, (first, second), strict=True)]
    stages[0].run(_schedule(models, search_iterations), works)
    return first._finish_step(steps[0]), second._finish_step(steps[1])


@functools.lru_cache(maxsize=64)
def _schedule(models: tuple[PipelineModel, ...], iterations: int) -> Schedule:
    """The annealed fused schedule of ``models`` (deterministic: every rank searches
    the same and gets the same)."""
    return fused_annealed(models, iterations=iterations, seed=0)
