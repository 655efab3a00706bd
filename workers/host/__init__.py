"""The worker host: the Ray actor that hosts role objects in one process per
(pool, rank), and what it runs them with.

- :class:`WorkerProcess`: the actor (set-up, the ``compute``/``io``/``watch``
  concurrency groups, the rank's shard store);
- :func:`register` and :class:`Role`: how a role class declares the methods the
  driver may call, and the :class:`WorkerContext` it is built with;
- :class:`CallSpec`, :class:`CallArgs` and :class:`RankError`: what one call
  carries to a rank and what a failed one carries back; :class:`ControlWire`: the
  frames of the session's control connection to the worker, which carries calls
  without a Ray task each (:class:`NotRun`: a call whose arguments did not load);
- the stream events (:class:`Chunk`, :class:`Tail`, ...) a streamed method yields;
- the process groups and meshes of a pool (reconnectable after a failure) and the
  session's rendezvous over Ray;
- where the engines' log records go (:class:`EngineLogs`).
"""

from workers.host._call import CallArgs, CallSpec, DataArg, RankError, StreamSpec, pieces_by_worker
from workers.host._control import ControlWire, NotRun
from workers.host._engine_logs import EngineLogs, engine_log_env
from workers.host._environment import LIVE_ENV, STARTUP_ENV, split_env
from workers.host._meshes import mesh_from_groups, new_reconnectable_group
from workers.host._pulls import PULL_TAGS, Pull, RowsUnavailableError
from workers.host._register import (
    CallInfo,
    Endpoint,
    FieldContract,
    check_role_class,
    endpoints,
    register,
)
from workers.host._role import Role, WorkerContext, calling, current_call
from workers.host._store_server import StoreServer
from workers.host._streaming import (
    Adopt,
    Chunk,
    Finish,
    Handoff,
    Step,
    StreamMethod,
    Tail,
)
from workers.host._worker import CONCURRENCY_GROUPS, WorkerProcess

__all__ = [
    "CONCURRENCY_GROUPS",
    "LIVE_ENV",
    "PULL_TAGS",
    "STARTUP_ENV",
    "Adopt",
    "CallArgs",
    "CallInfo",
    "CallSpec",
    "Chunk",
    "ControlWire",
    "DataArg",
    "Endpoint",
    "EngineLogs",
    "FieldContract",
    "Finish",
    "Handoff",
    "NotRun",
    "Pull",
    "RankError",
    "Role",
    "RowsUnavailableError",
    "Step",
    "StoreServer",
    "StreamMethod",
    "StreamSpec",
    "Tail",
    "WorkerContext",
    "WorkerProcess",
    "calling",
    "check_role_class",
    "current_call",
    "endpoints",
    "engine_log_env",
    "mesh_from_groups",
    "new_reconnectable_group",
    "pieces_by_worker",
    "register",
    "split_env",
]
