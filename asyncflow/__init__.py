"""asyncflow: RLHF as ``async def`` loops over data futures.

The control plane: sessions, resource pools and placement, worker-group proxies,
data futures, and (re-exported) the data-plane and worker building blocks a user
needs to write roles.

The names below load on first use (PEP 562), so that ``import asyncflow.cli``
imports no Ray: the command sets Ray's environment before Ray is imported.
"""

# The imports under TYPE_CHECKING are for type checkers only; the names reach users
# through __getattr__ (channels._lazy).
# ruff: noqa: F401

from __future__ import annotations

from typing import TYPE_CHECKING

from channels._lazy import lazy_exports

_EXPORTS = {
    "asyncflow.runtime": ("CPU_SLOT", "CallTimeoutError", "DataFuture", "DataStream", "PoolBrokenError",
                          "RemoteStageError", "ResourcePool", "RoleGroup", "RoleSpec", "Roles", "Session",
                          "SessionClosedError", "Stage", "StreamOptions", "WorkerDiedError", "collect", "concat", "gather",
                          "merge", "shutdown_ray", "start_ray", "transform"),
    "channels": ("DP", "AllToAll", "AsyncflowError", "Batch", "BatchMeta", "ConfigError", "Layout", "Metrics",
                 "MicroDP", "MissingFieldError", "OneToAll", "RankZero", "SchemaError", "TensorShards", "TransferProtocol",
                 "TransportError"),
    "workers": ("Adopt", "CallInfo", "Chunk", "Finish", "Handoff", "Role", "Step", "Tail", "WorkerContext",
                "register"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from asyncflow.runtime import (
        CPU_SLOT,
        CallTimeoutError,
        DataFuture,
        DataStream,
        PoolBrokenError,
        RemoteStageError,
        ResourcePool,
        RoleGroup,
        Roles,
        RoleSpec,
        Session,
        SessionClosedError,
        Stage,
        StreamOptions,
        WorkerDiedError,
        collect,
        concat,
        gather,
        merge,
        shutdown_ray,
        start_ray,
        transform,
    )
    from channels import (
        DP,
        AllToAll,
        AsyncflowError,
        Batch,
        BatchMeta,
        ConfigError,
        Layout,
        Metrics,
        MicroDP,
        MissingFieldError,
        OneToAll,
        RankZero,
        SchemaError,
        TensorShards,
        TransferProtocol,
        TransportError,
    )
    from workers import (
        Adopt,
        CallInfo,
        Chunk,
        Finish,
        Handoff,
        Role,
        Step,
        Tail,
        WorkerContext,
        register,
    )
