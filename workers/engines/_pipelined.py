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

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from workers._dtensor import is_dtensor
from workers.engines._batch import SequenceInputs
from workers.engines._checkpoint import named_full_weights
from workers.engines._grad_norm import clip_grad_norm
from workers.engines._layout import LastStage
from workers.engines.pipeline import (
    PipelineModel,
    Schedule,
    Stage,
    StageWork,
    forward_order,
    one_f_one_b,
    run_schedule,
    split_stages,
    tied_heads,
)

__all__ = ["PipelineStages"]

T = TypeVar("T")


class PipelineStages:
    """This rank's stages of a model over the mesh's ``pp`` dimension.

    Args:
        model: the whole model, identical on every rank; cut down in place to this
            rank's stages.
        mesh: the engine's ``("pp", "dp", "tp")`` mesh.
        chunks: pieces per rank (``TrainingConfig.pipeline_chunks``).
    """

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, chunks: int, reverse: bool = False) -> None:
        self.size = mesh["pp"].size()
        self.rank = mesh["pp"].get_local_rank()
        self.group = mesh.get_group("pp")
        self.ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        self.chunks = chunks
        self.reverse = reverse
        self.parameters = sum(p.numel() for p in model.parameters())
        """The whole model's parameters (the schedules' cost of a pass is their share)."""
        stage = self.size - 1 - self.rank if reverse else self.rank
        tied = tied_heads(model)
        self.stages: list[Stage] = split_stages(model, rank=stage, ranks=self.size, chunks=chunks)
        first = any(s.index == 0 for s in self.stages)
        last = any(s.last for s in self.stages)
        # Tied embeddings: the first stage's embedding and the last stage's head are
        # copies of one weight; their gradients are summed across the two ranks.
        self._tied_holder: nn.Module | None = None
        self.tied_counted = True
        """Whether this rank's copy counts in the gradient norm (the first stage's)."""
        if tied and first != last:
            self._tied_holder = (model.get_submodule(tied[0]) if last
                                 else self.stages[0].body.get_submodule("embed_tokens"))
            self.tied_counted = first
        ends = (self.ranks[-1], self.ranks[0]) if reverse else (self.ranks[0], self.ranks[-1])
        self._tied_peer = ends[1] if first else ends[0]
        self.module = model
        """The rank's parameters under the whole model's names (``model``, cut down)."""

    @property
    def tied(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding weight (None: none here); read from
        its module each time, as FSDP2 replaces the parameters it shards."""
        return None if self._tied_holder is None else self._tied_holder.weight  # type: ignore[return-value]

    def parts(self) -> list[nn.Module]:
        """This rank's stages, laid out one by one."""
        return [stage.module for stage in self.stages]

    def called_apart(self, part: nn.Module) -> list[nn.Module]:
        """A stage before the last runs its body alone (the head is the last's)."""
        return [stage.body for stage in self.stages if stage.module is part and not stage.last]

    def clip_gradients(self, max_norm: float | None) -> float:
        """The whole model's gradient norm (the stages' squares summed over the
        pipeline), before clipping this rank's gradients to ``max_norm``; a tied
        embedding's second copy is clipped with the rest but counted once."""
        tied = self.tied
        uncounted = [] if tied is None or self.tied_counted else [tied]
        return float(clip_grad_norm(self.module.parameters(), max_norm, stages=self.group, uncounted=uncounted))

    def pipeline(self, micro_batches: int, *, name: str = "model") -> PipelineModel:
        """The model's pipeline for a call of ``micro_batches``: a pass costs the
        stage's share of the parameters (a backward twice a forward)."""
        share = self.parameters / (self.size * self.chunks)
        return PipelineModel(name=name, stages=self.size, micro_batches=micro_batches, chunks=self.chunks,
                             forward_s=share, backward_s=2 * share, activation=share, reverse=self.reverse)

    def work(self, inputs: list[SequenceInputs], last: LastStage, *,
             context: Callable[[], AbstractContextManager[Any]]) -> StageWork:
        """This rank's passes of one update (for a schedule of several models)."""
        return _Work(self, inputs, last, context=context, grad=True)

    def run(self, schedule: Schedule, works: list[StageWork]) -> None:
        """Run this rank's part of ``schedule`` (whose models all run on this
        pipeline's ranks)."""
        run_schedule(schedule, self.rank, works, group=self.group, ranks=self.ranks, on=_device(self.module))

    def forward(self, inputs: list[SequenceInputs], last: LastStage, *,
                context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run every micro-batch forward (no gradients kept); ``last`` on the last stage."""
        model = self.pipeline(len(inputs))
        work = _Work(self, inputs, last, context=context, grad=False)
        with torch.no_grad():
            run_schedule(one_f_one_b(model), self.rank, [work], group=self.group, ranks=self.ranks,
                         on=_device(self.module), order=forward_order(model, self.rank))

    def train(self, inputs: list[SequenceInputs], last: LastStage, *,
              context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run the micro-batches' forwards and backwards in the 1F1B schedule
        (interleaved with chunks); ``last`` gives each micro-batch's loss."""
        self.run(one_f_one_b(self.pipeline(len(inputs))), [self.work(inputs, last, context=context)])

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Every stage's ``(name, full tensor)``, on every rank (a collective over the
        stages: each stage's tensors are gathered over its own data- and
        tensor-parallel ranks, then broadcast over the pipeline)."""
        for owner in range(self.size):
            mine = list(named_full_weights(self.module)) if owner == self.rank else []
            box: list[Any] = [[(name, t.shape, t.dtype) for name, t in mine]]
            dist.broadcast_object_list(box, src=self.ranks[owner], group=self.group)
            tensors = dict(mine)
            device = _device(self.module)
            for name, shape, dtype in box[0]:
                tensor = tensors[name] if owner == self.rank else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=self.ranks[owner], group=self.group)
                yield name, tensor

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of a tied embedding's two copies (first and last stage),
        so both take the one update the tied weight would (a collective of the two
        ranks; nothing elsewhere)."""
        tied = self.tied
        if tied is None:
            return
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        # Sharded over the data-parallel ranks, both copies are cut alike: the local
        # shards of the two ranks of one data-parallel index match.
        grad = tied.grad.to_local() if is_dtensor(tied.grad) else tied.grad
        other = torch.empty_like(grad)
        works = [dist.isend(grad.contiguous(), self._tied_peer, group=self.group),
                 dist.irecv(other, self._tied_peer, group=self.group)]
        for work in works:
            assert work is not None
            work.wait()
        grad.add_(other)

    def from_last(self, value: T) -> T:
        """``value`` as the last stage has it, on every stage (a collective)."""
        box: list[Any] = [value]
        dist.broadcast_object_list(box, src=self.ranks[0 if self.reverse else -1], group=self.group)
        return cast(T, box[0])


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
