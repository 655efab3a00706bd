"""Compute: Ray worker processes, roles, and the ``register`` decorator.
Imports ``channels`` and ``hybrid_engine`` only."""

from workers._call import CallSpec, DataArg, RankError, StreamSpec, pieces_by_worker
from workers._engine_logs import EngineLogs, engine_log_env, route_from_environment
from workers._register import CallInfo, Endpoint, FieldContract, MethodSpec, endpoints, register
from workers._rendezvous import RayStore, StoreServer
from workers._role import CallScope, Role, WorkerContext, calling, current_call
from workers._streaming import Adopt, Chunk, Finish, Handoff, Step, StreamControl, Tail
from workers._worker import CONCURRENCY_GROUPS, StreamSink, WorkerProcess, check_role_class

__all__ = [
    "CONCURRENCY_GROUPS", "Adopt", "CallInfo", "CallScope", "CallSpec", "Chunk", "DataArg", "Endpoint", "EngineLogs", "FieldContract",
    "Finish", "Handoff", "MethodSpec", "RankError", "RayStore", "Role", "Step", "StoreServer", "StreamControl",
    "StreamSink", "StreamSpec", "Tail", "WorkerContext", "WorkerProcess", "calling", "check_role_class",
    "current_call", "endpoints", "engine_log_env", "pieces_by_worker", "register", "route_from_environment",
]
