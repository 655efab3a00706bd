"""The owner's side of the fork server (:mod:`asyncflow.runtime._forks`, which
explains the server, its stubs and its workers): whether workers are forked here,
starting this process's server for the embedded Ray instance it starts, the
``runtime_env`` through which Ray starts its workers from it, and ending it.
It imports the standard library and the server's module only.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from asyncflow.runtime import _forks

if TYPE_CHECKING:
    import subprocess

OFF_ENV = "ASYNCFLOW_FORK_WORKERS"
"""``0`` starts every worker as Ray does, each importing its own libraries."""

_GPU_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")

_SCRIPT = os.path.abspath(_forks.__file__)
"""The server's and the stubs' script."""


def available() -> bool:
    """Whether workers are forked here: on Linux (``os.pidfd_open``), on a machine
    with no GPU device (a fork must not share a GPU runtime's state, and GPU
    workers start as Ray starts them), unless :data:`OFF_ENV` is ``0``."""
    if os.environ.get(OFF_ENV, "1").strip() == "0":
        return False
    return sys.platform == "linux" and hasattr(os, "pidfd_open") and not any(map(os.path.exists, _GPU_DEVICES))


class ForkServer:
    """A running fork server (:func:`start`); :meth:`close` ends it."""

    def __init__(self, path: str, proc: subprocess.Popen[bytes]) -> None:
        self.path = path
        """The server's Unix socket."""
        self._proc = proc

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self._proc.pid

    @staticmethod
    def system_config() -> dict[str, bool]:
        """Ray's settings for an instance whose workers are forked: no pre-started
        workers (they would be Ray's own, unforked, and a job with a ``runtime_env``
        cannot use them)."""
        return {"enable_worker_prestart": False, "prestart_worker_first_driver": False}

    def runtime_env(self) -> dict[str, str]:
        """The ``runtime_env`` under which the raylet starts its workers through this
        server (Ray's ``py_executable``: the stub, before Ray's worker script)."""
        stub = [sys.executable, "-P", _SCRIPT, "--stub", self.path]
        return {"py_executable": shlex.join(stub)}

    def close(self) -> None:
        """End the server now, importing or not. A worker forked from it ends too,
        with its stub, which waited on the server for the worker's end: close it
        after Ray's shutdown, which ends them first."""
        import shutil

        proc = self._proc
        proc.kill()  # it holds nothing to save
        proc.wait()
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


_server: ForkServer | None = None
"""This process's server, for the embedded Ray instance it starts (one at a time)."""


def start_fork_server(worker_env: Mapping[str, str] | None = None) -> ForkServer | None:
    """This process's fork server: the one running, else one started now (None where
    workers are not forked, :func:`available`). It imports
    :data:`~asyncflow.runtime._forks.PRELOAD` while the caller goes on (stubs
    that come meanwhile wait for it), in this process's
    environment with ``worker_env`` over it (the variables those libraries read
    when they load). ``asyncflow train`` starts it first thing, beside its
    configuration's check, and ``asyncflow.start_ray`` as it starts Ray, which then
    starts its workers through it (:meth:`ForkServer.runtime_env`)."""
    global _server
    if _server is None and available():
        _server = start(worker_env)
    return _server


def running_fork_server() -> ForkServer | None:
    """This process's fork server, if one runs."""
    return _server


def stop_fork_server() -> None:
    """End this process's fork server, if one runs (:meth:`ForkServer.close`)."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


def start(worker_env: Mapping[str, str] | None = None) -> ForkServer:
    """A new fork server (:func:`start_fork_server` keeps one per process): in this
    process's environment with ``worker_env`` over it (``${NAME}`` expanded)."""
    import subprocess
    import tempfile

    env = {**os.environ, **{name: os.path.expandvars(value) for name, value in (worker_env or {}).items()}}
    path = os.path.join(tempfile.mkdtemp(prefix="asyncflow-forks-"), "sock")
    # Its own output would reach the driver's terminal (an import's warning); its
    # workers write where Ray gave their stubs.
    proc = subprocess.Popen([sys.executable, "-P", _SCRIPT, "--serve", path],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return ForkServer(path, proc)
