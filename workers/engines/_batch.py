"""Training sequences and micro-batches: from a rollout batch to model inputs.

A batch is a mapping of tensors with one row per sample. Four fields form the
sequence (the rollout engines' convention): ``prompt_ids``/``prompt_mask`` ``[B, P]``
left-padded and ``response_ids``/``response_mask`` ``[B, R]`` right-padded; the model
sees ``prompt ++ response`` with ``position_ids = cumsum(mask) - 1``. Every other field
is indexed by row only. Micro-batch planners decide which rows go together; the
planners agree on a micro-batch count across data-parallel ranks, because every
FSDP forward is a collective.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from workers.engines._errors import EngineConfigError

SEQUENCE_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""Fields every batch must hold."""

OBSERVATION_MASK = "observation_mask"
"""Optional ``[B, R]`` field: 1 on response tokens the model reads but did not sample
(a multi-turn episode's observations). The model attends to them; they carry no
log-prob, loss or metric (``response_mask`` is 0 there)."""


def check_batch(batch: Mapping[str, Tensor], required: tuple[str, ...] = ()) -> int:
    """Check that ``batch`` holds the sequence fields and ``required`` with matching rows.

    Args:
        batch: the batch tensors.
        required: further fields the caller reads (e.g. a loss's ``required_fields``).

    Returns:
        The number of rows.

    Raises:
        EngineConfigError: naming the first missing or mis-shaped field.
    """
    for name in (*SEQUENCE_FIELDS, *required):
        if name not in batch:
            raise EngineConfigError(
                f"batch lacks field {name!r} (has {sorted(batch)}); add it before this call"
            )
    rows = batch["prompt_ids"].shape[0]
    for name, value in batch.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] != rows:
            raise EngineConfigError(
                f"batch field {name!r} has {value.shape[0]} rows, prompt_ids has {rows}"
            )
    for ids, mask in (("prompt_ids", "prompt_mask"), ("response_ids", "response_mask")):
        if batch[ids].shape != batch[mask].shape:
            raise EngineConfigError(
                f"batch field {mask!r} has shape {tuple(batch[mask].shape)}, "
                f"but {ids!r} has {tuple(batch[ids].shape)}"
            )
    if rows and bool((batch["prompt_mask"].sum(dim=1) == 0).any()):
        raise EngineConfigError("batch field 'prompt_mask' has a row without prompt tokens")
    return rows


def select_rows(batch: Mapping[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The sub-batch of the given row indices.

    Args:
        batch: the batch tensors.
        rows: 1-D int64 row indices.

    Returns:
        A new mapping with every tensor field indexed by ``rows``.
    """
    return {
        name: value.index_select(0, rows.to(value.device)) if value.dim() > 0 else value
        for name, value in batch.items()
    }


def dummy_row(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One synthetic row shaped like ``batch``'s columns, for a rank without rows.

    Such a rank still runs every forward (and backward) its data-parallel peers run,
    because FSDP's all-gathers and reduce-scatters are collective. The row is all
    zeros (token id 0) except one real prompt token, so that attention has a key and
    the forward stays finite; its response mask is all zero, so it carries no output,
    loss or metric. Columns of width 0 get width 1 (a model input needs a column).

    Args:
        batch: any batch with the sequence fields, possibly with 0 rows.

    Returns:
        A 1-row batch with the same fields and dtypes.
    """
    row: dict[str, Tensor] = {}
    for name, value in batch.items():
        if value.dim() == 0:
            row[name] = value
            continue
        shape = list(value.shape)
        shape[0] = 1
        if len(shape) > 1 and shape[1] == 0:
            shape[1] = 1
        row[name] = value.new_zeros(shape)
    row["prompt_mask"][:, -1] = 1
    return row


def token_counts(batch: Mapping[str, Tensor]) -> Tensor:
    """Real (unpadded) tokens per row: prompt plus response.

    Args:
        batch: the batch tensors.

    Returns:
        ``[B]`` int64 counts (on the CPU).
    """
    counts = batch["prompt_mask"].sum(dim=1) + _seen(batch).sum(dim=1)
    return counts.to("cpu", torch.int64)


def _seen(batch: Mapping[str, Tensor]) -> Tensor:
    """``[B, R]`` 1 on the response tokens the model reads: sampled ones and
    observations (:data:`OBSERVATION_MASK`)."""
    mask = batch["response_mask"]
    observed = batch.get(OBSERVATION_MASK)
    return mask if observed is None else (mask.bool() | observed.bool()).to(mask.dtype)


@dataclass(frozen=True, kw_only=True)
class SequenceInputs:
    """Model inputs for some rows, trimmed to the columns any of them uses."""

    input_ids: Tensor
    """``[b, P' + R']`` prompt ++ response token ids."""
    attention_mask: Tensor
    """``[b, P' + R']`` 1 on real tokens."""
    position_ids: Tensor
    """``[b, P' + R']`` ``cumsum(attention_mask) - 1`` clamped at 0."""
    response_ids: Tensor
    """``[b, R']`` the response tokens whose log-probs are wanted."""
    prompt_width: int
    """P': prompt columns kept (the leading all-padding columns are dropped)."""
    response_width: int
    """R': response columns kept (the trailing all-padding columns are dropped)."""


def build_inputs(batch: Mapping[str, Tensor]) -> SequenceInputs:
    """Concatenate prompt and response, dropping columns that are padding in every row.

    Dropping them changes no result (they are masked out) and saves the compute.

    Args:
        batch: the rows of one micro-batch (sequence fields required).

    Returns:
        The trimmed model inputs.
    """
    prompt_used = batch["prompt_mask"].bool().any(dim=0).nonzero()
    left = int(prompt_used[0]) if prompt_used.numel() else batch["prompt_mask"].shape[1] - 1
    seen = _seen(batch)
    response_used = seen.bool().any(dim=0).nonzero()
    width = int(response_used[-1]) + 1 if response_used.numel() else 1
    response_ids = batch["response_ids"][:, :width]
    input_ids = torch.cat([batch["prompt_ids"][:, left:], response_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"][:, left:], seen[:, :width]], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return SequenceInputs(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_ids=response_ids,
        prompt_width=batch["prompt_mask"].shape[1] - left,
        response_width=width,
    )


def pad_columns(values: Tensor, width: int) -> Tensor:
    """Right-pad ``[b, R']`` with zeros back to ``[b, width]``.

    Args:
        values: per-token results over the trimmed response columns.
        width: the batch's response width R.

    Returns:
        ``[b, width]``.
    """
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


Agree = Callable[[int], int]
"""Returns the largest of the given count over the data-parallel ranks (identity without DP)."""


class MicroBatchPlanner(Protocol):
    """Splits a batch's rows into micro-batches."""

    def plan(self, tokens: Tensor, *, agree: Agree) -> list[Tensor]:
        """Row indices of each micro-batch.

        Args:
            tokens: ``[B]`` real tokens per row.
            agree: makes the count equal on every data-parallel rank (see :data:`Agree`).

        Returns:
            The same number of index tensors on every rank; some may be empty when a
            rank has fewer rows than another needs micro-batches.
        """
        ...


@dataclass(frozen=True, kw_only=True)
class FixedSizeMicroBatches:
    """``size`` rows per micro-batch (the last may have fewer), rows of similar
    length together.

    A micro-batch runs as wide as its longest row (:func:`build_inputs` trims it to
    that), so the rows go in order of their token counts, the shortest first (ties
    in row order): the same rows and count of micro-batches as in row order, with
    less padding where lengths vary. The gradient is the same sum (each micro-batch's
    loss is normalised over the whole batch), in another order.
    """

    size: int
    """Rows per micro-batch."""

    def plan(self, tokens: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        rows = tokens.shape[0]
        count = agree(max(1, math.ceil(rows / self.size)))
        chunks = list(torch.argsort(tokens, stable=True).split(self.size))
        empty = torch.zeros(0, dtype=torch.int64)
        return chunks + [empty] * (count - len(chunks))


def _balance(tokens: list[int], bins: int) -> list[list[int]]:
    """Longest-processing-time-first assignment of rows to ``bins`` bins."""
    heap = [(0, b) for b in range(bins)]
    assignment: list[list[int]] = [[] for _ in range(bins)]
    for row in sorted(range(len(tokens)), key=lambda r: (-tokens[r], r)):
        load, b = heapq.heappop(heap)
        assignment[b].append(row)
        heapq.heappush(heap, (load + tokens[row], b))
    return [sorted(rows) for rows in assignment]


@dataclass(frozen=True, kw_only=True)
class TokenBalancedMicroBatches:
    """As few micro-batches as keep each under ``max_tokens`` real tokens, balanced.

    A row longer than ``max_tokens`` gets a micro-batch of its own.
    """

    max_tokens: int
    """Most real tokens per micro-batch."""

    def plan(self, tokens: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        counts = [int(t) for t in tokens]
        # Never more bins than rows: an over-long row already gets a bin of its own.
        bins = max(1, min(len(counts), math.ceil(sum(counts) / self.max_tokens)))
        while bins < len(counts):
            loads = [sum(counts[r] for r in rows) for rows in _balance(counts, bins)]
            if max(loads) <= self.max_tokens:
                break
            bins += 1
        bins = agree(bins)
        return [torch.tensor(rows, dtype=torch.int64) for rows in _balance(counts, bins)]


@dataclass(frozen=True, kw_only=True)
class WholeBatch:
    """The whole batch as one micro-batch (no gradient accumulation)."""

    def plan(self, tokens: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        count = agree(1)
        empty = torch.zeros(0, dtype=torch.int64)
        return [torch.arange(tokens.shape[0])] + [empty] * (count - 1)
