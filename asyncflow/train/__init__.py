"""Running an RL job from a configuration file (``asyncflow train CONFIG``)."""

from asyncflow.train._checkpoint import CheckpointDir
from asyncflow.train._config import RunConfig, load_config, needed_roles, validate
from asyncflow.train._metrics import MetricsLog, plot_curves, read_metrics
from asyncflow.train._trainer import RunInterruptedError, RunResult, Trainer

__all__ = [
    "CheckpointDir", "MetricsLog", "RunConfig", "RunInterruptedError", "RunResult", "Trainer", "load_config",
    "needed_roles", "plot_curves", "read_metrics", "validate",
]
