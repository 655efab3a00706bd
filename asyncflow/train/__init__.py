"""Running an RL job from a configuration file (``asyncflow train CONFIG``).

The names load on first use (PEP 562, :mod:`channels._lazy`), so that the command
line reads and decodes the file (:func:`read_config_file`) before torch and the
roles import: a missing file or a syntax error is reported in a fraction of a
second.
"""

# The imports under TYPE_CHECKING are for type checkers only; the names reach users
# through __getattr__ (channels._lazy).
# ruff: noqa: F401

from __future__ import annotations

from typing import TYPE_CHECKING

from channels._lazy import lazy_exports

_EXPORTS = {
    "asyncflow.train._ahead": ("Sampled", "SamplesAhead"),
    "asyncflow.train._checkpoint": ("CheckpointDir", "CheckpointError"),
    "asyncflow.train._config": ("RunConfig", "algorithm_in", "needed_roles", "run_config_type"),
    "asyncflow.train._failures": ("RunInterruptedError",),
    "asyncflow.train._file": ("read_config_file",),
    "asyncflow.train._load": ("load_config",),
    "asyncflow.train._metrics": ("MetricsLog", "plot_curves", "read_metrics"),
    "asyncflow.train._rundir": ("RunDirs",),
    "asyncflow.train._trainer": ("RunResult", "Trainer"),
    "asyncflow.train._user_modules": ("module_dirs",),
    "asyncflow.train._validate": ("validate",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from asyncflow.train._ahead import Sampled, SamplesAhead
    from asyncflow.train._checkpoint import CheckpointDir, CheckpointError
    from asyncflow.train._config import RunConfig, algorithm_in, needed_roles, run_config_type
    from asyncflow.train._failures import RunInterruptedError
    from asyncflow.train._file import read_config_file
    from asyncflow.train._load import load_config
    from asyncflow.train._metrics import MetricsLog, plot_curves, read_metrics
    from asyncflow.train._rundir import RunDirs
    from asyncflow.train._trainer import RunResult, Trainer
    from asyncflow.train._user_modules import module_dirs
    from asyncflow.train._validate import validate
