"""asyncflow: RLHF as ``async def`` loops over data futures.

The control plane: sessions, resource pools and placement, worker-group proxies,
data futures, and (re-exported) the data-plane and worker building blocks a user
needs to write roles.

The names below load on first use (PEP 562), so that ``import asyncflow.cli``
imports no Ray: the command sets Ray's environment before Ray is imported.
"""

# The imports under TYPE_CHECKING are for type checkers only; the names reach users
# through __getattr__ below.
# ruff: noqa: F401

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "asyncflow._datastream": ("DataStream", "StreamOptions", "collect"),
    "asyncflow._errors": ("CallTimeoutError", "PoolBrokenError", "RemoteStageError", "SessionClosedError", "WorkerDiedError"),
    "asyncflow._future": ("DataFuture", "gather", "transform"),
    "asyncflow._ops": ("merge",),
    "asyncflow._pool": ("CPU_SLOT", "ResourcePool", "RoleSpec"),
    "asyncflow._ray_start": ("start_ray",),
    "asyncflow._proxy": ("RoleGroup", "Roles"),
    "asyncflow._select": ("concat",),
    "asyncflow._session": ("Session", "shutdown_ray"),
    "channels": ("DP", "AllToAll", "AsyncflowError", "Batch", "BatchMeta", "ConfigError", "Layout", "Metrics",
                 "MicroDP", "MissingFieldError", "OneToAll", "RankZero", "SchemaError", "TensorShards", "TransferProtocol",
                 "TransportError"),
    "workers": ("Adopt", "CallInfo", "Chunk", "Finish", "Handoff", "Role", "Step", "Tail", "WorkerContext",
                "register"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from asyncflow._datastream import DataStream, StreamOptions, collect
    from asyncflow._errors import (
        CallTimeoutError,
        PoolBrokenError,
        RemoteStageError,
        SessionClosedError,
        WorkerDiedError,
    )
    from asyncflow._future import DataFuture, gather, transform
    from asyncflow._ops import merge
    from asyncflow._pool import CPU_SLOT, ResourcePool, RoleSpec
    from asyncflow._proxy import RoleGroup, Roles
    from asyncflow._ray_start import start_ray
    from asyncflow._select import concat
    from asyncflow._session import Session, shutdown_ray
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
