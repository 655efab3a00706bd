"""Which test module runs when, and beside which, under ``make test``'s two
pytest-xdist workers (``-n 2 --dist loadfile``; tests/conftest.py imports these
hooks, and they do nothing without xdist but order the modules).

- Each module is one unit of work: its module-scoped Ray instance and session
  start once. The modules :data:`SHARED_WORKER` groups run one after the other on
  one worker.
- Units are handed out in the collection's order, which puts the modules holding
  ``slow`` tests first, so that the two workers end close together.
"""

from __future__ import annotations

from typing import Any

import pytest

OWN_RAY = "modules that stop the shared Ray instance"
SHARED_WORKER = {
    "tests/asyncflow/test_cluster_on_cpu.py": OWN_RAY,
    "tests/asyncflow/test_two_node_cluster_on_cpu.py": OWN_RAY,
    "tests/asyncflow/test_config.py": OWN_RAY,
    "tests/asyncflow/test_forks_on_cpu.py": OWN_RAY,
    "tests/asyncflow/test_loopback.py": OWN_RAY,
    "tests/asyncflow/test_runtime_on_cpu.py": OWN_RAY,
    "tests/asyncflow/test_worker_settings_on_cpu.py": OWN_RAY,
    "tests/channels/test_remote_channel_on_cpu.py": OWN_RAY,
}
"""Modules that pytest-xdist runs one after the other on one worker, by the name of
what they share. Each of these modules stops the worker's shared Ray instance
(``no_shared_ray``: it starts Ray with its own settings, or a cluster, or checks
that nothing started), which the next module starts again without the workers
the last one kept (conftest.py's ``shared_ray``): run together, they cost one
restart instead of one each, and the other worker's instance lives through. The
two cluster modules could not run side by side anyway: each cluster's head writes
/tmp/ray/ray_current_cluster and its agent wants Ray's default port."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules holding ``slow`` tests first, so that two workers end close
    together; the order is otherwise the collection's."""
    slow = {_module(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module(item.nodeid) not in slow)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``: a module, or the modules :data:`SHARED_WORKER` names
    together, is one unit of work, handed out in the collection's order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return SHARED_WORKER.get(module, module)

    return ByModule(config, log)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]
