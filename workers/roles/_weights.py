"""The actor's weights as rows of a data future, and their assembly on the ranks of
a rollout role on another pool: weights travel like any other data, peer to peer
over the data plane, without passing through the driver.

:func:`weight_rows` gives, on the ranks of the first data-parallel replica, one row
per tensor-parallel rank: every parameter as a field holding that rank's shard (a
parameter every rank holds whole is cut into ``t`` parts of ``ceil(n / t)`` rows
along its first dimension, the last padded with zeros when ``t`` does not divide
``n``, so that the ``t`` rows together hold each byte once, plus padding), plus
:data:`WEIGHTS_VERSION`. Other ranks return no rows. :func:`assemble_weights`
concatenates the rows back into whole tensors on the receiving side, so a rollout
rank that pulls the future moves exactly the model's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from channels import ConfigError
from workers import WorkerContext

WEIGHTS_VERSION = "weights_version"
"""Field of a weights future: the actor's optimizer step count when it published them."""


def _tp_shard(param: Tensor) -> tuple[Tensor, bool]:
    """This rank's tensor-parallel shard of ``param`` and whether it is split; a
    parameter also sharded over data-parallel ranks (FSDP) is gathered over them first
    (collective over the data-parallel group; this path has no test yet: the tests
    publish tensor-parallel and replicated actors)."""
    if not isinstance(param, DTensor):
        return param.detach(), False
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    keep = [p if names and names[i] == "tp" else Replicate() for i, p in enumerate(param.placements)]
    if keep != list(param.placements):
        param = param.redistribute(mesh, keep)
    split = any(isinstance(p, Shard) for p in param.placements)
    return param.to_local().detach(), split


def _part(whole: Tensor, parts: int, index: int) -> Tensor:
    """Rows ``index * k .. (index + 1) * k - 1`` of ``whole`` (``k = ceil(n / parts)``),
    zero-padded to ``k`` rows."""
    rows = -(-whole.shape[0] // parts)
    piece = whole[index * rows:(index + 1) * rows]
    if piece.shape[0] == rows:
        return piece
    return torch.cat([piece, piece.new_zeros((rows - piece.shape[0], *whole.shape[1:]))])


def weight_rows(model: nn.Module, ctx: WorkerContext, *, version: int) -> dict[str, Tensor]:
    """This rank's rows of the weights future (see the module text).

    Collective over the model's data-parallel group when it is FSDP-sharded (not
    yet covered by a test).
    """
    c, t = ctx.coords, ctx.layout.t
    publish = c.dp == 0 and c.pp == 0
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        local, split = _tp_shard(param)
        if not split and t > 1:
            local = _part(local, t, c.tp)
        row = local.unsqueeze(0).cpu()
        out[name] = row if publish else row[:0]
    out[WEIGHTS_VERSION] = torch.tensor([version] if publish else [], dtype=torch.int64)
    return out


def assemble_weights(rows: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Tensor], int]:
    """Whole tensors from the rows of a weights future, and their version.

    Args:
        rows: the future's columns (``t`` rows each).
        shapes: the receiving model's parameter shapes by name.

    Raises:
        ConfigError: the future is not a weights future, its versions differ, or a
            parameter is missing or does not fit its shape.
    """
    if WEIGHTS_VERSION not in rows or rows[WEIGHTS_VERSION].numel() == 0:
        raise ConfigError(f"rollout.load_weights needs the rows of actor.weights() (a {WEIGHTS_VERSION!r} column); "
                          f"got fields {sorted(rows)}")
    versions = rows[WEIGHTS_VERSION].unique()
    if versions.numel() != 1:
        raise ConfigError(f"rollout.load_weights got rows of several weight versions {versions.tolist()}")
    out = {}
    for name, shape in shapes.items():
        column = rows.get(name)
        if column is None:
            raise ConfigError(f"rollout.load_weights: the weights lack parameter {name!r} of the rollout model")
        parts, local, want = column.shape[0], tuple(column.shape[1:]), tuple(shape)
        same_rank = len(local) == len(want)
        fits = [d for d in range(len(want)) if same_rank and local[d] * parts == want[d]
                and all(local[i] == want[i] for i in range(len(want)) if i != d)]
        if fits:  # tensor-parallel shards, or a whole parameter cut evenly
            out[name] = column[0] if parts == 1 else torch.cat(list(column), dim=fits[0])
        elif same_rank and want and local[0] == -(-want[0] // parts) and local[1:] == want[1:]:
            out[name] = torch.cat(list(column))[:want[0]]  # a whole parameter cut with padding
        else:
            raise ConfigError(f"rollout.load_weights: {parts} shards of {name!r} shaped {local} do not make its shape "
                              f"{want}")
    return out, int(versions.item())
