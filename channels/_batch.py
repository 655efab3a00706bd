"""``Batch``: named tensor columns that share their first (row) dimension.

This is what a worker method receives and returns. Row ``i`` of every column
belongs to the same sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from channels._errors import MissingFieldError, SchemaError
from channels._schema import FieldSpec


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


class Batch(Mapping[str, torch.Tensor]):
    """An immutable mapping of column name to tensor; every tensor has the same
    number of rows (its first dimension).

    Args:
        columns: name -> tensor with at least one dimension.
        group_size: rows come in consecutive groups of this size (e.g. the samples
            of one prompt) that data-parallel splits keep together.

    Raises:
        SchemaError: a value is not a tensor, is 0-d, or the row counts differ.
    """

    __slots__ = ("_columns", "_num_rows", "group_size")

    def __init__(self, columns: Mapping[str, torch.Tensor] | None = None, /, *, group_size: int = 1) -> None:
        cols = dict(columns or {})
        rows: int | None = None
        for name, t in cols.items():
            if not isinstance(t, torch.Tensor):
                raise SchemaError(f"column {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() == 0:
                raise SchemaError(f"column {name!r} is 0-d; columns need a row dimension")
            if rows is None:
                rows = t.shape[0]
            elif t.shape[0] != rows:
                raise SchemaError(
                    f"column {name!r} has {t.shape[0]} rows but the others have {rows}"
                )
        self._columns = cols
        self._num_rows = rows or 0
        if group_size < 1 or self._num_rows % group_size:
            raise SchemaError(f"{self._num_rows} rows do not form whole groups of {group_size}")
        self.group_size = group_size

    @classmethod
    def empty(cls, fields: Iterable[FieldSpec]) -> Batch:
        """A zero-row batch with the given columns."""
        return cls({f.name: torch.empty((0, *f.shape), dtype=getattr(torch, f.dtype)) for f in fields})

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._columns[name]
        except KeyError:
            raise MissingFieldError(
                f"field {name!r} is not in this batch (it has {list(self._columns)})"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {dtype_name(v.dtype)}{list(v.shape)}" for k, v in self._columns.items())
        return f"Batch(rows={self._num_rows}, {cols})"

    @property
    def num_rows(self) -> int:
        """Rows in the batch (0 for a batch with no columns)."""
        return self._num_rows

    @property
    def nbytes(self) -> int:
        """Payload bytes of every column."""
        return sum(t.numel() * t.element_size() for t in self._columns.values())

    def field_specs(self) -> tuple[FieldSpec, ...]:
        """Schema of the columns (dtype and per-row shape)."""
        return tuple(
            FieldSpec(name=k, dtype=dtype_name(v.dtype), shape=tuple(v.shape[1:]))
            for k, v in self._columns.items()
        )

    def select(self, names: Iterable[str]) -> Batch:
        """Only columns ``names`` (raises :class:`MissingFieldError` for an unknown one)."""
        return Batch({n: self[n] for n in names}, group_size=self.group_size)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of every column (views, no copy)."""
        return Batch({k: v[start:stop] for k, v in self._columns.items()})

    def take(self, index: Sequence[int]) -> Batch:
        """Rows ``index`` of every column, in that order (a copy; same groups).

        Each column is indexed on its own device: the index is built there, so a
        batch of accelerator tensors needs no CPU index (which CUDA refuses).
        """
        return Batch({k: v.index_select(0, torch.tensor(index, dtype=torch.int64, device=v.device))
                      for k, v in self._columns.items()}, group_size=self.group_size)

    def update(self, columns: Mapping[str, torch.Tensor]) -> Batch:
        """A new batch with ``columns`` added or replaced (same groups)."""
        return Batch({**self._columns, **columns}, group_size=self.group_size)

    def to_dict(self) -> dict[str, torch.Tensor]:
        """A plain dict of the columns."""
        return dict(self._columns)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of ``batches`` one after another (same columns and group size required).

        Raises:
            SchemaError: the batches have different columns or group sizes.
        """
        if not batches:
            return Batch()
        names = list(batches[0])
        for b in batches[1:]:
            if list(b) != names and set(b) != set(names):
                raise SchemaError(f"cannot concat batches with columns {names} and {list(b)}")
        sizes = {b.group_size for b in batches}
        if len(sizes) != 1:
            raise SchemaError(f"cannot concat batches with group sizes {sorted(sizes)}")
        if len(batches) == 1:
            return batches[0]
        return Batch({n: torch.cat([b[n] for b in batches]) for n in names}, group_size=sizes.pop())
