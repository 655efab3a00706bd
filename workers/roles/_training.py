"""What the model roles share: config checks, where their engine runs, and the
PPO-style update loop of the trainable ones (epochs over shuffled mini-batches, one
optimizer step each)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from channels import ConfigError, MissingFieldError
from workers._role import WorkerContext
from workers.engines import LossFn, TrainingEngine


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How one ``update`` call walks its batch."""

    epochs: int = 1
    """Passes over the batch (PPO epochs)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: each data-parallel rank splits its rows into this
    many mini-batches (so every rank needs at least this many rows)."""
    shuffle: bool = True
    """Shuffle the rows before each epoch's split (seeded, identical within a
    tensor-parallel group)."""

    def __post_init__(self) -> None:
        for name in ("epochs", "mini_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"UpdateConfig.{name} must be an int >= 1, got {value!r}")


def check_model_dir(owner: str, model_dir: object) -> None:
    """Raise :class:`ConfigError` unless ``model_dir`` is a non-empty path string."""
    if not isinstance(model_dir, str) or not model_dir:
        raise ConfigError(
            f"{owner}.model_dir must be a model directory path string, got {model_dir!r}; "
            "save_tiny_model writes one"
        )


def check_seed(owner: str, seed: object) -> None:
    """Raise :class:`ConfigError` unless ``seed`` is an int."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{owner}.seed must be an int, got {seed!r}")


def check_types(owner: str, config: object, expected: Mapping[str, type | tuple[type, ...]]) -> None:
    """Raise :class:`ConfigError` naming the field unless each field of ``config``
    named in ``expected`` is an instance of its type(s)."""
    for name, kinds in expected.items():
        value = getattr(config, name)
        if not isinstance(value, kinds):
            allowed = kinds if isinstance(kinds, tuple) else (kinds,)
            raise ConfigError(f"{owner}.{name} must be a {' or a '.join(k.__name__ for k in allowed)}, "
                              f"got {type(value).__name__}")


def engine_mesh(ctx: WorkerContext) -> Any:
    """The DeviceMesh a training engine of this role uses (None on a 1-rank pool)."""
    return ctx.mesh if ctx.world_size > 1 else None


def shuffle_generator(seed: int, ctx: WorkerContext) -> torch.Generator:
    """A generator for mini-batch shuffling: equal on the ranks of one data-parallel
    group (they hold the same rows and must split them alike), different across groups."""
    return torch.Generator().manual_seed(seed * 1_000_003 + ctx.coords.dp)


def require_fields(batch: Mapping[str, Tensor], fields: Sequence[str], *, where: str) -> None:
    """Raise :class:`MissingFieldError` naming the first of ``fields`` not in ``batch``."""
    for name in fields:
        if name not in batch:
            raise MissingFieldError(
                f"{where} reads field {name!r} but the batch has only {sorted(batch)}; "
                "compute it in an earlier stage (or a transform) and merge it in"
            )


def run_updates(engine: TrainingEngine, batch: Mapping[str, Tensor], *, loss: LossFn,
                fields: Sequence[str], schedule: UpdateConfig, generator: torch.Generator,
                prefix: str) -> dict[str, float]:
    """Train on this rank's rows: ``schedule.epochs`` passes of ``mini_batches`` steps.

    Collective over the engine's mesh: every rank runs the same number of steps.

    Args:
        engine: the role's engine.
        batch: this rank's rows.
        loss: the objective.
        fields: the columns the steps need (others are not moved).
        schedule: epochs, mini-batches, shuffling.
        generator: the shuffling generator (see :func:`shuffle_generator`).
        prefix: prepended to every metric name (``"actor/"``).

    Returns:
        The mean over steps of each metric the engine reports, plus ``steps``.

    Raises:
        ConfigError: some data-parallel rank has fewer rows than ``mini_batches``
            (raised on every rank, so none waits in a collective).
    """
    rows = len(next(iter(batch.values()))) if batch else 0
    fewest = -engine.parallel.max_over_dp(-rows, engine.device)
    if fewest < schedule.mini_batches:
        raise ConfigError(
            f"{prefix.rstrip('/')}.update: a data-parallel rank got {fewest} rows but "
            f"UpdateConfig.mini_batches={schedule.mini_batches}; send at least mini_batches rows "
            "per data-parallel rank or lower mini_batches"
        )
    columns = {name: batch[name] for name in dict.fromkeys(fields)}
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(schedule.epochs):
        order = torch.randperm(rows, generator=generator) if schedule.shuffle else torch.arange(rows)
        for idx in order.tensor_split(schedule.mini_batches):
            mini = {name: value.index_select(0, idx.to(value.device)) for name, value in columns.items()}
            for key, value in engine.train_step(mini, loss=loss).items():
                sums[key] = sums.get(key, 0.0) + float(value)
            steps += 1
    metrics = {f"{prefix}{key}": total / steps for key, total in sums.items()}
    metrics[f"{prefix}steps"] = float(steps)
    return metrics
