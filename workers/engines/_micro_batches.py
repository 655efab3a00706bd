"""One engine call as micro-batches over data-parallel ranks: the rows of each
micro-batch (or the dummy row of a rank that has fewer), the outputs written back
into batch-sized tensors, and one train step's loss and metric sums reduced over
the data-parallel ranks at the end.

Every data-parallel rank runs the same number of forwards (each FSDP forward is a
collective), so a rank without rows for a micro-batch runs a dummy row whose
objective has zero gradient and whose outputs are not kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from workers.engines._batch import (
    MicroBatchPlanner,
    SequenceInputs,
    dummy_row,
    pad_columns,
    select_rows,
)
from workers.engines._parallel import Parallelism
from workers.objectives import LossTerms, ModelOutputs


def micro_batch(batch: Mapping[str, Tensor], rows: Tensor) -> tuple[dict[str, Tensor], bool]:
    """The micro-batch of ``rows`` and whether it is a dummy (``rows`` empty: this
    rank has fewer micro-batches than a peer, or no rows at all)."""
    if rows.numel() == 0:
        return dummy_row(batch), True
    return select_rows(batch, rows), False


def pad_outputs(outputs: ModelOutputs, width: int) -> ModelOutputs:
    """``outputs`` with every per-token field padded (or cut) to ``width`` columns."""
    padded = {
        f.name: pad_columns(getattr(outputs, f.name), width)
        for f in dataclasses.fields(outputs)
        if getattr(outputs, f.name) is not None
    }
    return ModelOutputs(**padded)


def collect_outputs(
    results: dict[str, Tensor],
    outputs: ModelOutputs,
    rows: Tensor | None,
    micro: Mapping[str, Tensor],
    shape: tuple[int, int],
    device: torch.device,
) -> None:
    """Write a micro-batch's outputs into the batch-sized ``results`` at ``rows``
    (zero on padding).

    A dummy micro-batch (``rows`` None) only creates the fields, so that a rank
    without rows returns ``[0, R]`` outputs.
    """
    for field in dataclasses.fields(outputs):
        value = getattr(outputs, field.name)
        if value is None:
            continue
        dest = results.setdefault(field.name, torch.zeros(shape, device=device))
        if rows is not None:
            mask = micro["response_mask"].to(torch.float32)
            dest[rows.to(device)] = pad_columns(value.float(), shape[1]) * mask


def zero_objective(outputs: ModelOutputs) -> Tensor:
    """A loss that touches every output and has exactly zero gradient (for dummy rows)."""
    parts = [
        value.sum()
        for value in (getattr(outputs, f.name) for f in dataclasses.fields(outputs))
        if value is not None and value.requires_grad
    ]
    return torch.stack(parts).sum() * 0.0


class StepStats:
    """Sums of the loss and per-token metrics of one step, and the largest values of
    its per-token maxima, reduced over DP at the end.

    Kept as float64 tensors on the device so that no micro-batch waits for the device.
    Every rank records the same metric names (a dummy micro-batch adds zeros), so the
    packed reduction has the same size everywhere.
    """

    def __init__(self, device: torch.device) -> None:
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._none = torch.full((), -math.inf, dtype=torch.float64, device=device)
        self.loss = self._zero
        self.tokens = self._zero
        self.sums: dict[str, Tensor] = {}
        self.maxima: dict[str, Tensor] = {}

    def add(self, terms: LossTerms, mask: Tensor, *, loss: Tensor | None) -> None:
        """Add one micro-batch's loss (None for a dummy), its metrics' sums and its
        maxima's largest values over the tokens of ``mask``."""
        # where, not a product: a non-finite value on padding must not leak into a sum.
        keep = mask.bool()
        if loss is not None:
            self.loss = self.loss + loss.detach().double()
        self.tokens = self.tokens + keep.sum().double()
        for name, value in terms.metrics.items():
            total = torch.where(keep, value.detach(), 0.0).sum().double()
            self.sums[name] = self.sums.get(name, self._zero) + total
        for name, value in terms.maxima.items():
            top = torch.where(keep, value.detach(), -math.inf).amax().double() if keep.numel() else self._none
            self.maxima[name] = torch.maximum(self.maxima.get(name, self._none), top)

    def packed(self) -> tuple[Tensor, Tensor]:
        """This rank's values as two float64 vectors: the sums (the loss, the tokens,
        each metric's sum by name) and the maxima (by name); :meth:`unpack` reads
        them back once reduced over the ranks."""
        maxima = [self.maxima[n] for n in sorted(self.maxima)]
        return (torch.stack([self.loss, self.tokens, *(self.sums[n] for n in sorted(self.sums))]),
                torch.stack(maxima) if maxima else self._zero.new_empty(0))

    def unpack(self, sums: Tensor, maxima: Tensor, *, normaliser: float = 1.0) -> dict[str, float]:
        """The step's loss (the summed losses over ``normaliser``: 1 when each was
        normalised already), each metric's token mean and each maximum (0 where no
        rank had a token), from :meth:`packed` summed and maximised over the
        data-parallel ranks."""
        loss, tokens, *totals = sums.tolist()
        means = {n: s / max(tokens, 1.0) for n, s in zip(sorted(self.sums), totals, strict=True)}
        tops = {n: m if m > -math.inf else 0.0 for n, m in zip(sorted(self.maxima), maxima.tolist(), strict=True)}
        return {"loss": loss / normaliser} | means | tops

    def reduce(self, parallel: Parallelism) -> dict[str, float]:
        """The step's loss, each metric's token mean and each maximum over the global
        batch (one collective over the data-parallel ranks)."""
        sums, maxima = self.packed()
        if not self.maxima:
            return self.unpack(parallel.all_reduce_dp(sums), maxima)
        return self.unpack(*parallel.sums_and_maxes_over_dp(sums, maxima))


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """An update between its preparation and its end: what its forwards and
    backwards need (the engine's ``train_step``, or a fused schedule of two engines)."""

    optimizer: torch.optim.Optimizer
    inputs: list[SequenceInputs]
    """Each micro-batch's model inputs."""
    micro_loss: Callable[[nn.Module, int], Tensor]
    """``(module, micro-batch) ->`` the micro-batch's scaled loss (records its metrics)."""
    stats: StepStats
    rows: int
    """The step's rows over the data-parallel ranks; this rank's when
    ``local_normaliser`` is set (the gradients' all-reduce sums them)."""
    local_normaliser: float | None = None
    """This rank's loss normaliser when the micro-batch losses are unnormalised and
    the global normaliser comes with the gradients' all-reduce (a replicated model:
    :meth:`Parallelism.normalise_gradients`); None when they are normalised already."""


@dataclasses.dataclass(frozen=True)
class AgreedPlan:
    """A step's micro-batches and what the data-parallel ranks agreed on with them."""

    micro_batches: list[Tensor]
    """This rank's rows of each micro-batch (as many micro-batches on every rank)."""
    total: float
    """The ranks' ``local_sum`` summed (e.g. the loss normaliser)."""
    rows: int
    """The ranks' rows summed."""
    longest: int
    """The longest row's tokens over the ranks (prompt and response)."""


def agreed_plan(planner: MicroBatchPlanner, lengths: Tensor, parallel: Parallelism,
                local_sum: Tensor, *, over_dp: bool = True) -> AgreedPlan:
    """The planner's micro-batches, their count agreed over the data-parallel ranks
    together with ``local_sum``'s and the rows' sums and the longest row, in one
    collective (:meth:`Parallelism.sums_and_maxes_over_dp`).

    Args:
        planner: the engine's micro-batch planner.
        lengths: ``[B, 2]`` this rank's real prompt and response tokens per row
            (:func:`~workers.engines._batch.row_lengths`).
        parallel: the engine's parallelism (its data-parallel group).
        local_sum: this rank's addend (a scalar), on the device the group's
            collectives run on (the engine's: NCCL takes no CPU tensor).
        over_dp: False: this rank's own plan, sums and longest row, without a
            collective (a replicated model's forwards need no agreement).
    """
    longest = float(lengths.sum(dim=1).max()) if len(lengths) else 0.0
    if not over_dp:
        alone = planner.plan(lengths, agree=lambda count: count)
        return AgreedPlan(micro_batches=alone, total=float(local_sum), rows=len(lengths), longest=int(longest))
    addend = torch.stack([local_sum.to(torch.float64).reshape(()),
                          local_sum.new_tensor(len(lengths), dtype=torch.float64)])
    agreed: list[tuple[Tensor, Tensor]] = []

    def agree(count: int) -> int:
        agreed.append(parallel.sums_and_maxes_over_dp(addend, addend.new_tensor([float(count), longest])))
        return int(agreed[-1][1][0])

    plan = planner.plan(lengths, agree=agree)
    if not agreed:  # a planner that needed no agreement
        agree(1)
    sums, maxes = agreed[0]
    return AgreedPlan(micro_batches=plan, total=float(sums[0]), rows=int(sums[1]), longest=int(maxes[1]))
