"""A run's Ray instance and CPU workers, started before the driver's own set-up.

Before its first RL step a run spends seconds in the driver (the SFT warm start or
its reuse, the data, the prompts, the memory check) and seconds starting Ray and
the workers, which import torch, transformers and the roles. :func:`ray_started_ahead`
does the second during the first: it starts the embedded Ray instance and one worker
per rank of the CPU pools (``asyncflow.start_ray(workers=...)``), which the run's
session then adopts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from asyncflow.runtime import shutdown_ray, start_ray, starts_own_instance
from asyncflow.train._config import RunConfig, pools_on_cuda


@contextlib.contextmanager
def ray_started_ahead(config: RunConfig, *, address: str | None, worker_env: Mapping[str, str]) -> Iterator[None]:
    """Start the run's embedded Ray instance and its CPU pools' workers (with
    ``worker_env``, the session's) now, for the block to go on while the workers
    import; Ray ends with the block (the session that took it over has ended it
    already unless the block raised before the session started).

    Nothing is started when the run joins a cluster (``address``, or
    ``RAY_ADDRESS``) or Ray runs already (a script's or a test's own instance).
    """
    if not starts_own_instance(address):
        yield
        return
    # The configuration's check imported torch and the roles, and the driver reads
    # checkpoints by their config.json alone: it waits for no import here (an SFT
    # warm start imports transformers as it builds its model, while the workers do).
    start_ray(worker_nice=config.worker_nice, workers=cpu_ranks(config), worker_env=worker_env, preload=())
    try:
        yield
    finally:
        shutdown_ray()  # the run is over: a no-op after the session's own shutdown


def cpu_ranks(config: RunConfig) -> int:
    """The ranks of the run's pools when they are CPU pools (:func:`pools_on_cuda`
    false), else 0: GPU workers are not started ahead."""
    return 0 if pools_on_cuda(config) else sum(p.devices for p in config.pools.values())
