"""How a training engine holds its model on this rank: whole, or as pipeline stages.

The engine runs its micro-batches, clips its gradients and hands over its weights
through a :class:`ModelLayout`: :class:`WholeModel` (one module, every layer) or
:class:`~workers.engines._pipelined.PipelineStages` (this rank's stages of a
pipeline over the mesh's ``pp`` ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from workers.engines._batch import SequenceInputs
from workers.engines._checkpoint import named_full_weights
from workers.engines._grad_norm import clip_grad_norm

__all__ = ["LastStage", "ModelLayout", "WholeModel"]

T = TypeVar("T")

LastStage = Callable[[nn.Module, int], Tensor | None]
"""``(the module holding the head, micro-batch) ->`` the micro-batch's loss to
back-propagate (None when only forwarding)."""


class ModelLayout(Protocol):
    """What the engine asks of the way its model is held."""

    module: nn.Module
    """This rank's parameters, under the whole model's names."""

    def parts(self) -> list[nn.Module]:
        """The modules laid out (FSDP2 / TP) one by one."""
        ...

    def called_apart(self, part: nn.Module) -> list[nn.Module]:
        """Submodules of ``part`` run on their own, not through its forward."""
        ...

    def forward(self, inputs: list[SequenceInputs], last: LastStage, *,
                context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run every micro-batch forward without gradients; ``last`` where the head
        is (it applies the engine's precision to its own call); ``context`` around
        the layers before it."""
        ...

    def train(self, inputs: list[SequenceInputs], last: LastStage, *,
              context: Callable[[], AbstractContextManager[Any]]) -> None:
        """Run every micro-batch forward and back; ``last`` gives each one's loss."""
        ...

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of a weight held twice (tied embeddings), if any."""
        ...

    def from_last(self, value: T) -> T:
        """``value`` as the rank that ran the head has it."""
        ...

    def clip_gradients(self, max_norm: float | None) -> float:
        """The gradients' total norm over the whole model, before clipping to ``max_norm``."""
        ...

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The whole model's ``(name, full tensor)``, on every rank (a collective)."""
        ...


class WholeModel:
    """Every layer of the model on this rank (data and tensor parallelism only):
    ``last`` runs them all, so ``context`` wraps nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model

    def parts(self) -> list[nn.Module]:
        return [self.module]

    def called_apart(self, part: nn.Module) -> list[nn.Module]:
        return []

    def forward(self, inputs: list[SequenceInputs], last: LastStage, *,
                context: Callable[[], AbstractContextManager[Any]]) -> None:
        with torch.no_grad():
            for k in range(len(inputs)):
                last(self.module, k)

    def train(self, inputs: list[SequenceInputs], last: LastStage, *,
              context: Callable[[], AbstractContextManager[Any]]) -> None:
        for k in range(len(inputs)):
            loss = last(self.module, k)
            assert loss is not None, "an update gives each micro-batch's loss"
            loss.backward()

    def sum_tied_gradients(self) -> None:
        return  # one module holds a tied weight once

    def from_last(self, value: T) -> T:
        return value

    def clip_gradients(self, max_norm: float | None) -> float:
        return float(clip_grad_norm(self.module.parameters(), max_norm))

    def full_weights(self) -> Iterator[tuple[str, Tensor]]:
        return named_full_weights(self.module)
