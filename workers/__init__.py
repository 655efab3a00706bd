"""Compute: Ray worker processes, roles, and the ``register`` decorator.
Imports ``channels`` and ``hybrid_engine`` only."""

from workers._call import CallSpec, DataArg
from workers._register import Endpoint, MethodSpec, endpoints, register
from workers._role import Role, WorkerContext
from workers._worker import CONCURRENCY_GROUPS, WorkerProcess, check_role_class

__all__ = [
    "CONCURRENCY_GROUPS", "CallSpec", "DataArg", "Endpoint", "MethodSpec", "Role",
    "WorkerContext", "WorkerProcess", "check_role_class", "endpoints", "register",
]
