"""A worker process keeps the memory it frees, for its next step to reuse.

glibc's allocator hands memory back to the system as it is freed: allocations
above its mmap threshold are unmapped when freed, and a heap whose free top
passes the trim threshold is shrunk. Each page given back is faulted in again
(and zeroed by the kernel) the next time a tensor of that size is allocated. An
RL worker allocates and frees the same activations every step, so a training
step paid for its memory again at every step: on the 2-core machine, the two
ranks of ``bench.e2e``'s ``dp2`` placement took 10,000-21,000 page faults a
second between them (about 3 microseconds each), the plain-PyTorch floor's two
processes 2,000-5,000. :func:`keep_freed_memory` raises both thresholds, as
PyTorch's caching allocator does on a GPU: a worker's memory stays at its peak
and is reused.

Where the process's environment sets glibc's own variables for these
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``'
``glibc.malloc.*``, e.g. through the session's ``worker_env``), they decide and
nothing is changed; so does an allocator other than glibc's.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""

MMAP_THRESHOLD = 32 << 20
"""Allocations at least this large still come from ``mmap`` and go back when freed:
glibc's largest mmap threshold on 64-bit systems."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at a heap's top past which glibc gives it back."""

OWN_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
"""glibc's environment variables for the same thresholds."""


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Raise glibc's trim and mmap thresholds in this process (see the module
    docstring); whether they were set. Not set where ``environ`` (default: this
    process's) sets glibc's own variables for them, or where the C library has no
    ``mallopt`` or refuses the values."""
    env = os.environ if environ is None else environ
    if any(name in env for name in OWN_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # mmap's threshold first: setting either one turns off glibc's own adjustment of both.
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.debug("mallopt refused the thresholds: freed memory goes back to the system as before")
    return done


def _mallopt() -> Callable[[int, int], int] | None:
    """The C library's ``mallopt(int, int) -> int``, or None where it has none."""
    try:
        fn = ctypes.CDLL(None).mallopt  # the symbols the process has loaded: its C library's
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]
