"""The training engine's pipeline stages: this rank's part of the model and the
schedule its micro-batches run in.

With a mesh whose ``pp`` is above 1, the engine keeps only its stage's decoder
layers (:func:`workers.engines.pipeline.split_stages`, ``pipeline_chunks`` pieces
per rank) and runs each call's micro-batches as a pipeline: forwards only for
log-probs and values, the 1F1B schedule (interleaved with chunks) for an update.
The last stage computes the head's outputs and the loss; its results are then
broadcast to the other stages, so every rank of the mesh returns the same.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers.engines._batch import SequenceInputs
from workers.engines.pipeline import (
    PipelineModel,
    Stage,
    forward_order,
    one_f_one_b,
    run_schedule,
    split_stages,
)

__all__ = ["PipelineStages"]

LastStage = Callable[[nn.Module, int], Tensor | None]
"""``(the last stage's module, micro-batch) ->`` the loss to back-propagate (None
when only forwarding)."""


class PipelineStages:
    """This rank's stages of a model over the mesh's ``pp`` dimension.

    Args:
        model: the whole model, identical on every rank; cut down in place to this
            rank's stages.
        mesh: the engine's ``("pp", "dp", "tp")`` mesh.
        chunks: pieces per rank (``TrainingConfig.pipeline_chunks``).
    """

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, chunks: int) -> None:
        self.size = mesh["pp"].size()
        self.rank = mesh["pp"].get_local_rank()
        self.group = mesh.get_group("pp")
        self.ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        self.chunks = chunks
        self.stages: list[Stage] = split_stages(model, rank=self.rank, ranks=self.size, chunks=chunks)
        self.module: nn.Module = (self.stages[0].module if chunks == 1
                                  else nn.ModuleList(stage.module for stage in self.stages))
        """The rank's parameters in one module (the stage's own shell with one chunk)."""

    @property
    def last(self) -> bool:
        """Whether this rank runs the model's last stage."""
        return any(stage.last for stage in self.stages)

    def _model(self, micro_batches: int) -> PipelineModel:
        return PipelineModel(name="model", stages=self.size, micro_batches=micro_batches, chunks=self.chunks)

    def forward(self, inputs: list[SequenceInputs], last: LastStage, *,
                context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run every micro-batch forward (no gradients kept); ``last`` on the last stage."""
        model = self._model(len(inputs))
        work = _Work(self, inputs, last, context=context, grad=False)
        with torch.no_grad():
            run_schedule(one_f_one_b(model), self.rank, [work], group=self.group, ranks=self.ranks,
                         on=_device(self.module), order=forward_order(model, self.rank))

    def train(self, inputs: list[SequenceInputs], last: LastStage, *,
              context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run the micro-batches' forwards and backwards in the 1F1B schedule
        (interleaved with chunks); ``last`` gives each micro-batch's loss."""
        model = self._model(len(inputs))
        work = _Work(self, inputs, last, context=context, grad=True)
        run_schedule(one_f_one_b(model), self.rank, [work], group=self.group, ranks=self.ranks,
                     on=_device(self.module))

    def from_last(self, value: Any) -> Any:
        """``value`` as the last stage has it, on every stage (a collective)."""
        box = [value]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group)
        return box[0]


def _device(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class _Work:
    """One call's passes on this rank (a :class:`~workers.engines.pipeline.StageWork`)."""

    def __init__(self, stages: PipelineStages, inputs: list[SequenceInputs], last: LastStage, *,
                 context: Callable[[], AbstractContextManager[Any]], grad: bool) -> None:
        self.by_index = {stage.index: stage for stage in stages.stages}
        self.inputs = inputs
        self.last = last
        self.context = context
        self.grad = grad
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor | None]] = {}

    def forward(self, stage: int, micro_batch: int, hidden: Tensor | None) -> Tensor | None:
        piece = self.by_index[stage]
        inputs = self.inputs[micro_batch]
        if piece.inbox is not None:
            assert hidden is not None
            hidden = hidden.detach().requires_grad_(self.grad)
            piece.inbox.put(hidden)
        with self.context():
            out = (self.last(piece.module, micro_batch) if piece.last
                   else piece.hidden(inputs.input_ids, inputs.attention_mask, inputs.position_ids))
        if self.grad:
            self.saved[(stage, micro_batch)] = (hidden, out)
        return None if piece.last else out

    def backward(self, stage: int, micro_batch: int, grad: Tensor | None) -> Tensor | None:
        hidden, out = self.saved.pop((stage, micro_batch))
        assert out is not None, "the last stage's loss, or a stage's hidden states"
        if grad is None:
            out.backward()
        else:
            out.backward(grad)
        return None if hidden is None else hidden.grad
