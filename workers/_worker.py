"""The worker process: one Ray actor per (pool, rank), hosting role objects.

Two Ray concurrency groups keep the data plane responsive: ``compute`` (one thread:
role methods run one at a time, in the order the driver submits them) and ``io``
(serving slices of stored rows, freeing shards, statistics), so a consumer can pull
rows this worker produced while it computes something else.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import msgspec
import ray
import torch
import torch.distributed as dist

from channels import (
    Batch,
    ConfigError,
    Layout,
    MissingFieldError,
    RankResult,
    SchemaError,
    ShardStore,
    StoreStats,
    assemble,
)
from workers._call import CallSpec
from workers._register import Endpoint, endpoints
from workers._role import WorkerContext

logger = logging.getLogger(__name__)

CONCURRENCY_GROUPS = {"io": 4, "compute": 1}
"""Ray concurrency groups of :class:`WorkerProcess`."""

Transform = tuple[Any, Mapping[str, Any]]
"""A transform function and its keyword arguments."""


class WorkerProcess:
    """Hosts the roles of one rank of one pool. Created by the control plane with
    ``ray.remote(concurrency_groups=CONCURRENCY_GROUPS)``.

    Args:
        index: session-wide worker index (also its rank in the session's process group).
        pool: the pool's name.
        rank: rank within the pool.
        pool_size: ranks in the pool.
        world: workers in the session.
        device: ``"cpu"`` or ``"cuda"``.
        num_threads: torch intra-op threads (keeps pools from starving each other).
    """

    def __init__(self, *, index: int, pool: str, rank: int, pool_size: int, world: int,
                 device: str, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.index, self.pool, self.rank = index, pool, rank
        self.pool_size, self.world = pool_size, world
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.store = ShardStore()
        self.roles: dict[str, Any] = {}
        self._endpoints: dict[str, dict[str, Endpoint[Any, Any]]] = {}
        self._pool_groups: dict[str, Any] = {}
        self._meshes: dict[tuple[str, Layout], Any] = {}

    # ----- set-up (default concurrency group, before any call) -----

    def pid(self) -> int:
        """The OS process id (tests use it to kill a worker)."""
        return os.getpid()

    def rendezvous_address(self) -> str:
        """A ``tcp://host:port`` this worker can host the session's store on."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def init_world(self, url: str, timeout_s: float) -> None:
        """Join the session-wide process group (every worker of every pool)."""
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=url, rank=self.index, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))

    def build_groups(self, pools: Sequence[tuple[str, Sequence[int]]],
                     meshes: Sequence[tuple[str, Layout]]) -> None:
        """Create every pool's process group and every (pool, layout) DeviceMesh.

        Collective over the whole session: every worker calls it with the same
        arguments, and creates every group in the same order, even groups it is
        not in (``new_group`` requires it).
        """
        from torch.distributed.device_mesh import DeviceMesh

        ranks_of = dict(pools)
        for name, ranks in pools:
            group = dist.new_group(list(ranks))
            if name == self.pool:
                self._pool_groups[name] = group
        for pool, layout in meshes:
            grid = torch.tensor(list(ranks_of[pool])).view(layout.p, layout.d, layout.t)
            mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=("pp", "dp", "tp"))
            if pool == self.pool:
                self._meshes[(pool, layout)] = mesh

    def add_role(self, name: str, cls: type, config: Any, layout: Layout) -> None:
        """Construct role ``name`` in this process."""
        ctx = WorkerContext(
            role=name, pool=self.pool, rank=self.rank, world_size=self.pool_size,
            global_rank=self.index, layout=layout, device=self.device,
            process_group=self._pool_groups.get(self.pool), mesh=self._meshes.get((self.pool, layout)),
        )
        self.roles[name] = cls(ctx) if config is None else cls(ctx, config)
        self._endpoints[name] = endpoints(cls)

    # ----- compute -----

    @ray.method(concurrency_group="compute")
    def execute(self, spec_bytes: bytes, kwargs: Mapping[str, Any],
                transforms: Mapping[str, Sequence[Transform]], *pieces: Any) -> RankResult:
        """Run one role method on this rank's rows and store the rows it returns.

        Args:
            spec_bytes: msgpack-encoded :class:`CallSpec`.
            kwargs: the method's non-data arguments.
            transforms: per data argument, ``(fn, kwargs)`` applied in order to the
                pulled rows before the method sees them.
            pieces: fetched pieces of every data argument's plan, in order (None
                for a piece held in this worker's store).
        """
        spec = msgspec.msgpack.decode(spec_bytes, type=CallSpec)
        args = dict(kwargs)
        i = 0
        for arg in spec.data_args:
            if arg.plan is None:
                args[arg.name] = None
                continue
            n = len(arg.plan.pieces)
            args[arg.name] = self._apply(transforms.get(arg.name, ()), self._gather(arg.plan, pieces[i:i + n]))
            i += n
        role = self.roles[spec.role]
        endpoint = self._endpoints[spec.role][spec.method]
        out = endpoint.fn(role, **args)
        return self._result(spec, endpoint, out)

    def _gather(self, plan: Any, fetched: Sequence[Any]) -> Batch:
        parts = []
        received = 0
        for piece, got in zip(plan.pieces, fetched, strict=True):
            if got is None:
                parts.append(self.store.slice(piece.key, piece.lo, piece.hi, piece.fields))
            else:
                received += sum(t.numel() * t.element_size() for t in got.values())
                parts.append(got)
        self.store.record_received(received)
        batch = assemble(plan, parts)
        if self.device.type != "cpu":
            batch = Batch({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
        return batch

    @staticmethod
    def _apply(transforms: Sequence[Transform], batch: Batch) -> Batch:
        for fn, kw in transforms:
            out = fn(batch, **kw)
            if not isinstance(out, Mapping):
                raise SchemaError(
                    f"transform {getattr(fn, '__qualname__', fn)!r} must return a mapping of columns, "
                    f"got {type(out).__name__}"
                )
            batch = batch.update(out)
        return batch

    def _result(self, spec: CallSpec, endpoint: Endpoint[Any, Any], out: Any) -> RankResult:
        rows = _as_rows(out)
        if rows is None:
            return RankResult(rank=self.rank, worker=self.index, value=out)
        declared = endpoint.spec.writes
        if declared is not None:
            missing = [f for f in declared if f not in rows]
            if missing:
                raise MissingFieldError(
                    f"{spec.role}.{spec.method} declares writes={list(declared)} but returned "
                    f"no {missing} (it returned {list(rows)})"
                )
        if self.device.type != "cpu":
            rows = Batch({k: v.detach().cpu() for k, v in rows.items()}, group_size=rows.group_size)
        lengths = None
        if endpoint.spec.row_lengths is not None:
            col = rows[endpoint.spec.row_lengths]
            lengths = tuple(int(x) for x in col.reshape(col.shape[0], -1).sum(dim=1).tolist())
        self.store.put(spec.out_key, rows)
        return RankResult(rank=self.rank, worker=self.index, key=spec.out_key, num_rows=rows.num_rows,
                          fields=rows.field_specs(), row_lengths=lengths, group_size=rows.group_size)

    # ----- data plane (io group: served while compute runs) -----

    @ray.method(concurrency_group="io")
    def slice(self, key: str, lo: int, hi: int, fields: Sequence[str] | None) -> dict[str, torch.Tensor]:
        """Rows ``[lo, hi)`` of columns ``fields`` of shard ``key``. The driver calls
        it with ``tensor_transport`` set so the tensors go straight to the consumer."""
        return self.store.slice(key, lo, hi, fields)

    @ray.method(concurrency_group="io")
    def put(self, key: str, columns: Mapping[str, torch.Tensor]) -> RankResult:
        """Store rows handed in by the driver (``Session.put``)."""
        batch = Batch(columns)
        self.store.put(key, batch)
        return RankResult(rank=self.rank, worker=self.index, key=key, num_rows=batch.num_rows,
                          fields=batch.field_specs())

    @ray.method(concurrency_group="io")
    def free(self, keys: Sequence[str]) -> int:
        """Drop shards no future names any more."""
        return self.store.free(keys)

    @ray.method(concurrency_group="io")
    def stats(self) -> StoreStats:
        """The store's counters."""
        return self.store.stats()


def _as_rows(out: Any) -> Batch | None:
    """``out`` as rows, or None when it is a plain value."""
    if isinstance(out, Batch):
        return out
    if isinstance(out, Mapping) and out and all(isinstance(v, torch.Tensor) for v in out.values()):
        return Batch(out)
    return None


def check_role_class(cls: type) -> None:
    """Raise :class:`ConfigError` unless ``cls`` can be hosted as a role."""
    if not isinstance(cls, type):
        raise ConfigError(f"a role must be a class, got {cls!r}")
    if not endpoints(cls):
        raise ConfigError(f"role class {cls.__qualname__} has no @register methods")
