"""The suite's shared Ray instances start their workers through asyncflow's fork
server (:mod:`asyncflow.runtime._forks`), without Ray's ``setup_worker``.

asyncflow starts the server's stubs through Ray's public ``py_executable``
(``runtime_env``), which makes the raylet start each worker through Ray's
``setup_worker.py`` first: about half a second per worker, and the suite starts
over a hundred on its shared instances (conftest.py's ``shared_ray``). Those
instances have their raylet run this file in place of Ray's ``default_worker.py``
instead (:func:`raylet_starts_stubs`, around ``ray.init``: the ``worker_path`` Ray's
node gives ``ray._private.services.start_raylet``, which has no public setting):
run as a script, it is the stub of asyncflow's server whose socket :data:`ENV`
names, or, without one, runs Ray's worker script itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

ENV = "ASYNCFLOW_TEST_FORKSERVER"
"""The server's socket path, in the environment the raylet gives its workers."""


@contextlib.contextmanager
def raylet_starts_stubs() -> Iterator[None]:
    """While in this context, a Ray instance that starts has its raylet start this
    file in place of Ray's ``default_worker.py``."""
    import inspect

    import ray._private.services as services

    original = services.start_raylet
    signature = inspect.signature(original)

    def start_raylet(*args, **kwargs):  # type: ignore[no-untyped-def]
        bound = signature.bind(*args, **kwargs)
        bound.arguments["worker_path"] = os.path.abspath(__file__)
        return original(*bound.args, **bound.kwargs)

    services.start_raylet = start_raylet
    try:
        yield
    finally:
        services.start_raylet = original


def rays_worker_script() -> str:
    """The path of Ray's ``default_worker.py``, found without importing Ray."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "Ray is not installed"
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "default_worker.py")


if __name__ == "__main__":
    # The repository, not tests/ (whose asyncflow/ holds tests), is where asyncflow comes from.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from asyncflow.runtime import _forks

    argv = [rays_worker_script(), *sys.argv[1:]]
    if os.environ.get(ENV):
        _forks.run_stub(os.environ[ENV], argv)
    else:
        _forks.run_rays_script(argv)
