"""Compute: Ray worker processes, roles, and the ``register`` decorator.
Imports ``channels`` and ``hybrid_engine`` only."""

from workers._call import CallSpec, DataArg, RankError
from workers._register import CallInfo, Endpoint, FieldContract, MethodSpec, endpoints, register
from workers._rendezvous import RayStore, StoreServer
from workers._role import Role, WorkerContext
from workers._worker import CONCURRENCY_GROUPS, WorkerProcess, check_role_class

__all__ = [
    "CONCURRENCY_GROUPS", "CallInfo", "CallSpec", "DataArg", "Endpoint", "FieldContract", "MethodSpec",
    "RankError", "RayStore", "Role", "StoreServer", "WorkerContext", "WorkerProcess", "check_role_class", "endpoints", "register",
]
