"""The rows' own columns as a reward function sees them: one Python value per row.

Rows carry tensors only, so text travels in one of two encodings, and every
column a reward function gets is turned back into Python values here:

- ``<name>_ids``: int64 ``[B, L]`` token ids of the policy's tokenizer,
  right-padded with the pad id (as ``answer_ids``) -> a ``str`` column ``<name>``
  (special tokens and padding dropped; unknown ids as in :func:`decode_ids`);
- a uint8 ``[B, L]`` column ``<name>``: UTF-8 bytes right-padded with zero bytes
  (:func:`text_column` writes it; any text, whatever the tokenizer's alphabet) ->
  a ``str`` column ``<name>``;
- a ``[B]`` column: one Python number per row (``bool``, ``int`` or ``float``,
  after the dtype);
- any other shape: ``tensor[i].tolist()`` per row (nested lists).

When both ``<name>`` and ``<name>_ids`` are present, ``<name>`` (the exact text) wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from channels import SchemaError
from workers.rewards._decode import Decoder, decode_rows

TOKEN_SUFFIX = "_ids"
"""A column ``<name>_ids`` holds token ids, decoded into the text column ``<name>``."""


def text_column(texts: Sequence[str], *, width: int | None = None) -> Tensor:
    """Encode texts as a uint8 ``[B, L]`` column (UTF-8, right-padded with zero bytes),
    the tokenizer-free way to carry text such as a reference solution with the prompts.

    Args:
        texts: one string per row (without NUL characters).
        width: ``L``; by default the longest encoding (at least 1). Give a data set's
            longest so that all its batches have the same column width.

    Returns:
        ``[len(texts), L]`` uint8.

    Raises:
        SchemaError: a text holds a NUL character (it would read as padding), or its
            encoding is longer than ``width``.
    """
    encoded = [t.encode("utf-8") for t in texts]
    for i, b in enumerate(encoded):
        if b"\0" in b:
            raise SchemaError(f"text_column: text {i} holds a NUL character, which reads as padding; remove it")
    longest = max((len(b) for b in encoded), default=0)
    if width is None:
        width = longest or 1
    elif longest > width:
        raise SchemaError(f"text_column: text {max(range(len(encoded)), key=lambda i: len(encoded[i]))} takes "
                          f"{longest} bytes in UTF-8, more than the column's width of {width}")
    out = torch.zeros(len(encoded), width, dtype=torch.uint8)
    for i, b in enumerate(encoded):
        if b:
            out[i, : len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return out


def _texts(column: Tensor) -> list[str]:
    return [bytes(row).rstrip(b"\0").decode("utf-8", errors="replace") for row in column.cpu().tolist()]


def _values(column: Tensor) -> list[Any]:
    values = column.detach().cpu()
    if values.dim() == 1:
        if values.dtype == torch.bool:
            return [bool(v) for v in values.tolist()]
        if values.dtype.is_floating_point:
            return [float(v) for v in values.tolist()]
    return list(values.tolist())


def row_columns(columns: Mapping[str, Tensor], decoder: Decoder) -> dict[str, list[Any]]:
    """The columns as per-row Python values, under the names reward functions use.

    Args:
        columns: ``[B, ...]`` tensors by field name (the rows' non-token columns).
        decoder: the tokenizer that decodes ``<name>_ids`` columns.

    Returns:
        ``{name: [value of row 0, value of row 1, ...]}`` (see the module docstring).

    Raises:
        SchemaError: a ``<name>_ids`` column is not an integer ``[B, L]`` tensor.
    """
    out: dict[str, list[Any]] = {}
    for name, column in columns.items():
        if name.endswith(TOKEN_SUFFIX) and len(name) > len(TOKEN_SUFFIX):
            text_name = name[: -len(TOKEN_SUFFIX)]
            if text_name in columns:
                continue  # the exact text wins
            if column.dim() != 2 or column.dtype.is_floating_point or column.dtype == torch.bool:
                raise SchemaError(f"column {name!r} must hold int64 [rows, tokens] token ids (right-padded "
                                  f"with the pad id), got {column.dtype} of shape {tuple(column.shape)}; "
                                  f"rename it if it is not text")
            out[text_name] = decode_rows(decoder, column.cpu().tolist(), strip_pad=True)
        elif column.dtype == torch.uint8 and column.dim() == 2:
            out[name] = _texts(column)
        else:
            out[name] = _values(column)
    return out
