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
rank that pulls the future moves exactly the model's bytes; :func:`weight_buckets`
splits the parameters into bounded buckets that are pulled one call each.

A rollout role laid out tensor parallel (``t > 1``) needs only its own shard of
each split parameter: pulled with :class:`~channels.TensorShards`, its rank ``j``
receives just the rows that make that shard and :func:`assemble_shards` joins
(or cuts) them; parameters it holds whole it pulls whole.

The rows are a snapshot of the publishing ranks' shards (a copy in host memory),
held until the last future naming them is dropped: a pull that comes after the
actor's next optimizer step still gets the published version. Copy-on-write (no
copy unless a step comes before the pull) is planned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from channels import ConfigError, FieldSpec
from workers._dtensor import is_dtensor
from workers.host import WorkerContext

WEIGHTS_VERSION = "weights_version"
"""Field of a weights future: the actor's optimizer step count when it published them."""


@runtime_checkable
class TensorParallelShards(Protocol):
    """A model whose parameters are not its Hugging Face parameters (the Megatron
    engine's: fused, padded, renamed): it gives its tensor-parallel shards by Hugging
    Face names itself, laid out as the native engine's tensor parallelism lays them."""

    def named_tp_shards(self) -> Iterator[tuple[str, Tensor, bool]]:
        """``(hf_name, this rank's tensor, split)`` per parameter (collective over
        the tensor-parallel group); ``split``: a part of a split parameter, else whole."""
        ...


def _named_shards(model: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """Every parameter's name, this rank's tensor-parallel shard and whether it is split."""
    if isinstance(model, TensorParallelShards):
        yield from model.named_tp_shards()
        return
    for name, param in model.named_parameters():
        yield name, *_tp_shard(param)


def _tp_shard(param: Tensor) -> tuple[Tensor, bool]:
    """This rank's tensor-parallel shard of ``param`` and whether it is split; a
    parameter also sharded over data-parallel ranks (FSDP) is gathered over them first
    (collective over the data-parallel group; this path has no test yet: the tests
    publish tensor-parallel and replicated actors)."""
    if not is_dtensor(param):
        return param.detach(), False
    from torch.distributed.tensor import Replicate  # imported already: param is a DTensor

    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    keep = [p if names and names[i] == "tp" else Replicate() for i, p in enumerate(param.placements)]
    if keep != list(param.placements):
        param = param.redistribute(mesh, keep)
    split = any(p.is_shard() for p in param.placements)
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
    yet covered by a test), and over its tensor-parallel group for a model that
    gives its shards itself (:class:`TensorParallelShards`).
    """
    c, t = ctx.coords, ctx.layout.t
    publish = c.dp == 0 and c.pp == 0
    out: dict[str, Tensor] = {}
    for name, local, split in _named_shards(model):
        if not split and t > 1:
            local = _part(local, t, c.tp)
        # A snapshot, not a view: the rows may be pulled after the next optimizer
        # step has changed the parameters in place (a rollout pool pulls them when
        # it gets to its load, behind the generations queued before it).
        row = local.unsqueeze(0).to("cpu", copy=True)
        out[name] = row if publish else row[:0]
    out[WEIGHTS_VERSION] = torch.tensor([version] if publish else [], dtype=torch.int64)
    return out


def weight_buckets(fields: Sequence[FieldSpec], *, rows: int, bucket_bytes: int) -> list[tuple[str, ...]]:
    """The parameters of a weights future in buckets of at most ``bucket_bytes``
    (over all ``rows``), in the future's order; a parameter larger than a bucket
    is a bucket of its own. :data:`WEIGHTS_VERSION` is in none (every bucket
    carries it).

    Args:
        fields: the future's columns (``BatchMeta.fields``).
        rows: the future's rows (the publishing ranks).
        bucket_bytes: the most bytes a bucket moves (> 0).
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"weight buckets need bucket_bytes > 0, got {bucket_bytes}")
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for f in fields:
        if f.name == WEIGHTS_VERSION:
            continue
        nbytes = f.row_bytes() * rows
        if current and size + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(f.name)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return buckets


def assemble_weights(rows: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]], *,
                     partial: bool = False) -> tuple[dict[str, Tensor], int]:
    """Whole tensors from the rows of a weights future, and their version.

    Args:
        rows: the future's columns (``t`` rows each).
        shapes: the receiving model's parameter shapes by name.
        partial: the rows may hold some of the parameters (a bucket): those are
            assembled; without it every parameter must be there.

    Raises:
        ConfigError: the future is not a weights future, its versions differ, or a
            parameter is missing (unless ``partial``), unknown, or does not fit its shape.
    """
    version = _checked(rows, shapes, "rollout.load_weights", "parameters")
    out = {}
    for name, shape in shapes.items():
        column = rows.get(name)
        if column is None:
            if partial:
                continue
            raise ConfigError(f"rollout.load_weights: the weights lack parameter {name!r} of the rollout model")
        out[name] = _whole(name, column, tuple(shape))
    return out, version


def _whole(name: str, column: Tensor, want: tuple[int, ...]) -> Tensor:
    """Parameter ``name`` of shape ``want`` from its ``t`` rows."""
    parts, local = column.shape[0], tuple(column.shape[1:])
    same_rank = len(local) == len(want)
    fits = [d for d in range(len(want)) if same_rank and local[d] * parts == want[d]
            and all(local[i] == want[i] for i in range(len(want)) if i != d)]
    if fits:  # tensor-parallel shards, or a whole parameter cut evenly
        return column[0] if parts == 1 else torch.cat(list(column), dim=fits[0])
    if same_rank and want and local[0] == -(-want[0] // parts) and local[1:] == want[1:]:
        return torch.cat(list(column))[:want[0]]  # a whole parameter cut with padding
    raise ConfigError(f"rollout.load_weights: {parts} shards of {name!r} shaped {local} do not make its shape "
                      f"{want}")


def local_shard(whole: Tensor, dim: int, index: int, parts: int) -> Tensor:
    """Part ``index`` of ``parts`` equal parts of ``whole`` along ``dim``.

    Raises:
        ConfigError: ``parts`` does not divide the size of ``dim``.
    """
    size = whole.shape[dim]
    if size % parts:
        raise ConfigError(f"a parameter of shape {tuple(whole.shape)} cannot be split in {parts} along dim {dim}")
    return whole.narrow(dim, index * (size // parts), size // parts)


def assemble_shards(rows: Mapping[str, Tensor], shards: Mapping[str, tuple[tuple[int, ...], int]], *,
                    index: int, parts: int) -> tuple[dict[str, Tensor], int]:
    """This rank's tensor-parallel shards from the rows :class:`~channels.TensorShards`
    gave it, and their version.

    Args:
        rows: the received columns: ``m`` consecutive of the ``R`` published shard
            rows (``m = R / parts``), or one row that holds ``parts / R`` of this
            rank's shards (``index`` picks one of them).
        shards: the split parameters to assemble: name -> (local shape, split dim).
        index: this rank's tensor coordinate.
        parts: the tensor size (``t``) of the receiving layout.

    Raises:
        ConfigError: the rows are not a weights future, a parameter is unknown, or
            the rows of one do not make its shard.
    """
    version = _checked(rows, shards, "rollout.load_weight_shards", "split parameters")
    out = {}
    for name, column in rows.items():
        if name == WEIGHTS_VERSION:
            continue
        want, dim = shards[name]
        joined = column[0] if column.shape[0] == 1 else torch.cat(list(column), dim=dim)
        have = tuple(joined.shape)
        if have != want:
            ok = len(have) == len(want) and have[dim] % want[dim] == 0 and all(
                have[i] == want[i] for i in range(len(want)) if i != dim)
            if not ok:
                raise ConfigError(f"rollout.load_weight_shards: {column.shape[0]} rows of {name!r} shaped "
                                  f"{tuple(column.shape[1:])} do not make its shard {want} along dim {dim}")
            pieces = have[dim] // want[dim]
            joined = local_shard(joined, dim, index % pieces, pieces)
        out[name] = joined
    return out, version


def _checked(rows: Mapping[str, Tensor], known: Mapping[str, object], where: str, what: str) -> int:
    """The version of the rows of a weights future, all of whose columns but the
    version are ``known`` parameters (``what`` and ``where`` name them in the error)."""
    if WEIGHTS_VERSION not in rows or rows[WEIGHTS_VERSION].numel() == 0:
        raise ConfigError(f"{where} needs the rows of actor.weights() (a {WEIGHTS_VERSION!r} column); "
                          f"got fields {sorted(rows)}")
    versions = rows[WEIGHTS_VERSION].unique()
    if versions.numel() != 1:
        raise ConfigError(f"{where} got rows of several weight versions {versions.tolist()}")
    unknown = sorted(set(rows) - set(known) - {WEIGHTS_VERSION})
    if unknown:
        raise ConfigError(f"{where}: {unknown[:3]} are not {what} of the rollout model")
    return int(versions.item())
