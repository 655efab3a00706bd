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

import itertools
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


def row_lengths(batch: Mapping[str, Tensor]) -> Tensor:
    """Each row's real (unpadded) tokens: its prompt's and its response's (sampled
    and observed).

    Args:
        batch: the batch tensors.

    Returns:
        ``[B, 2]`` int64 lengths (on the CPU): prompt, response.
    """
    lengths = torch.stack([batch["prompt_mask"].sum(dim=1), _seen(batch).sum(dim=1)], dim=1)
    return lengths.to("cpu", torch.int64)


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
    dense: bool = False
    """No kept column is padding in any row: every row's positions are ``0 .. P' + R' - 1``."""


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
        dense=bool(attention_mask.all()),
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

    def plan(self, lengths: Tensor, *, agree: Agree) -> list[Tensor]:
        """Row indices of each micro-batch.

        Args:
            lengths: ``[B, 2]`` each row's real prompt and response tokens
                (:func:`row_lengths`).
            agree: makes the count equal on every data-parallel rank (see :data:`Agree`).

        Returns:
            The same number of index tensors on every rank; some may be empty when a
            rank has fewer rows than another needs micro-batches.
        """
        ...


def _shortest_first(lengths: Tensor) -> tuple[list[int], list[int]]:
    """The rows in order of their tokens, the shortest first (ties in row order), and
    their tokens in that order."""
    tokens, order = torch.sort(lengths.sum(dim=1), stable=True)
    return order.tolist(), tokens.tolist()


def _padded_to(count: int, micro_batches: list[Tensor]) -> list[Tensor]:
    """``micro_batches`` and as many empty ones as make ``count``."""
    return micro_batches + [torch.zeros(0, dtype=torch.int64)] * (count - len(micro_batches))


@dataclass(frozen=True, kw_only=True)
class FixedSizeMicroBatches:
    """``size`` rows per micro-batch (one has fewer where ``size`` does not divide
    the rows), rows of similar length together.

    A micro-batch runs as wide as its widest prompt plus its longest response
    (:func:`build_inputs` trims it to that), so the rows go in order of their
    tokens, the shortest first, and the smaller micro-batch goes where it pads
    least: of every split of the rows into micro-batches of these sizes, the one
    with the fewest padded tokens (counting a row's prompt and response together).
    The same rows and count of micro-batches as in row order; the gradient is the
    same sum (each micro-batch's loss is normalised over the whole batch), in
    another order.
    """

    size: int
    """Rows per micro-batch."""

    def plan(self, lengths: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        rows, size = lengths.shape[0], self.size
        count = agree(max(1, math.ceil(rows / size)))
        order, tokens = _shortest_first(lengths)
        full, rest = divmod(rows, size)
        smaller_at = full  # the smaller micro-batch's place among the others (last: as in row order)
        if rest:
            # With it at place k the micro-batches before it end at size * (i + 1), those
            # after it at size * (i + 1) + rest; each pads to its last (longest) row.
            # Ties keep it last.
            before = [0, *itertools.accumulate(size * tokens[size * (i + 1) - 1] for i in range(full))]
            after = [*itertools.accumulate((size * tokens[size * (i + 1) + rest - 1] for i in reversed(range(full))),
                                           initial=0)][::-1]
            smaller_at = min(range(full, -1, -1),
                             key=lambda k: before[k] + rest * tokens[size * k + rest - 1] + after[k])
        sizes = [size] * full
        if rest:
            sizes.insert(smaller_at, rest)
        ends = list(itertools.accumulate(sizes))
        return _padded_to(count, [torch.tensor(order[begin:end], dtype=torch.int64)
                                  for begin, end in itertools.pairwise([0, *ends])])


@dataclass(frozen=True, kw_only=True)
class TokenBudgetMicroBatches:
    """As few micro-batches as keep each within ``max_tokens`` tokens as it runs:
    its rows times its widest prompt plus its longest response (the width
    :func:`build_inputs` gives it, padding included, which is what its forward
    computes and holds).

    Rows go in order of their tokens, the shortest first, each micro-batch taking
    as many as fit: of the ways to cut that order into micro-batches within the
    budget, the fewest. A row wider than ``max_tokens`` runs alone.
    """

    max_tokens: int
    """Most tokens per micro-batch, padding included."""

    def plan(self, lengths: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        pairs = lengths.tolist()
        micro_batches: list[list[int]] = []
        prompt = response = 0
        for row in _shortest_first(lengths)[0]:
            p, r = pairs[row]
            rows = len(micro_batches[-1]) if micro_batches else 0
            if rows and (rows + 1) * (max(prompt, p) + max(response, r)) <= self.max_tokens:
                micro_batches[-1].append(row)
                prompt, response = max(prompt, p), max(response, r)
            else:
                micro_batches.append([row])
                prompt, response = p, r
        count = agree(max(1, len(micro_batches)))
        return _padded_to(count, [torch.tensor(rows, dtype=torch.int64) for rows in micro_batches])


@dataclass(frozen=True, kw_only=True)
class WholeBatch:
    """The whole batch as one micro-batch (no gradient accumulation)."""

    def plan(self, lengths: Tensor, *, agree: Agree) -> list[Tensor]:
        """See :meth:`MicroBatchPlanner.plan`."""
        return _padded_to(agree(1), [torch.arange(lengths.shape[0])])
