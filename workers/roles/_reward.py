"""The reward and cost roles: one score per sample, by a rule function or a model.

Both host a scorer from ``workers.rewards`` (picked by the type of
``ScoreConfig.scorer``) and differ only in the field they write: ``scores`` for
rewards, ``costs`` for costs (Safe-RLHF). Rows are split over the pool's ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from channels import DP, Batch, ConfigError, Metrics
from workers import Role, WorkerContext, register
from workers.rewards import ModelRewardConfig, RuleRewardConfig, ScoreInputs, Scorer
from workers.roles import _fields as F
from workers.roles._training import check_seed, require_fields

ScorerConfig = RuleRewardConfig | ModelRewardConfig
"""How samples are scored; the type selects a rule function or a model."""


@dataclass(frozen=True, kw_only=True)
class ScoreConfig:
    """Settings of a :class:`RewardWorker` or :class:`CostWorker`."""

    scorer: ScorerConfig
    """``RuleRewardConfig(fn=..., tokenizer_dir=...)`` or ``ModelRewardConfig(model_dir=...)``."""
    seed: int = 0
    """Seeds torch's global RNG."""

    def __post_init__(self) -> None:
        check_seed("ScoreConfig", self.seed)
        if not isinstance(self.scorer, RuleRewardConfig | ModelRewardConfig):
            raise ConfigError(
                "ScoreConfig.scorer must be a RuleRewardConfig or a ModelRewardConfig, got "
                f"{type(self.scorer).__name__}"
            )


def _stat_reducers(prefix: str) -> dict[str, Literal["sum", "min", "max"]]:
    return {f"{prefix}/sum": "sum", f"{prefix}/count": "sum", f"{prefix}/min": "min", f"{prefix}/max": "max"}


def _stats(values: Tensor, prefix: str) -> dict[str, float]:
    v = values.double()
    if v.numel() == 0:
        return {f"{prefix}/sum": 0.0, f"{prefix}/count": 0.0}
    return {f"{prefix}/sum": float(v.sum()), f"{prefix}/count": float(v.numel()),
            f"{prefix}/min": float(v.min()), f"{prefix}/max": float(v.max())}


class _ScoringRole(Role):
    """Hosts one scorer; subclasses register ``score`` with their output field."""

    def __init__(self, ctx: WorkerContext, config: ScoreConfig) -> None:
        super().__init__(ctx)
        self.config = config
        torch.manual_seed(config.seed)
        self.scorer: Scorer = config.scorer.build(ctx.device)

    def rank_local(self) -> frozenset[str]:
        """Every method: each rank scores its own rows with its own scorer."""
        return frozenset({"score", "stats"})

    def _score(self, batch: Mapping[str, Tensor], *, where: str) -> Tensor:
        require_fields(batch, F.SEQUENCE, where=where)
        if batch[F.PROMPT_IDS].shape[0] == 0:  # a rank's empty share: nothing to score
            return torch.zeros(0, dtype=torch.float32)
        inputs = ScoreInputs(
            prompt_ids=batch[F.PROMPT_IDS], prompt_mask=batch[F.PROMPT_MASK],
            response_ids=batch[F.RESPONSE_IDS], response_mask=batch[F.RESPONSE_MASK],
            answer_ids=batch.get(F.ANSWER_IDS), uids=batch.get(F.UID),
        )
        return self.scorer(inputs).to(torch.float32).cpu()


class RewardWorker(_ScoringRole):
    """Rewards: ``score`` writes ``scores``.

    Args:
        ctx: where this rank runs.
        config: the scorer.
    """

    Config = ScoreConfig

    @register(protocol=DP(), reads=F.SEQUENCE, optional=(F.ANSWER_IDS, F.UID), writes=(F.SCORES,))
    def score(self, batch: Batch) -> dict[str, Tensor]:
        """One reward per sample.

        Reads the sequence fields, plus ``answer_ids`` and ``uid`` when the rows
        have them (rule rewards pass them to the function).

        Args:
            batch: rollout rows.

        Returns:
            ``scores``: float32 ``[]`` per row.

        Raises:
            RewardFunctionError: a rule function failed (naming it and the sample).
            MissingFieldError: a field the scorer reads is missing.
        """
        return {F.SCORES: self._score(batch, where="reward.score")}

    @register(protocol=Metrics(over=DP(), reduce=_stat_reducers("reward")), reads=(F.SCORES,))
    def stats(self, batch: Batch) -> dict[str, float]:
        """Sum, count, min and max of ``scores`` (reduced over ranks; the mean is
        ``reward/sum / reward/count``, added by the driver's :func:`score_summary`)."""
        return _stats(batch[F.SCORES], "reward")


class CostWorker(_ScoringRole):
    """Costs (Safe-RLHF): ``score`` writes ``costs``.

    Args:
        ctx: where this rank runs.
        config: the scorer.
    """

    Config = ScoreConfig

    @register(protocol=DP(), reads=F.SEQUENCE, optional=(F.ANSWER_IDS, F.UID), writes=(F.COSTS,))
    def score(self, batch: Batch) -> dict[str, Tensor]:
        """One cost per sample (as :meth:`RewardWorker.score`).

        Args:
            batch: rollout rows.

        Returns:
            ``costs``: float32 ``[]`` per row.

        Raises:
            RewardFunctionError: a rule function failed (naming it and the sample).
            MissingFieldError: a field the scorer reads is missing.
        """
        return {F.COSTS: self._score(batch, where="cost.score")}

    @register(protocol=Metrics(over=DP(), reduce=_stat_reducers("cost")), reads=(F.COSTS,))
    def stats(self, batch: Batch) -> dict[str, float]:
        """Sum, count, min and max of ``costs`` (see :meth:`RewardWorker.stats`)."""
        return _stats(batch[F.COSTS], "cost")


def score_summary(stats: Mapping[str, float]) -> dict[str, float]:
    """``stats`` from :meth:`RewardWorker.stats` / :meth:`CostWorker.stats` with the
    mean added (``reward/mean``, ``cost/mean``)."""
    out = dict(stats)
    for prefix in ("reward", "cost"):
        if out.get(f"{prefix}/count"):
            out[f"{prefix}/mean"] = out[f"{prefix}/sum"] / out[f"{prefix}/count"]
    return out
