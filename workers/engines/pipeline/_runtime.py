"""Runs a :class:`Schedule` on this rank: its device's passes in order, hidden states
and their gradients sent between stages point to point.

Each rank is one device of the schedule's row. For each pass it receives what the
pass needs from the device that ran the pass before it (a blocking receive), runs
it (a :class:`StageWork` of that model), and sends the result on without waiting.
Sends are waited for at the end of the run. A valid schedule (one :func:`simulate`
accepts) cannot deadlock this way: every receive's message is sent by a pass that
does not wait for this one.

Messages are tagged by model, micro-batch, stage and direction. Hidden states go
with a small header (shape and dtype: they differ with the precision and the
micro-batch); a gradient has its hidden state's shape, known to the receiver.
Tested over gloo; NCCL matches point-to-point messages by order rather than tag,
which the interleaved schedules do not keep between two ranks (planned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from workers.engines.pipeline._schedule import PipelineModel, Schedule, Task

__all__ = ["StageWork", "forward_order", "run_schedule"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, up to 6 sizes, dtype


class StageWork(Protocol):
    """One model's passes on this rank."""

    def forward(self, stage: int, micro_batch: int, hidden: Tensor | None) -> Tensor | None:
        """Run virtual ``stage`` on ``micro_batch``; ``hidden`` is the previous stage's
        output (None on stage 0). Returns the hidden states for the next stage (None
        on the last)."""
        ...

    def backward(self, stage: int, micro_batch: int, grad: Tensor | None) -> Tensor | None:
        """Back-propagate virtual ``stage`` for ``micro_batch`` from ``grad`` (the next
        stage's gradient of this stage's output; None on the last stage, which starts
        from the loss). Returns the gradient of the stage's input (None on stage 0)."""
        ...


class _Links:
    """Point-to-point messages between the devices of one row."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int], device: torch.device) -> None:
        self.group = group
        self.ranks = list(ranks)
        self.device = device
        self.pending: list[tuple[dist.Work, Tensor]] = []
        self.shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}

    def send(self, tensor: Tensor, to: int, tag: int, *, header: bool) -> None:
        tensor = tensor.detach().contiguous()
        if header:
            head = torch.zeros(_HEADER, dtype=torch.int64)
            head[0] = tensor.dim()
            head[1:1 + tensor.dim()] = torch.tensor(tensor.shape)
            head[-1] = _DTYPES.index(tensor.dtype)
            self._isend(head.to(self.device), to, 2 * tag)
        self._isend(tensor, to, 2 * tag + 1)

    def _isend(self, tensor: Tensor, to: int, tag: int) -> None:
        work = dist.isend(tensor, self.ranks[to], group=self.group, tag=tag)
        assert work is not None
        self.pending.append((work, tensor))

    def receive(self, source: int, tag: int, *, like: tuple[torch.Size, torch.dtype] | None = None) -> Tensor:
        if like is None:
            head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(head, self.ranks[source], group=self.group, tag=2 * tag)
            values = head.tolist()
            like = (torch.Size(values[1:1 + values[0]]), _DTYPES[values[-1]])
        out = torch.empty(like[0], dtype=like[1], device=self.device)
        dist.recv(out, self.ranks[source], group=self.group, tag=2 * tag + 1)
        return out

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _tag(models: Sequence[PipelineModel], task: Task) -> int:
    """A number per (model, pipeline, micro-batch, boundary after ``task.stage``)."""
    tag = 0
    for m, model in enumerate(models):
        if m == task.model:
            return tag + (task.pipeline * model.micro_batches + task.micro_batch) * model.virtual_stages + task.stage
        tag += model.pipelines * model.micro_batches * model.virtual_stages
    raise AssertionError(task)


def run_schedule(
    schedule: Schedule,
    device: int,
    works: Sequence[StageWork],
    *,
    group: dist.ProcessGroup | None,
    ranks: Sequence[int],
    on: torch.device,
    order: Sequence[Task] | None = None,
) -> None:
    """Run ``device``'s passes of ``schedule`` (or ``order``, e.g. forwards only).

    Args:
        schedule: the row's schedule (every device runs its own part of it).
        device: this rank's device in the row.
        works: each model's passes on this rank, by the schedule's model index.
        group: the process group joining the row's ranks.
        ranks: each device's global rank.
        on: where received tensors go (the ranks' device).
        order: the passes to run instead of ``schedule.orders[device]``.
    """
    links = _Links(group, ranks, on)
    local: dict[tuple[int, bool], Tensor] = {}  # to a stage on this same device
    models = schedule.models
    for task in schedule.orders[device] if order is None else order:
        model = models[task.model]
        if not task.backward:
            hidden = None
            if task.stage > 0:
                hidden = _take(links, local, models, task._replace(stage=task.stage - 1), device, header=True)
            out = works[task.model].forward(task.stage, task.micro_batch, hidden)
            if task.stage < model.virtual_stages - 1:
                assert out is not None, "a stage before the last returns its hidden states"
                _give(links, local, models, task, model.device_of(task.pipeline, task.stage + 1), out, device,
                      header=True)
        else:
            grad = None
            if task.stage < model.virtual_stages - 1:
                grad = _take(links, local, models, task, device, header=False,
                             source=model.device_of(task.pipeline, task.stage + 1))
            back = works[task.model].backward(task.stage, task.micro_batch, grad)
            if task.stage > 0:
                assert back is not None, "a stage after the first returns its input's gradient"
                boundary = task._replace(stage=task.stage - 1)
                _give(links, local, models, boundary, model.device_of(task.pipeline, task.stage - 1), back,
                      device, header=False)
    links.wait()


def _give(links: _Links, local: dict[tuple[int, bool], Tensor], models: Sequence[PipelineModel], boundary: Task,
          to: int, tensor: Tensor, device: int, *, header: bool) -> None:
    """Send the tensor crossing ``boundary`` (after its stage) to device ``to``."""
    tag = _tag(models, boundary)
    if header:
        links.shapes[tag] = (tensor.shape, tensor.dtype)
    if to == device:
        local[(tag, header)] = tensor.detach()
    else:
        links.send(tensor, to, tag, header=header)


def _take(links: _Links, local: dict[tuple[int, bool], Tensor], models: Sequence[PipelineModel], boundary: Task,
          device: int, *, header: bool, source: int | None = None) -> Tensor:
    """Receive the tensor crossing ``boundary``: hidden states from the device before
    it (``header``), or their gradient from the device after it (``source``)."""
    tag = _tag(models, boundary)
    model = models[boundary.model]
    if source is None:
        source = model.device_of(boundary.pipeline, boundary.stage)
    if source == device:
        return local.pop((tag, header))
    return links.receive(source, tag, like=None if header else links.shapes[tag])


def forward_order(model: PipelineModel, device: int) -> list[Task]:
    """``device``'s forward passes of ``model`` when nothing runs backward (log-probs,
    values): micro-batch by micro-batch, each through this device's stages in order."""
    return [Task(0, pipeline, mb, stage, False)
            for mb in range(model.micro_batches)
            for pipeline in range(model.pipelines)
            for stage in range(model.virtual_stages)
            if model.device_of(pipeline, stage) == device]
