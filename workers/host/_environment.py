"""A worker process's environment variables: those it sets itself when it starts,
and those it reads again when it joins another session.

A session's ``worker_env`` reaches a new worker one of two ways. Ray's
``runtime_env`` sets variables before the process starts, at a price: Ray then
starts each worker through a Python of its own (its ``setup_worker``), which
imports Ray and execs the worker's Python, and asks its runtime-env agent first:
about half a second of CPU and of wall time per worker, and Ray's pre-started
workers go unused. The variables of :data:`STARTUP_ENV` (asyncflow's own: where
the engines log, and the ``PYTHONPATH`` of a run's own modules) skip that: the
worker's constructor sets them (:func:`set_env`), first thing, because nothing the
process imports before then reads them (the worker module imports torch, Ray and
``channels``; vLLM, transformers and the Hugging Face hub come later). Any other
variable goes by ``runtime_env``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from workers.host._engine_logs import LEVEL_ENV, LOG_FILE_ENV

STARTUP_ENV = frozenset({LOG_FILE_ENV, LEVEL_ENV, "VLLM_CONFIGURE_LOGGING", "HF_HUB_DISABLE_PROGRESS_BARS",
                         "PYTHONPATH"})
"""The variables a new worker sets itself, in its constructor (see the module docstring)."""

LIVE_ENV = frozenset({LOG_FILE_ENV})
"""The variables of a worker's environment it reads again when it joins another
session (``WorkerProcess.rejoin``); it reads every other one once, when it starts."""

_UNSET = re.compile(r"\$\{[A-Z0-9_]+\}")  # as Ray matches an unset one


def split_env(worker_env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``worker_env`` as (what the worker sets itself, :data:`STARTUP_ENV`; what
    Ray's ``runtime_env`` must set before it starts)."""
    own = {k: v for k, v in worker_env.items() if k in STARTUP_ENV}
    return own, {k: v for k, v in worker_env.items() if k not in STARTUP_ENV}


def set_env(env: Mapping[str, str], *, allowed: frozenset[str] = STARTUP_ENV) -> None:
    """Set ``env`` in this process as Ray's ``runtime_env`` would have before it
    started: ``${NAME}`` stands for the variable's value here (nothing when unset);
    a ``PYTHONPATH``'s directories also join ``sys.path``, ahead of the others.
    ``allowed``: the variables it may set now (:data:`LIVE_ENV` when a kept worker
    joins another session).

    Raises:
        ValueError: a variable not in ``allowed`` (the process read it already,
            or only Ray can set it in time).
    """
    if unknown := sorted(set(env) - allowed):
        raise ValueError(f"a worker sets only {sorted(allowed)} itself here, not {unknown}")
    for name, value in env.items():
        os.environ[name] = _UNSET.sub("", os.path.expandvars(value))
    if "PYTHONPATH" in env:
        dirs = [d for d in os.environ["PYTHONPATH"].split(os.pathsep) if d and d not in sys.path]
        sys.path[1:1] = dirs  # after the script's directory, as the interpreter places them
