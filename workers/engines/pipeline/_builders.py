"""One model's pipeline schedules: 1F1B and interleaved 1F1B.

1F1B (PipeDream-flush, Megatron's default): device ``r`` of ``p`` runs
``p - r - 1`` warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards; at most ``p - r`` micro-batches' activations are
held. The interleaved form (``PipelineModel.chunks = v > 1``, Megatron's virtual
pipeline) gives each device ``v`` non-adjacent pieces of the model and walks the
micro-batches in groups of ``p``, chunk by chunk, which shrinks the fill and drain by
a factor ``v`` at the cost of ``v`` times the messages. Any micro-batch count works:
the last group takes the remainder.
"""

from __future__ import annotations

import itertools

from workers.engines.pipeline._schedule import PipelineModel, Schedule, Task, TaskIndex, run_orders

__all__ = ["one_f_one_b"]


def one_f_one_b(model: PipelineModel) -> Schedule:
    """The 1F1B schedule of ``model`` (interleaved when ``model.chunks > 1``).

    Returns:
        A one-model schedule over ``model.devices`` devices.
    """
    index = TaskIndex([model])
    # Megatron's warm-up counts run any micro-batch count in whole groups of
    # ``stages``; a smaller last group can need more forwards in flight before the
    # first backward, so the warm-up grows until the orders run (all forwards first,
    # GPipe's order, always does).
    for extra in range(model.micro_batches * model.chunks + 1):
        orders: list[tuple[Task, ...]] = [()] * model.devices
        for pipeline in range(model.pipelines):
            for rank in range(model.stages):
                orders[model.device_of(pipeline, rank)] = tuple(_rank_order(model, pipeline, rank, extra))
        schedule = Schedule((model,), tuple(orders))
        if run_orders(index, index.orders(schedule)) is not None:
            return schedule
    raise AssertionError("a schedule with every forward first always runs")


def _walk(model: PipelineModel, *, backward: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order one device runs its forwards (or backwards):
    micro-batches in groups of ``stages``, each group through every chunk in turn
    (the last chunk first for backwards). A remainder joins the last whole group: a
    group smaller than ``stages`` cannot keep the pipeline full between chunks."""
    chunks = range(model.chunks - 1, -1, -1) if backward else range(model.chunks)
    starts = list(range(0, model.micro_batches, model.stages))
    if len(starts) > 1 and model.micro_batches % model.stages:
        starts.pop()
    bounds = [*starts, model.micro_batches]
    out: list[tuple[int, int]] = []
    for first, end in itertools.pairwise(bounds):
        out.extend((mb, chunk) for chunk in chunks for mb in range(first, end))
    return out


def _rank_order(model: PipelineModel, pipeline: int, rank: int, extra: int) -> list[Task]:
    p, v = model.stages, model.chunks
    forwards = [Task(0, pipeline, mb, chunk * p + rank, False) for mb, chunk in _walk(model, backward=False)]
    backwards = [Task(0, pipeline, mb, chunk * p + rank, True) for mb, chunk in _walk(model, backward=True)]
    # Warm-up: enough forwards that the first backward's dependency is on its way;
    # with chunks, a whole round of the other chunks too (Megatron's count).
    warmup = p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p
    warmup = min(warmup + extra, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    order += backwards[len(forwards) - warmup:]
    return order

