"""How a call's rows reach a role method on one rank and how its output leaves:
pulled pieces assembled into one batch, transforms applied, the output checked
against the method's declaration and made ready for the rank's shard store.

Where rows live (the device contract of the data plane):

- a role method receives its rows on the worker's device (``WorkerContext.device``:
  ``cuda:0`` on a GPU worker), pulled or local, and so does a transform;
- a method may return rows, stream chunks and tails on any device; the worker
  moves them to its *store device* before storing them: the worker's device when
  rows move between workers over NCCL (Ray Direct Transport sends CUDA tensors
  only), the CPU otherwise (gloo, the object store);
- rows handed in by the driver (``put``) are stored on the store device too;
- the driver's ``fetch`` receives CPU tensors (``WorkerProcess.slice_to_host``),
  whatever the store device: the driver may have no GPU.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from channels import (
    Batch,
    MissingFieldError,
    PullPlan,
    PullTiming,
    RankTiming,
    SchemaError,
    ShardStore,
    assemble,
)
from workers.host._register import Endpoint
from workers.host._role import CallScope, Role, WorkerContext, calling

BoundTransform = tuple[Any, Mapping[str, Any]]
"""A row transform bound to the keyword arguments of one ``map`` call, as it
travels to the rank that applies it: ``(function, kwargs)``."""


class Traced:
    """What a traced call records on its rank, on the rank's clock."""

    __slots__ = ("bytes_pulled", "cpu", "pulls", "rows_in", "start")

    def __init__(self) -> None:
        self.start = time.time()
        self.cpu = time.thread_time()
        self.pulls: list[PullTiming] = []
        self.rows_in = 0
        self.bytes_pulled = 0

    def timing(self) -> RankTiming:
        """The call's record, ending now."""
        return RankTiming(start=self.start, end=time.time(), rows_in=self.rows_in,
                          bytes_pulled=self.bytes_pulled, pulls=tuple(self.pulls),
                          cpu_s=time.thread_time() - self.cpu)


def gather(store: ShardStore, plan: PullPlan, fetched: Sequence[dict[str, torch.Tensor] | None], *,
           worker: int, device: torch.device, traced: Traced | None = None) -> Batch:
    """One data argument's rows on ``device``, in the plan's order.

    Args:
        store: this worker's shards (the pieces it holds are sliced from it).
        plan: which pieces make up the argument.
        fetched: per piece, its columns as pulled from another worker, or None for
            a piece of ``store``.
        worker: this worker's session-wide index (the source of local pieces).
        device: the worker's device.
        traced: records the pulls of a traced call.
    """
    parts = []
    received = 0
    for piece, got in zip(plan.pieces, fetched, strict=True):
        start = time.time() if traced is not None else 0.0
        if got is None:
            parts.append(store.slice(piece.key, piece.lo, piece.hi, piece.fields))
            size, source = 0, worker
        else:
            size, source = sum(t.numel() * t.element_size() for t in got.values()), piece.worker
            received += size
            parts.append(got)
        if traced is not None:
            traced.pulls.append(PullTiming(start=start, end=time.time(), source=source,
                                           rows=piece.hi - piece.lo, bytes=size))
    store.record_received(received)
    batch = assemble(plan, parts)
    if traced is not None:
        traced.rows_in = max(traced.rows_in, batch.num_rows)
        traced.bytes_pulled += received
    return on_device(batch, device)


def apply_transforms(role: Any, endpoint: Endpoint[Any, Any], method: str,
                     transforms: Sequence[BoundTransform], batch: Batch) -> Batch:
    """``batch`` with each transform's columns merged in, in order.

    Transforms may reduce over the call's rows on every rank (``current_call``);
    a role without a WorkerContext (not a :class:`Role`) gives them no call to
    reduce over.

    Raises:
        SchemaError: a transform returned something other than a mapping of columns.
    """
    if not transforms:
        return batch
    scope = None if not isinstance(role, Role) else CallScope(
        ctx=role.ctx, protocol=endpoint.spec.protocol, rank_local=method in role.rank_local())
    with calling(scope):
        for fn, kw in transforms:
            out = fn(batch, **kw)
            if not isinstance(out, Mapping):
                raise SchemaError(
                    f"transform {getattr(fn, '__qualname__', fn)!r} must return a mapping of columns, "
                    f"got {type(out).__name__}"
                )
            batch = batch.update(out)
    return batch


def as_rows(out: Any) -> Batch | None:
    """A method's output as rows, or None when it is a plain value."""
    if isinstance(out, Batch):
        return out
    if isinstance(out, Mapping) and out and all(isinstance(v, torch.Tensor) for v in out.values()):
        return Batch(out)
    return None


def check_returned_rows(where: str, endpoint: Endpoint[Any, Any], out: Any) -> None:
    """Raise :class:`MissingFieldError` (naming ``where``, ``role.method``) when a
    method that declares ``writes`` returned something other than rows (``None``: a
    ``return`` forgotten), which would give its consumers no rows."""
    if endpoint.spec.writes is None:
        return
    declared = endpoint.spec.writes
    fields = f"writes={list(declared)}" if isinstance(declared, tuple) else "writes"
    got = "None" if out is None else f"a {type(out).__name__}"
    if isinstance(out, Mapping):  # as_rows takes a non-empty one of tensors only
        odd = next(((k, v) for k, v in out.items() if not isinstance(v, torch.Tensor)), None)
        got += " (empty)" if odd is None else f" whose {odd[0]!r} is a {type(odd[1]).__name__}, not a tensor"
    raise MissingFieldError(f"{where} declares {fields} but returned {got}, not rows; return a Batch or a "
                            "dict of tensors with one row per input row")


def check_writes(where: str, endpoint: Endpoint[Any, Any], rows: Batch) -> None:
    """Raise :class:`MissingFieldError` (naming ``where``, ``role.method``) when
    ``rows`` lacks a field the method declares in ``writes``."""
    declared = endpoint.spec.writes
    if not isinstance(declared, tuple):
        return
    missing = [f for f in declared if f not in rows]
    if missing:
        raise MissingFieldError(f"{where} declares writes={list(declared)} but returned "
                                f"no {missing} (it returned {list(rows)})")


def row_lengths(endpoint: Endpoint[Any, Any], rows: Batch) -> tuple[int, ...] | None:
    """Each row's length by the method's ``row_lengths`` column (None: undeclared);
    the driver balances tokens across ranks with them."""
    if endpoint.spec.row_lengths is None:
        return None
    col = rows[endpoint.spec.row_lengths]
    per_row = col.flatten(start_dim=1).sum(dim=1) if col.dim() > 1 else col
    return tuple(int(x) for x in per_row.tolist())


def reports_rows(protocol: Any, ctx: WorkerContext | None) -> bool:
    """Whether this rank's streamed rows are the call's: the output rank of its
    replica under a replicated protocol (``DP``, ``MicroDP``); the replica's other
    ranks (tensor-parallel copies of the same rows) report progress only."""
    replicas = getattr(protocol, "replicas", None)
    return replicas is None or ctx is None or bool(replicas(ctx.layout)[ctx.rank][1])


def for_store(rows: Batch, device: torch.device) -> Batch:
    """``rows`` detached, on the store device ``device``."""
    return on_device(Batch({k: v.detach() for k, v in rows.items()}, group_size=rows.group_size), device)


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every column on ``device`` (the same object when they are).

    Copies to an accelerator do not block the host; copies to the CPU do (a
    non-blocking copy to the host may be read before it lands)."""
    if all(t.device == device for t in batch.values()):
        return batch
    non_blocking = device.type != "cpu"
    return Batch({k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()},
                 group_size=batch.group_size)
