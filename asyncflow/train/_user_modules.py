"""Where a run finds the user's own modules (reward functions and any other
``module:function`` a config names).

A module beside the configuration file is importable wherever the command was
started from: the config's directory, then the working directory, go on the
driver's ``sys.path`` while the run lasts, and at the front of the workers'
``PYTHONPATH`` (the workers are other processes, possibly on other nodes, where
the same directories serve when the file system is shared).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def module_dirs(config_path: str | Path) -> tuple[str, ...]:
    """The directories a configuration's modules are imported from: the config
    file's own directory, then the working directory (absolute, without repeats)."""
    return tuple(dict.fromkeys((str(Path(config_path).absolute().parent), os.path.abspath(os.curdir))))


@contextmanager
def importable(dirs: Sequence[str]) -> Iterator[None]:
    """``dirs`` at the front of ``sys.path`` (those not there yet) until the block ends."""
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def worker_python_path(dirs: Sequence[str]) -> dict[str, str]:
    """The workers' ``PYTHONPATH``: ``dirs`` before whatever the worker's environment
    already holds (Ray expands ``${PYTHONPATH}`` where the worker starts); empty
    without ``dirs``."""
    return {"PYTHONPATH": os.pathsep.join([*dirs, "${PYTHONPATH}"])} if dirs else {}
