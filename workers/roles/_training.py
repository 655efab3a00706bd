"""What the model roles share: config checks, where their engine runs, and the
PPO-style update loop of the trainable ones (epochs over shuffled mini-batches, one
optimizer step each)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from channels import ConfigError, MissingFieldError
from workers.engines import OBSERVATION_MASK, TrainingEngine, fused_train_steps
from workers.host import WorkerContext
from workers.objectives import LossFn


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How one ``update`` call walks its batch."""

    epochs: int = 1
    """Passes over the batch (PPO epochs)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the global batch (every data-parallel rank's rows)
    is split into this many mini-batches, so it needs at least this many rows; a
    mini-batch may be empty on some ranks."""
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


def engine_mesh(ctx: WorkerContext, *, replicate: bool = False) -> Any:
    """The DeviceMesh a training engine of this role uses (None on a 1-rank pool,
    or when every rank keeps a full copy of the model: ``replicate``)."""
    return ctx.mesh if ctx.world_size > 1 and not replicate else None


def engine_group(ctx: WorkerContext, *, replicate: bool = False) -> dist.ProcessGroup | None:
    """The group a training engine of this role checkpoints over: the pool's own
    (None on a 1-rank pool or when replicated), never the session's default group,
    which spans every pool."""
    return ctx.process_group if ctx.world_size > 1 and not replicate else None


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


@dataclass(frozen=True, kw_only=True)
class TokenStats:
    """A per-token quantity over the real tokens of a whole data-parallel group."""

    mean: float
    """Token mean (every token weighs the same, whichever rank holds it)."""
    max: float
    """Largest value."""
    count: float
    """Tokens counted."""


def dp_token_stats(engine: TrainingEngine, values: Mapping[str, Tensor],
                   mask: Tensor) -> dict[str, TokenStats]:
    """Token mean and max of each of ``values`` over the real tokens of every rank of
    the engine's data-parallel group, equal on every rank.

    Collective over the data-parallel group: every rank passes the same names (a rank
    without rows passes ``[0, R]`` tensors).

    Args:
        engine: the role's engine (its data-parallel group).
        values: per-token quantities, each shaped like ``mask``.
        mask: this rank's response mask (non-zero on real tokens).

    Returns:
        The statistics by name; empty when no rank has a real token.
    """
    device = engine.device  # the reductions' device; the inputs may lie elsewhere
    keep = mask.to(device).bool()
    names = list(values)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)
    maxes = torch.full((max(len(names), 1),), -math.inf, dtype=torch.float64, device=device)
    sums[0] = keep.sum()
    for i, name in enumerate(names):
        picked = values[name].to(device).double()[keep]
        sums[i + 1] = picked.sum()
        if picked.numel():
            maxes[i] = picked.max()
    sums, maxes = (t.cpu() for t in engine.parallel.sums_and_maxes_over_dp(sums, maxes))
    count = float(sums[0])
    if count == 0:
        return {}
    return {name: TokenStats(mean=float(sums[i + 1]) / count, max=float(maxes[i]), count=count)
            for i, name in enumerate(names)}


def _mini_batch_of_rows(engine: TrainingEngine, rows: int, mini_batches: int,
                        where: str) -> Tensor:
    """Which mini-batch each of this rank's rows (in their walk order) falls in.

    The global batch (the data-parallel ranks' rows one after another) is cut into
    ``mini_batches`` contiguous near-equal parts, so every mini-batch has rows on some
    rank, and with ``shuffle=False`` the split equals a single process's on the same
    rows, however they are spread. Raised alike on every rank: the counts are global.
    One mini-batch needs no counts (no collective): a global batch without rows
    then makes one step that the engine skips (``steps_skipped``).
    """
    if mini_batches == 1:
        return torch.zeros(rows, dtype=torch.int64)
    counts = engine.parallel.counts_over_dp(rows, engine.device)
    total = sum(counts)
    if total < mini_batches:
        raise ConfigError(
            f"{where}: the batch has {total} rows over all data-parallel ranks but "
            f"UpdateConfig.mini_batches={mini_batches}; send at least mini_batches rows or "
            "lower UpdateConfig.mini_batches"
        )
    first = sum(counts[: engine.parallel.dp_rank])
    return (torch.arange(first, first + rows) * mini_batches) // total


@dataclass(frozen=True, kw_only=True)
class UpdateRun:
    """One role's ``update`` call ready to run (:func:`run_updates` builds it; the
    actor runs its own with the co-located critic's in one fused schedule)."""

    engine: TrainingEngine
    columns: dict[str, Tensor]
    """This rank's rows, the columns the steps read."""
    loss: LossFn
    schedule: UpdateConfig
    generator: torch.Generator
    prefix: str
    """Prepended to every metric name (``"actor/"``)."""

    @property
    def steps(self) -> int:
        """Optimizer steps the call takes."""
        return self.schedule.epochs * self.schedule.mini_batches

    def mini_batches(self) -> Iterator[dict[str, Tensor]]:
        """Each step's rows, epoch by epoch (with more than one mini-batch, collective
        at the start: the split is global over the data-parallel ranks)."""
        rows = len(next(iter(self.columns.values()))) if self.columns else 0
        part = _mini_batch_of_rows(self.engine, rows, self.schedule.mini_batches,
                                   f"{self.prefix.rstrip('/')}.update")
        for _ in range(self.schedule.epochs):
            order = torch.randperm(rows, generator=self.generator) if self.schedule.shuffle else torch.arange(rows)
            for index in range(self.schedule.mini_batches):
                idx = order[part == index]
                yield {name: value.index_select(0, idx.to(value.device)) for name, value in self.columns.items()}


def update_run(engine: TrainingEngine, batch: Mapping[str, Tensor], *, loss: LossFn,
               fields: Sequence[str], schedule: UpdateConfig, generator: torch.Generator,
               prefix: str) -> UpdateRun:
    """The :class:`UpdateRun` of :func:`run_updates`' arguments."""
    optional = (OBSERVATION_MASK,) if OBSERVATION_MASK in batch else ()
    columns = {name: batch[name] for name in dict.fromkeys((*fields, *optional))}
    return UpdateRun(engine=engine, columns=columns, loss=loss, schedule=schedule, generator=generator,
                     prefix=prefix)


def run_updates(engine: TrainingEngine, batch: Mapping[str, Tensor], *, loss: LossFn,
                fields: Sequence[str], schedule: UpdateConfig, generator: torch.Generator,
                prefix: str) -> dict[str, float]:
    """Train on this rank's rows: ``schedule.epochs`` passes of ``mini_batches`` steps.

    Collective over the engine's mesh: every rank runs ``epochs * mini_batches``
    optimizer steps, whatever its row count (a rank whose share of a mini-batch is
    empty runs dummy forwards). Each step is normalised over the global mini-batch, so
    the metrics are equal on every rank and do not depend on how rows are spread.

    Args:
        engine: the role's engine.
        batch: this rank's rows (possibly none).
        loss: the objective.
        fields: the columns the steps need (others are not moved).
        schedule: epochs, mini-batches, shuffling.
        generator: the shuffling generator (see :func:`shuffle_generator`).
        prefix: prepended to every metric name (``"actor/"``).

    Returns:
        The mean over steps of each metric the engine reports, ``steps`` and
        ``steps_skipped`` (optimizer steps skipped for a non-finite loss or gradient).

    Raises:
        ConfigError: the global batch has fewer rows than ``mini_batches`` > 1 (raised
            on every rank, so none waits in a collective). With one mini-batch, a
            global batch without rows skips its step.
    """
    run = update_run(engine, batch, loss=loss, fields=fields, schedule=schedule, generator=generator,
                     prefix=prefix)
    return run_together([run])[0]


def run_together(runs: Sequence[UpdateRun]) -> list[dict[str, float]]:
    """Run one update call, or two (the actor's and the critic's, on the same
    pipeline ranks) with each pair of their optimizer steps as one fused pipeline
    schedule (:func:`workers.engines.fused_train_steps`); each run's metrics as
    :func:`run_updates` returns them.

    Raises:
        ConfigError: two runs that take different numbers of steps.
    """
    if len(runs) == 2 and runs[0].steps != runs[1].steps:
        raise ConfigError(
            f"fused updates pair the optimizer steps: {runs[0].prefix.rstrip('/')} takes {runs[0].steps} "
            f"(epochs x mini_batches), {runs[1].prefix.rstrip('/')} {runs[1].steps}; give them the same "
            "schedule or update them apart")
    sums: list[dict[str, float]] = [{} for _ in runs]
    steps = 0
    for minis in zip(*(run.mini_batches() for run in runs), strict=True):
        if len(runs) == 1:
            results: Sequence[dict[str, float]] = [runs[0].engine.train_step(minis[0], loss=runs[0].loss)]
        else:
            results = fused_train_steps(runs[0].engine, minis[0], runs[1].engine, minis[1],
                                        first_loss=runs[0].loss, second_loss=runs[1].loss)
        for totals, result in zip(sums, results, strict=True):
            for key, value in result.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        steps += 1
    out = []
    for run, totals in zip(runs, sums, strict=True):
        skipped = totals.pop("step_skipped", 0.0)
        metrics = {f"{run.prefix}{key}": total / steps for key, total in totals.items()}
        metrics[f"{run.prefix}steps"] = float(steps)
        metrics[f"{run.prefix}steps_skipped"] = skipped
        out.append(metrics)
    return out
