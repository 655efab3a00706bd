"""Running an RL job from a configuration file (``asyncflow train CONFIG``)."""

from asyncflow.train._ahead import Sampled, SamplesAhead
from asyncflow.train._checkpoint import CheckpointDir, CheckpointError
from asyncflow.train._config import RunConfig, algorithm_in, needed_roles, run_config_type
from asyncflow.train._load import load_config
from asyncflow.train._metrics import MetricsLog, plot_curves, read_metrics
from asyncflow.train._rundir import RunDirs
from asyncflow.train._trainer import RunInterruptedError, RunResult, Trainer
from asyncflow.train._user_modules import module_dirs
from asyncflow.train._validate import validate

__all__ = [
    "CheckpointDir", "CheckpointError", "MetricsLog", "RunConfig", "RunDirs", "RunInterruptedError", "RunResult",
    "Sampled", "SamplesAhead", "Trainer", "algorithm_in", "load_config", "module_dirs", "needed_roles",
    "plot_curves", "read_metrics", "run_config_type", "validate",
]
