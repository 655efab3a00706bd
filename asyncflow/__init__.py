"""asyncflow: RLHF as ``async def`` loops over data futures.

The control plane: sessions, resource pools and placement, worker-group proxies,
data futures, and (re-exported) the data-plane and worker building blocks a user
needs to write roles.
"""

from asyncflow._errors import PoolBrokenError, RemoteStageError, SessionClosedError, WorkerDiedError
from asyncflow._future import DataFuture, gather, merge, transform
from asyncflow._pool import CPU_SLOT, ResourcePool, RoleSpec
from asyncflow._session import RoleGroup, Roles, Session, shutdown_ray
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
    TransferProtocol,
    TransportError,
)
from workers import Role, WorkerContext, register

__all__ = [
    "CPU_SLOT", "DP", "AllToAll", "AsyncflowError", "Batch", "BatchMeta", "ConfigError",
    "DataFuture", "Layout", "Metrics", "MicroDP", "MissingFieldError", "OneToAll",
    "PoolBrokenError", "RankZero", "RemoteStageError", "ResourcePool", "Role", "RoleGroup",
    "RoleSpec", "Roles", "SchemaError", "Session", "SessionClosedError", "TransferProtocol",
    "TransportError", "WorkerContext", "WorkerDiedError", "gather", "merge", "register",
    "shutdown_ray", "transform",
]
