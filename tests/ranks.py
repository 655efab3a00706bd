"""Ranks as new processes for the tests of one gloo group (no Ray): every test
library starts them here, forked from one server per pytest process.

Python keeps one fork server per process, started with the first call's preload
list; a rank forked from it imports only what that list left out. With each test
library naming its own list, whichever module ran first decided for all: the ranks
of the later ones imported transformers and the roles again, two to three seconds
of CPU each on the 2-core machine. One list covers them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

PRELOAD = [
    "torch", "transformers", "torch.distributed.checkpoint",
    "hybrid_engine", "workers.engines", "workers.models", "workers.roles",
    "workers.host._meshes", "workers.host._groups", "workers.host._pulls",
    # The test libraries whose functions the ranks run (found on pytest's path).
    "reshard_testlib", "engines_testlib", "roles_testlib",
]
"""What the fork server imports once: torch, transformers, the packages and the test
libraries the ranks run. A name that fails to import is skipped (by Python's fork
server), so a test module that is not on the path costs nothing."""


def start_ranks(main: Callable[..., None], args: Sequence[Any], world: int) -> None:
    """``main(rank, *args)`` on ``world`` processes forked from the server; returns
    when all have ended, and raises if one failed (torch's ``ProcessRaisedException``
    or ``ProcessExitedException``). ``main`` must be a module-level function."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(main, args=tuple(args), nprocs=world, start_method="forkserver", join=True)
