"""Compute: Ray worker processes and what runs in them. Imports ``channels`` and
``hybrid_engine`` only.

Subpackages: ``host`` (the worker process that hosts roles, ``register``),
``roles`` (actor, critic, reference, reward, rollout), ``engines`` (training),
``rollout`` (generation), ``episodes`` (multi-turn generation with an
environment), ``models``, ``rewards``, ``objectives`` and ``data``. This face
re-exports the host's public names, which the control plane and role authors use.
"""

from workers.host import (
    CONCURRENCY_GROUPS,
    LIVE_ENV,
    Adopt,
    CallArgs,
    CallInfo,
    CallSpec,
    Chunk,
    DataArg,
    Endpoint,
    EngineLogs,
    FieldContract,
    Finish,
    Handoff,
    RankError,
    Role,
    Step,
    StoreServer,
    StreamSpec,
    Tail,
    WorkerContext,
    WorkerProcess,
    calling,
    check_role_class,
    endpoints,
    engine_log_env,
    pieces_by_worker,
    register,
)

__all__ = [
    "CONCURRENCY_GROUPS",
    "LIVE_ENV",
    "Adopt",
    "CallArgs",
    "CallInfo",
    "CallSpec",
    "Chunk",
    "DataArg",
    "Endpoint",
    "EngineLogs",
    "FieldContract",
    "Finish",
    "Handoff",
    "RankError",
    "Role",
    "Step",
    "StoreServer",
    "StreamSpec",
    "Tail",
    "WorkerContext",
    "WorkerProcess",
    "calling",
    "check_role_class",
    "endpoints",
    "engine_log_env",
    "pieces_by_worker",
    "register",
]
