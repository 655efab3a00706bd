"""Starting Ray: an embedded single-machine instance, or joining a cluster.

:func:`init_ray` starts the embedded instance on the loopback interface, watched
so that it ends with its driver (:mod:`asyncflow.runtime._watchdog`), or joins the
cluster an address names.

Starting the embedded instance early, while the heavy modules import:
``ray.init`` spends most of its two to four seconds waiting for Ray's own
processes to come up, and a training script spends about as long importing torch,
transformers and the roles. :func:`start_ray` does both at once: it imports those
modules in a background thread while ``ray.init`` runs in the caller's thread (Ray
must be initialised from the thread that uses it). The first
:class:`~asyncflow.Session` without an ``address`` then takes that instance over
as if it had started it; with ``workers``, it also starts that many worker
processes as soon as Ray is up, which import while the script does, for the first
session to adopt (``asyncflow.runtime._idle``). This module imports Ray and
nothing heavier (:func:`_config_error` imports ``channels``, which imports torch,
only to raise).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray._private import ray_constants

from asyncflow.runtime._fork_server import running_fork_server, start_fork_server, stop_fork_server
from asyncflow.runtime._forks import RAY_LIBRARIES
from asyncflow.runtime._watchdog import watch_this_process

CPU_SLOT = "asyncflow_cpu_slot"
"""The Ray custom resource a CPU device slot is counted in: the embedded instance
offers ``cpu_slots`` of them. On a cluster whose nodes offer none (``ray start
--resources='{"asyncflow_cpu_slot": 16}'`` would), a CPU rank takes one of Ray's
``CPU`` instead (``asyncflow.runtime._pool.slot_resource``)."""

HEAVY_MODULES = ("torch", "transformers.modeling_utils", "workers.roles")
"""What :func:`start_ray` imports meanwhile by default, and its workers started
ahead always: what a training script and its workers need (importing the roles
loads no transformers model class; building or loading a model does)."""

_lock = threading.Lock()
_unclaimed = False  # a start_ray instance no session has taken over yet


def start_ray(*, cpu_slots: int = 64, worker_nice: int = 0, preload: Sequence[str] = HEAVY_MODULES,
              keep: bool = False, workers: int = 0, worker_env: Mapping[str, str] | None = None) -> None:
    """Start a local Ray instance now, importing ``preload`` meanwhile.

    Call it at the top of a script, before its heavy imports (which then find
    their modules loaded). Where it can (Linux, no GPU), the instance's worker
    processes are forks of a server that imports torch and transformers while Ray
    starts (``asyncflow.runtime._forks``): they start without importing either.
    The next :class:`~asyncflow.Session` without an
    ``address`` takes the instance over and shuts it down when it closes; its own
    ``cpu_slots`` and ``worker_nice`` are then not used: pass them here. Does
    nothing when Ray already runs. A module that fails to import is skipped here
    and raises where the script imports it.

    Args:
        cpu_slots: CPU device slots of the instance (``Session(cpu_slots=...)``).
        worker_nice: niceness of its worker processes (``Session(worker_nice=...)``).
        preload: modules to import while Ray starts.
        keep: the instance outlives the sessions: each uses it and leaves it
            running (for a script that runs several sessions one after the
            other, which would otherwise start Ray for each, seconds every
            time); :func:`~asyncflow.shutdown_ray` stops it.
        workers: CPU worker processes to start as soon as Ray is up, importing
            :data:`HEAVY_MODULES` while the script imports (with, for more
            than one, the session's rendezvous store server): the first
            session adopts them (see ``asyncflow.runtime._idle``) instead of
            starting its own once it spawns. As many as its CPU pools have
            ranks: one more is a process that imports for nothing.
        worker_env: those workers' environment variables: the session adopts
            them only if its own ``worker_env`` is the same (but for
            :data:`workers.LIVE_ENV`).
    """
    global _unclaimed
    with _lock:
        if ray.is_initialized():
            return
        if workers < 0:
            raise _config_error(f"start_ray(workers=...) must be >= 0, got {workers!r}")
        ray_up = threading.Event()
        importer = threading.Thread(target=_import_quietly, args=(tuple(preload), workers, dict(worker_env or {}),
                                                                  ray_up),
                                    name="asyncflow-preload", daemon=True)
        importer.start()
        try:
            init_ray(None, cpu_slots, worker_nice, worker_env=worker_env, forked=True)
            _unclaimed = not keep
        finally:
            ray_up.set()
            importer.join()  # no import half done when the script's own imports run


def claim_started_instance() -> bool:
    """True once for the instance :func:`start_ray` started: the caller owns it
    (shuts it down) from then on."""
    global _unclaimed
    with _lock:
        claimed, _unclaimed = _unclaimed and ray.is_initialized(), False
    return claimed


def _import_quietly(modules: tuple[str, ...], workers: int, worker_env: dict[str, str],
                    ray_up: threading.Event) -> None:
    """Import what the driver's first Ray call or actor would import (the
    libraries of Ray's serializers: :data:`~asyncflow.runtime._forks.RAY_LIBRARIES`
    and pyarrow) while Ray starts; with ``workers``, then start that many workers
    ahead once Ray is up, importing :data:`HEAVY_MODULES` (starting them imports
    the worker module: torch, Ray, ``channels``); then import ``modules``."""
    _import_all((*RAY_LIBRARIES, "pyarrow"))
    # workers.host._worker has its twin; importing it from here would import torch first
    if workers:
        from asyncflow.runtime import _idle

        ray_up.wait()
        if ray.is_initialized():
            _idle.start_ahead(workers, preload=HEAVY_MODULES, worker_env=worker_env)
    _import_all(modules)


def _import_all(modules: Sequence[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the script's own import raises it again, with context
            logging.getLogger(__name__).debug("preloading %s failed", name, exc_info=True)


def init_ray(address: str | None, cpu_slots: int, worker_nice: int, *,
             worker_env: Mapping[str, str] | None = None, forked: bool = False) -> None:
    """Start an embedded Ray instance on the loopback interface, or join a cluster.

    ``address`` (else ``RAY_ADDRESS``, as ``ray.init`` reads it; ``ray job submit``
    sets it for its drivers) joins that cluster, asking for no resources: a
    cluster's nodes bring their own. Without either, a new single-machine instance
    starts (never a cluster a stale ``/tmp/ray/ray_current_cluster`` names) with
    every listener on 127.0.0.1 (:func:`_node_address`) and a watchdog that ends
    its processes should this one die without shutting it down
    (:mod:`asyncflow.runtime._watchdog`). With ``forked`` (:func:`start_ray`'s
    instance, for a training script), or where this process runs a fork server
    already (``asyncflow train`` starts one first thing), the embedded instance's
    workers are forks of a server that imports torch and transformers while Ray
    starts (:func:`~asyncflow.runtime._fork_server.start_fork_server`, given
    ``worker_env``; ``shutdown_ray`` ends it with the instance). Not by default: a
    session of roles that load no Hugging Face model would pay for the server's
    imports more than its workers save.

    Start-up chatter a user cannot act on stays in Ray's session logs. Token
    authentication stays on: Ray 2.60 enables it for a new local instance and
    announces it with a warning.
    """
    address = cluster_address(address)
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth.level
    auth.setLevel(logging.ERROR)
    try:
        _node_address(loopback=address is None)
        if address is None:
            server = start_fork_server(worker_env) if forked else running_fork_server()
            settings: dict[str, Any] = {"worker_niceness": worker_nice}
            if server is not None:
                settings |= server.system_config()
            try:
                ray.init(address="local", num_cpus=os.cpu_count() or 1, resources={CPU_SLOT: cpu_slots},
                         include_dashboard=False, logging_level=logging.WARNING,
                         runtime_env=server.runtime_env() if server is not None else None,
                         _system_config=settings)
            except BaseException:
                stop_fork_server()
                raise
            watch_this_process()
        else:
            stop_fork_server()  # one started for an embedded instance that a cluster replaces
            check_answers(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING)
            except ray.exceptions.AuthenticationError as e:
                raise _config_error(f"the Ray cluster at {address} refused this driver: {str(e).splitlines()[0]} "
                                    "(a cluster with token authentication wants RAY_AUTH_MODE=token and its token "
                                    "in ~/.ray/auth_token or RAY_AUTH_TOKEN)") from None
    finally:
        auth.setLevel(level)


def starts_own_instance(address: str | None) -> bool:
    """Whether a run given ``address`` starts an embedded Ray instance of its own: no
    cluster to join (:func:`cluster_address`) and no Ray running in this process."""
    return cluster_address(address) is None and not ray.is_initialized()


def cluster_address(address: str | None) -> str | None:
    """The cluster to join: ``address``, else ``RAY_ADDRESS`` (as ``ray.init`` reads
    it; ``ray job submit`` sets it for its drivers); None: start an embedded one."""
    return address or os.environ.get("RAY_ADDRESS") or None


def check_answers(address: str | None) -> None:
    """Raise :class:`ConfigError` at once, naming the address, when nothing listens
    at ``address`` (else ``RAY_ADDRESS``): ``ray.init`` would retry for minutes.
    Nothing to check without either (an embedded instance), or for ``auto`` and
    ``scheme://`` addresses (Ray's to resolve)."""
    address = cluster_address(address)
    if address is None:
        return
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise _config_error(f"no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                            "`ray start --head`, or check --address / RAY_ADDRESS") from None


def head_answers(timeout_s: float = 2.0) -> bool:
    """Whether this process's Ray cluster's head (its GCS) accepts a connection within
    ``timeout_s``: where it does not (its processes ended, as a signal to the whole
    process group ends those of an embedded instance), a call that asks it (a node
    list, killing an actor) would wait a minute and then end this process."""
    if not ray.is_initialized():
        return False
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _config_error(message: str) -> Exception:
    """A :class:`~channels.ConfigError` with ``message``."""
    from channels import ConfigError

    return ConfigError(message)


ENABLE_RAY_CLUSTERS_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_USER_CHOICE = os.environ.get(ENABLE_RAY_CLUSTERS_ENV_VAR)  # before this module set it


def _node_address(*, loopback: bool) -> None:
    """Make the Ray instance started next take 127.0.0.1 as its node address
    (``loopback``), or the address the machine's route gives, as Ray decides.

    Ray binds every listener of a node (GCS, raylet, object manager, agents,
    workers) to the node's address, which it takes from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``: read into ``ray_constants`` once, when
    Ray is first imported, and again by each of its processes from the
    environment they inherit. Setting only the variable works solely before the
    first ``import ray``, which no library can promise; so both are set here, right
    before ``ray.init``. The constant has no public setter (a deliberate exception
    to our no-private-access rule, pinned by tests/asyncflow/test_loopback.py,
    which lists the listening sockets of every entry point). Joining a cluster
    restores what the user's environment said.
    """
    if loopback:
        os.environ[ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    elif _USER_CHOICE is None:
        os.environ.pop(ENABLE_RAY_CLUSTERS_ENV_VAR, None)
    else:
        os.environ[ENABLE_RAY_CLUSTERS_ENV_VAR] = _USER_CHOICE
    setting = os.environ.get(ENABLE_RAY_CLUSTERS_ENV_VAR)
    ray_constants.ENABLE_RAY_CLUSTER = (not ray_constants.IS_WINDOWS_OR_OSX if setting is None
                                        else setting.lower() in ("1", "true"))
