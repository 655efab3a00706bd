"""What a scorer reads: the token tensors of a batch of samples, independent of field names.

The reward roles (``workers.roles``) fill a :class:`ScoreInputs` from the batch
fields of the data contract; keeping the scorers free of field names lets them be
used (and tested) without any role or runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import Protocol

from torch import Tensor

from channels import SchemaError


@dataclass(frozen=True, kw_only=True)
class ScoreInputs:
    """One batch of samples to score (row ``i`` of every tensor is sample ``i``)."""

    prompt_ids: Tensor
    """``[B, P]`` int64 prompt tokens, left-padded."""
    prompt_mask: Tensor
    """``[B, P]`` int64, 1 on real prompt tokens."""
    response_ids: Tensor
    """``[B, R]`` int64 response tokens, right-padded (EOS included when generated)."""
    response_mask: Tensor
    """``[B, R]`` int64, 1 on generated tokens."""
    answer_ids: Tensor | None = None
    """``[B, A]`` int64 reference answers, right-padded with the pad id (rule rewards)."""
    uids: Tensor | None = None
    """``[B]`` int64 prompt ids, quoted in error messages."""
    columns: Mapping[str, Tensor] = field(default_factory=dict)
    """``[B, ...]`` the rows' other columns by field name (user columns such as a
    ``solution`` or ``difficulty``), passed to rule reward functions by keyword (see
    :func:`workers.rewards.row_columns` for how each is read)."""

    def __post_init__(self) -> None:
        rows = self.prompt_ids.shape[0]
        named = [(name, getattr(self, name))
                 for name in ("prompt_mask", "response_ids", "response_mask", "answer_ids", "uids")]
        for name, value in [*named, *((f"columns[{k!r}]", v) for k, v in self.columns.items())]:
            if value is not None and value.shape[0] != rows:
                raise SchemaError(
                    f"ScoreInputs.{name} has {value.shape[0]} rows but prompt_ids has {rows}"
                )

    @property
    def num_rows(self) -> int:
        """Samples in the batch."""
        return int(self.prompt_ids.shape[0])

    def uid(self, row: int) -> int | None:
        """The prompt id of sample ``row``, when known."""
        return None if self.uids is None else int(self.uids[row].reshape(-1)[0])


class Scorer(Protocol):
    """Turns samples into one float32 score each (a reward or a cost)."""

    def __call__(self, inputs: ScoreInputs) -> Tensor:
        """Score every sample.

        Args:
            inputs: the samples.

        Returns:
            ``[B]`` float32 scores.
        """
        ...


def masked_token_lists(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """The real tokens of each row (where ``mask`` is non-zero), in order: a prompt's
    without its left padding, a response's without its right padding.

    Args:
        ids: ``[B, L]`` token ids.
        mask: ``[B, L]``, 1 on real tokens.

    Returns:
        One list of token ids per row.
    """
    # Two reads to the host and a filter in C: a row's mask applied as a tensor costs
    # two tensor operations per row (0.3 ms for 32 rows, against 0.05).
    return [list(compress(row, keep)) for row, keep in zip(ids.tolist(), mask.tolist(), strict=True)]
