"""The critic role: a value model predicting returns, trained with a clipped value loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from channels import DP, Batch, ConfigError, Metrics
from workers.engines import TrainingConfig, ValueHead
from workers.host import WorkerContext, register
from workers.models import load_model
from workers.objectives import ValueLoss
from workers.roles import _fields as F
from workers.roles._checkpoint import TrainedRole
from workers.roles._engine_choice import EngineName, build_engine, check_engine
from workers.roles._training import (
    UpdateConfig,
    UpdateRun,
    check_model_dir,
    check_seed,
    check_types,
    require_fields,
    run_together,
    shuffle_generator,
    update_run,
)

OLD_VALUES = "old_values"
"""The engine's name for the values before the update (the clipping anchor)."""


UPDATE_METRICS = Metrics(over=DP(), reduce={"critic/steps": "max", "critic/steps_skipped": "max"})
"""How :meth:`CriticWorker.update`'s metrics combine over its data-parallel ranks: the
update reduces them over the ranks already (equal on every rank); means are weighted
by the ranks' rows (a rank without rows does not count), step counts by their max."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """Settings of a :class:`CriticWorker`."""

    model_dir: str
    """A value-model directory, or a causal-LM directory (its backbone plus a fresh head)."""
    head_seed: int = 0
    """Seed of a fresh value head (ignored when ``model_dir`` has one)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimizer, schedule and micro-batching of the training engine."""
    loss: ValueLoss = field(default_factory=ValueLoss)
    """The default objective of :meth:`CriticWorker.update`."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Epochs and mini-batches of one update call."""
    seed: int = 0
    """Seeds torch's global RNG and the mini-batch shuffling."""
    replicate: bool = False
    """Keep a full copy of the model on every rank, outside the pool's groups (no
    sharding): ``values`` then needs no other rank and may run on any free ranks of
    the pool (as it may when ``training.data_parallel`` replicates the model). A
    critic replicated this way on more than one rank serves values only (its
    ``update`` refuses: the copies would drift apart)."""
    engine: EngineName = "native"
    """The training engine: ``"native"`` (FSDP2/DTensor) or ``"megatron"`` (Megatron-core
    over the same layout; CUDA and megatron-core >= 0.16, no pipeline stages)."""

    def __post_init__(self) -> None:
        check_model_dir("CriticConfig", self.model_dir)
        check_seed("CriticConfig", self.seed)
        check_engine("CriticConfig", self.engine)
        check_types("CriticConfig", self, {"training": TrainingConfig, "loss": ValueLoss, "update": UpdateConfig})


class CriticWorker(TrainedRole):
    """The value function: ``values``, ``update``, checkpoints.

    Args:
        ctx: where this rank runs.
        config: the critic's settings.
    """

    Config = CriticConfig

    def __init__(self, ctx: WorkerContext, config: CriticConfig) -> None:
        super().__init__(ctx)
        self.config = config
        torch.manual_seed(config.seed)
        model = load_model(config.model_dir, kind="value", head_seed=config.head_seed)
        replicate = config.replicate
        self.engine = build_engine(ctx, model.to(ctx.device), engine=config.engine, config=config.training,
                                   head=ValueHead(), loss=config.loss, replicate=replicate)
        self._shuffle = shuffle_generator(config.seed, ctx)

    def rank_local(self) -> frozenset[str]:
        """``values`` when each rank holds the whole model (``CriticConfig.replicate``,
        or ``TrainingConfig.data_parallel`` replicating it): it then needs no other rank."""
        return frozenset({"values"}) if self.engine.infers_alone else frozenset()

    @register(protocol=DP(), reads=F.SEQUENCE, optional=F.SEQUENCE_OPTIONAL, writes=(F.VALUES,))
    def values(self, batch: Batch) -> dict[str, Tensor]:
        """Value predictions at the response positions.

        Args:
            batch: the sequence fields (a rank's share may be empty).

        Returns:
            ``values``: float32 ``[R]``; value j is read in the state before response
            token j; 0 on padding.
        """
        return {F.VALUES: self.engine.values(batch)}

    @register(protocol=UPDATE_METRICS, reads=(*F.SEQUENCE, F.VALUES, F.RETURNS), optional=F.SEQUENCE_OPTIONAL)
    def update(self, batch: Batch, *, loss: ValueLoss | None = None,
               schedule: UpdateConfig | None = None) -> dict[str, float]:
        """Regress the values towards ``returns`` (clipped around the batch's ``values``).

        Args:
            batch: this rank's rows: the sequence fields, ``values`` and ``returns``.
            loss: the objective; None uses ``config.loss``.
            schedule: epochs and mini-batches; None uses ``config.update``.

        Returns:
            Metrics named ``critic/<name>`` (``loss``, aggregated as the loss's
            ``loss_agg`` says, ``grad_norm``, ``lr``, ``value_clip_fraction``,
            ``values``, ...: token means over every rank's rows) averaged over the
            steps, ``steps`` and ``steps_skipped``; equal for every layout of the same
            rows.

        Raises:
            MissingFieldError: the batch lacks a field.
            ConfigError: the batch (all ranks' rows) has fewer rows than
                ``schedule.mini_batches``.
        """
        return run_together([self.update_run(batch, loss=loss, schedule=schedule)])[0]

    def update_run(self, batch: Mapping[str, Tensor], *, loss: ValueLoss | None = None,
                   schedule: UpdateConfig | None = None) -> UpdateRun:
        """:meth:`update`'s steps, not yet run (the co-located actor runs them with
        its own as one fused schedule: ``ActorWorker.update(with_critic=True)``).

        Raises:
            MissingFieldError, ConfigError: as :meth:`update`.
        """
        if self.config.replicate and self.ctx.world_size > 1:
            raise ConfigError("critic.update: a replicated critic (CriticConfig.replicate) on more than one "
                              "rank serves values only; set replicate=False to train it")
        require_fields(batch, (*F.SEQUENCE, F.VALUES, F.RETURNS), where="critic.update")
        columns = {**batch, OLD_VALUES: batch[F.VALUES]}
        loss = loss if loss is not None else self.config.loss
        return update_run(self.engine, columns, loss=loss, fields=(*F.SEQUENCE, *loss.required_fields),
                          schedule=schedule or self.config.update, generator=self._shuffle, prefix="critic/")

    def _save_export(self, state: dict[str, Tensor], out: Path) -> None:
        model = load_model(self.config.model_dir, kind="value", head_seed=self.config.head_seed)
        model.load_state_dict(state)
        model.save_pretrained(out)
