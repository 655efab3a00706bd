"""Packing many small column sets into a few flat tensors for one transfer.

A transfer between workers (over gloo, ``workers.host._pulls``, or Ray Direct
Transport over NCCL) moves every tensor separately; the pieces a consumer pulls
from one producer (one per micro-batch and column after a stream) would each cost
a message. :func:`pack` flattens them into one
contiguous buffer per dtype, :func:`unpack` restores views of the originals on
the receiving side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import torch


class PackedColumn(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where one column lies in its dtype's buffer."""

    name: str
    dtype: str
    offset: int
    shape: tuple[int, ...]


class Packed(msgspec.Struct, frozen=True, kw_only=True):
    """Column sets flattened into one buffer per dtype (tensors beside the struct)."""

    layout: tuple[tuple[PackedColumn, ...], ...]
    """Per column set, its columns."""


def pack(sets: Sequence[Mapping[str, torch.Tensor]]) -> tuple[Packed, dict[str, torch.Tensor]]:
    """``sets`` as a layout and one flat buffer per dtype."""
    chunks: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    layout = []
    for columns in sets:
        placed = []
        for name, t in columns.items():
            dtype = str(t.dtype).removeprefix("torch.")
            flat = t.detach().reshape(-1)
            placed.append(PackedColumn(name, dtype, sizes.get(dtype, 0), tuple(t.shape)))
            chunks.setdefault(dtype, []).append(flat)
            sizes[dtype] = sizes.get(dtype, 0) + flat.numel()
        layout.append(tuple(placed))
    buffers = {d: torch.cat(ts) if len(ts) > 1 else ts[0].contiguous() for d, ts in chunks.items()}
    return Packed(layout=tuple(layout)), buffers


def unpack(packed: Packed, buffers: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The column sets :func:`pack` flattened (views of ``buffers``)."""
    out = []
    for placed in packed.layout:
        columns = {}
        for c in placed:
            n = 1
            for d in c.shape:
                n *= d
            columns[c.name] = buffers[c.dtype][c.offset:c.offset + n].view(c.shape)
        out.append(columns)
    return out
