"""A run's Ray instance and CPU workers, started before the driver's own set-up.

Before its first RL step a run spends seconds in the driver (the SFT warm start or
its reuse, the data, the prompts, the memory check) and seconds starting Ray and
the workers, which import torch, transformers and the roles. :func:`ray_started_ahead`
does the second during the first: it starts the embedded Ray instance and one worker
per rank of the CPU pools (``asyncflow.start_ray(workers=...)``), which the run's
session then adopts. ``asyncflow train`` starts the instance and the workers
earlier still, before its own heavy imports (:func:`start_ray_early`).
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from asyncflow.runtime import cluster_address, start_ray, start_workers_ahead

if TYPE_CHECKING:  # the run's configuration imports torch; start_ray_early runs before it does
    from asyncflow.train._config import RunConfig


@contextlib.contextmanager
def ray_started_ahead(config: RunConfig, *, address: str | None, worker_env: Mapping[str, str]) -> Iterator[None]:
    """Start the run's embedded Ray instance and its CPU pools' workers (with
    ``worker_env``, the session's) now, for the block to go on while the workers
    import; Ray ends with the block (the session that took it over has ended it
    already unless the block raised before the session started).

    Nothing is started when the run joins a cluster (``address``, or
    ``RAY_ADDRESS``) or Ray runs already (a script's or a test's own instance),
    but for the instance :func:`start_ray_early` started: then the workers it
    did not start start now, and that instance ends with the block.
    """
    if cluster_address(address) is not None:
        yield
        return
    if ray.is_initialized():
        # The instance start_ray_early started (its workers start now), or another (nothing starts).
        if not start_workers_ahead(cpu_ranks(config), worker_env=worker_env):
            yield
            return
    else:
        start_ray(worker_nice=config.worker_nice, workers=cpu_ranks(config), worker_env=worker_env)
    try:
        yield
    finally:
        from asyncflow.runtime import shutdown_ray  # the session's module: imported by now

        shutdown_ray()  # the run is over: a no-op after the session's own shutdown


def start_ray_early(config_path: str | Path, overrides: Mapping[str, object], *, address: str | None,
                    worker_env: Callable[[], Mapping[str, str]]) -> bool:
    """Start the embedded Ray instance for the run ``config_path`` describes before
    the heavy imports (``asyncflow.start_ray``: torch, transformers and the roles
    import meanwhile), and its CPU workers as soon as Ray is up, with the
    environment ``worker_env()`` gives (called meanwhile, in the background; the
    run's own adds its log file, which a worker reads when its session adopts
    it). From what the file says, without loading it (``overrides``, dotted keys,
    first): its ``worker_nice``, and its pools' ranks where they are CPU pools
    (:func:`early_cpu_ranks`). A file that does not read as TOML, or an odd
    ``worker_nice``, starts nothing: loading the configuration says what is wrong.
    Nothing starts on a cluster (``address``, or ``RAY_ADDRESS``) or under a running
    Ray. The run's :func:`ray_started_ahead` starts any workers still missing and
    ends the instance with the run.

    Returns:
        Whether it started Ray (the caller ends it should the run not start).
    """
    if cluster_address(address) is not None or ray.is_initialized():
        return False
    try:
        with open(config_path, "rb") as f:
            raw = _overridden(tomllib.load(f), overrides)
    except (OSError, tomllib.TOMLDecodeError):
        return False
    nice = raw.get("worker_nice", 0)
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        return False
    start_ray(worker_nice=nice, workers=early_cpu_ranks(raw.get("pools")), worker_env=worker_env)
    return True


def early_cpu_ranks(pools: object) -> int:
    """:func:`cpu_ranks` from a configuration file's ``[pools]`` table as it reads,
    before torch imports: a GPU is taken to be visible where the machine has an
    NVIDIA or ROCm device file and ``CUDA_VISIBLE_DEVICES`` hides none of them.
    0 where the table is missing or odd (the run starts its workers then)."""
    if not isinstance(pools, dict) or not pools or not all(isinstance(p, dict) for p in pools.values()):
        return 0
    devices = [p.get("devices", 1) for p in pools.values()]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in devices):
        return 0
    kinds = {p.get("device", "auto") for p in pools.values()} - {"auto"}
    on_cpu = kinds == {"cpu"} or (not kinds and not _gpu_visible())
    return sum(devices) if on_cpu else 0


def _gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/kfd"))


def _overridden(raw: dict[str, Any], overrides: Mapping[str, object]) -> dict[str, Any]:
    """``raw`` with ``overrides`` (``"a.b.c": value``) set in place of its values."""
    for key, value in overrides.items():
        *path, last = key.split(".")
        table = raw
        for part in path:
            table = table.setdefault(part, {}) if isinstance(table.get(part, {}), dict) else {}
        table[last] = value
    return raw


def run_worker_env(*, terminal_level: int, module_dirs: Sequence[str], log_file: Path | None) -> dict[str, str]:
    """The environment of a run's workers: where their engine logs go (``log_file``,
    a variable a worker reads again when a session adopts it: see
    ``workers.LIVE_ENV``) and the path to the configuration's own modules."""
    from asyncflow.train._user_modules import worker_python_path
    from workers.host import engine_log_env

    return engine_log_env(terminal_level=terminal_level, log_file=log_file) | worker_python_path(module_dirs)


def cpu_ranks(config: RunConfig) -> int:
    """The ranks of the run's pools when they are CPU pools (:func:`pools_on_cuda`
    false), else 0: GPU workers are not started ahead."""
    from asyncflow.train._config import pools_on_cuda

    return 0 if pools_on_cuda(config) else sum(p.devices for p in config.pools.values())

