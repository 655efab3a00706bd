"""A function compiled by ``torch.compile`` where that works, run as it is where not."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Compiled"]

logger = logging.getLogger(__name__)


class Compiled:
    """``fn`` compiled by ``torch.compile`` (sizes dynamic) on its first call; if
    compiling fails, it logs why and runs ``fn`` as it is from then on.

    Args:
        fn: The function.
        what: What it is, for the log line (``"the sampler of the model's own distribution"``).
    """

    def __init__(self, fn: Callable[..., Any], what: str) -> None:
        self._fn = fn
        self._what = what
        self._compiled: Any = None
        self._failed = False

    def __call__(self, *args: Any) -> Any:
        if not self._failed:
            try:
                if self._compiled is None:  # torch.compile imports the compiler: not at import
                    self._compiled = torch.compile(self._fn, dynamic=True)
                return self._compiled(*args)
            except Exception as error:  # any compiler failure falls back
                logger.warning("native rollout: compiling %s failed (%s: %s); it runs uncompiled",
                               self._what, type(error).__name__, error)
                self._failed = True
        return self._fn(*args)
