"""Shared fixtures. Ray-based tests share one Ray instance per pytest process
(:func:`shared_ray`), or start their own (``ray.init(address="local", ...)``: never
one that a cluster started beside them names in ``/tmp/ray/ray_current_cluster``)
after :func:`no_shared_ray` and shut it down at the end. Which module runs when, and
beside which: scheduling.py."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path

# For the tests that call ray.init themselves: their Ray instances bind every
# listener to the loopback interface, as asyncflow's own (asyncflow.runtime._ray_start.
# init_ray) do whatever the environment (tests/asyncflow/test_loopback.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Imported before any test runs, not lazily by its pytest plugin at the end of the
# session: CPython 3.11.7's parser can fail late in a session whose Ray workers
# were killed ("AST constructor recursion depth mismatch").
import hypothesis  # noqa: F401
import pytest
import ray.cloudpickle
import torch

import asyncflow as af
import fake_device
import forked_workers
import support
from asyncflow.runtime import _fork_server as fork_server
from scheduling import (  # noqa: F401 (pytest finds hooks here)
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)

# The fake accelerator of the device-discipline tests is registered before any test
# runs: torch's autograd engine sizes its per-device queues at the process's first
# backward pass and never again, so a device registered later cannot run one.
# Not where CUDA is: there the real device catches device mixing, and a second
# accelerator breaks CUDA's (autograd's stream assertion, libraries that ask
# torch.accelerator for "the" device get the fake one).
if torch.cuda.is_available():
    fake_device.UNAVAILABLE = "a CUDA device is present (the fake one is for CPU-only machines)"
else:
    try:
        fake_device.install()
    except (ImportError, AttributeError) as e:  # a torch without Python device backends
        fake_device.UNAVAILABLE = f"this torch cannot register a Python device backend: {e}"

# Workers cannot import the tests tree: ship the test roles by value.
ray.cloudpickle.register_pickle_by_value(support)

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def loop_thread():
    lt = support.LoopThread()
    yield lt
    lt.close()


_shared: dict[str, str] = {}
"""The shared Ray instance's GCS address while this process runs it."""
_fork_servers: list[fork_server.ForkServer] = []
"""The fork server of the shared Ray instance's workers, while it runs."""


def _shared_is_up() -> bool:
    return ray.is_initialized() and _shared.get("gcs") == ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def shared_ray() -> Iterator[None]:
    """One Ray instance for the modules that ask for it, kept up from one module to
    the next in this pytest process (each pytest-xdist worker has its own): a start
    and a stop cost seconds of both cores each. Their sessions (``asyncflow.Session``,
    in-process ``asyncflow train`` runs) find it running, use it and leave it
    running (their ``cpu_slots`` and ``worker_nice`` unused). It starts as asyncflow
    starts its own (every listener on loopback, 64 CPU slots, no dashboard), but
    its worker processes are forks of asyncflow's server that imported torch and
    transformers once, started without Ray's setup_worker (forked_workers.py); its workers' output stays in their log
    files, not interleaved with what a test
    reads; and its workers can import the tests' modules (support's reward functions): the
    repository, then tests/, on their path (whatever a run's working directory,
    tests/channels never shadows the package). A module that needs Ray stopped, or
    a Ray instance of its own settings, asks for :func:`no_shared_ray` first."""
    if not _shared_is_up():
        _stop_ray()  # whatever an earlier module left running
        _start_shared_ray()
    yield


@pytest.fixture(scope="module")
def no_shared_ray() -> None:
    """No Ray instance in this process when the module starts: the shared one (see
    :func:`shared_ray`) is stopped, for a module that starts Ray with its own
    settings, joins a cluster, or checks that nothing started."""
    _stop_ray()


def _start_shared_ray() -> None:
    tests = Path(__file__).parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": path}  # the raylet's, so the workers'
    server = fork_server.start(env)
    _fork_servers.append(server)
    env[forked_workers.ENV] = server.path
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with forked_workers.raylet_starts_stubs():
            ray.init(address="local", num_cpus=os.cpu_count() or 1, resources={af.CPU_SLOT: 64},
                     include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _shared["gcs"] = ray.get_runtime_context().gcs_address
    # Its log monitor forwards the workers' output to a driver that does not read
    # it (log_to_driver=False), scanning the session's log files ten times a second:
    # about 2% of a core for as long as the instance lives, which is the whole run.
    # Ray has no public switch for it; its node object stops it.
    ray._private.worker._global_node.kill_log_monitor()


def _stop_ray() -> None:
    _shared.clear()
    if ray.is_initialized():
        af.shutdown_ray()
    while _fork_servers:
        _fork_servers.pop().close()


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> None:
    """What the earlier modules left alive (imported modules: a million objects
    with torch, transformers and vLLM loaded) is collected once, then moved out of
    the garbage collector's sight. Libraries call ``gc.collect()`` often (vLLM
    several times an engine, a GGUF conversion dozens of times), and each full
    collection would otherwise walk all of it: half a second to a second each on
    the 2-core machine."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish() -> None:
    """The shared Ray instance stopped, and the heap back in the collector's sight,
    so that the interpreter's exit frees it as usual (nanobind-based libraries
    report what is left as leaks)."""
    _stop_ray()
    gc.unfreeze()
