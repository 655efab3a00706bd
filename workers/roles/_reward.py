"""The reward and cost roles: one score per sample, by a rule function or a model.

Both host a scorer from ``workers.rewards`` (picked by the type of
``ScoreConfig.scorer``) and differ only in the field they write: ``scores`` for
rewards, ``costs`` for costs (Safe-RLHF). Rows are split over the pool's ranks.

A rule scorer reads every column of the rows: the function gets the rows' own
columns (those outside the field contract of ``workers.roles``, plus
``answer_ids``) by keyword. With several weighted functions, ``score`` also writes
each function's own scores as ``scores/<name>`` (``costs/<name>``), which ``stats``
reports as ``reward/<name>/mean`` (``cost/<name>/mean``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from channels import DP, Batch, ConfigError, Metrics
from workers.host import CallInfo, Role, WorkerContext, register
from workers.rewards import ModelRewardConfig, RuleRewardConfig, RuleScorer, ScoreInputs, Scorer
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


_CONTRACT = frozenset({
    F.PROMPT_IDS, F.PROMPT_MASK, F.UID, F.ANSWER_IDS, F.RESPONSE_IDS, F.RESPONSE_MASK, F.ROLLOUT_LOGPROBS,
    F.OLD_LOGPROBS, F.ENTROPY, F.REF_LOGPROBS, F.VALUES, F.SCORES, F.COSTS, F.ADVANTAGES, F.RETURNS,
})
"""Fields of the data contract: never passed to a reward function as a column
(``answer_ids`` travels separately and reaches it as ``answer``)."""


def user_columns(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The rows' own columns a rule reward function gets: every field outside the
    contract, except internal ones (``_``-prefixed) and per-function scores (``x/y``)."""
    return {k: v for k, v in batch.items() if k not in _CONTRACT and not k.startswith("_") and "/" not in k}


def component_fields(config: object, field: str) -> tuple[str, ...]:
    """``<field>/<name>`` per function of a rule scorer with several functions; ()
    otherwise (one function, a model, or no config)."""
    scorer = getattr(config, "scorer", None)
    if not isinstance(scorer, RuleRewardConfig) or len(scorer.labels) < 2:
        return ()
    return tuple(f"{field}/{label}" for label in scorer.labels)


def _score_reads(info: CallInfo) -> Any:
    """A rule scorer pulls every column (None: its function may take any of them; the
    sequence fields are then checked on the worker); a model only the sequence."""
    return None if isinstance(getattr(info.config, "scorer", None), RuleRewardConfig) else F.SEQUENCE


def _stat_reducers(prefix: str) -> dict[str, Literal["sum", "min", "max"]]:
    return {f"{prefix}/sum": "sum", f"{prefix}/count": "sum", f"{prefix}/min": "min", f"{prefix}/max": "max"}


def _stats(batch: Mapping[str, Tensor], field: str, prefix: str) -> dict[str, float]:
    v = batch[field].double()
    if v.numel() == 0:
        return {f"{prefix}/sum": 0.0, f"{prefix}/count": 0.0}
    out = {f"{prefix}/sum": float(v.sum()), f"{prefix}/count": float(v.numel()),
           f"{prefix}/min": float(v.min()), f"{prefix}/max": float(v.max())}
    for name, values in batch.items():  # each function's mean, reduced over ranks by rows (Metrics' default)
        if name.startswith(f"{field}/"):
            out[f"{prefix}/{name.split('/', 1)[1]}/mean"] = float(values.double().mean())
    return out


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

    def _score(self, batch: Mapping[str, Tensor], *, where: str, field: str) -> dict[str, Tensor]:
        require_fields(batch, F.SEQUENCE, where=where)
        components = component_fields(self.config, field)
        if batch[F.PROMPT_IDS].shape[0] == 0:  # a rank's empty share: nothing to score
            return {name: torch.zeros(0, dtype=torch.float32) for name in (field, *components)}
        rule = isinstance(self.scorer, RuleScorer)
        inputs = ScoreInputs(
            prompt_ids=batch[F.PROMPT_IDS], prompt_mask=batch[F.PROMPT_MASK],
            response_ids=batch[F.RESPONSE_IDS], response_mask=batch[F.RESPONSE_MASK],
            answer_ids=batch.get(F.ANSWER_IDS), uids=batch.get(F.UID),
            columns=user_columns(batch) if rule else {},
        )
        if not isinstance(self.scorer, RuleScorer):
            return {field: self.scorer(inputs).to(torch.float32).cpu()}
        total, parts = self.scorer.score(inputs)
        out = {field: total.cpu()}
        if components:
            out.update({f"{field}/{label}": values.cpu() for label, values in parts.items()})
        return out


class RewardWorker(_ScoringRole):
    """Rewards: ``score`` writes ``scores``.

    Args:
        ctx: where this rank runs.
        config: the scorer.
    """

    Config = ScoreConfig

    @register(protocol=DP(), reads=_score_reads, optional=(F.ANSWER_IDS, F.UID, *F.SEQUENCE_OPTIONAL),
              writes=lambda info: (F.SCORES, *component_fields(info.config, F.SCORES)))
    def score(self, batch: Batch) -> dict[str, Tensor]:
        """One reward per sample.

        A model reads the sequence fields; a rule function reads every column (the
        sequence, ``answer_ids`` and the rows' own columns, see :func:`user_columns`).

        Args:
            batch: rollout rows.

        Returns:
            ``scores``: float32 ``[]`` per row; with several rule functions also
            ``scores/<name>``, each function's own (unweighted) score.

        Raises:
            RewardFunctionError: a rule function failed (naming it and the sample).
            MissingFieldError: a field the scorer reads is missing.
            SchemaError: a rule function takes a column the rows lack.
        """
        return self._score(batch, where="reward.score", field=F.SCORES)

    @register(protocol=Metrics(over=DP(), reduce=_stat_reducers("reward")), reads=(F.SCORES,),
              optional=lambda info: component_fields(info.config, F.SCORES))
    def stats(self, batch: Batch) -> dict[str, float]:
        """Sum, count, min and max of ``scores`` (reduced over ranks; the mean is
        ``reward/sum / reward/count``, added by the driver's :func:`score_summary`),
        and ``reward/<name>/mean`` per function when the rows carry ``scores/<name>``."""
        return _stats(batch, F.SCORES, "reward")


class CostWorker(_ScoringRole):
    """Costs (Safe-RLHF): ``score`` writes ``costs``.

    Args:
        ctx: where this rank runs.
        config: the scorer.
    """

    Config = ScoreConfig

    @register(protocol=DP(), reads=_score_reads, optional=(F.ANSWER_IDS, F.UID, *F.SEQUENCE_OPTIONAL),
              writes=lambda info: (F.COSTS, *component_fields(info.config, F.COSTS)))
    def score(self, batch: Batch) -> dict[str, Tensor]:
        """One cost per sample (as :meth:`RewardWorker.score`).

        Args:
            batch: rollout rows.

        Returns:
            ``costs``: float32 ``[]`` per row (and ``costs/<name>`` per function when
            there are several).

        Raises:
            RewardFunctionError: a rule function failed (naming it and the sample).
            MissingFieldError: a field the scorer reads is missing.
            SchemaError: a rule function takes a column the rows lack.
        """
        return self._score(batch, where="cost.score", field=F.COSTS)

    @register(protocol=Metrics(over=DP(), reduce=_stat_reducers("cost")), reads=(F.COSTS,),
              optional=lambda info: component_fields(info.config, F.COSTS))
    def stats(self, batch: Batch) -> dict[str, float]:
        """Sum, count, min and max of ``costs`` (see :meth:`RewardWorker.stats`)."""
        return _stats(batch, F.COSTS, "cost")


def score_summary(stats: Mapping[str, float]) -> dict[str, float]:
    """``stats`` from :meth:`RewardWorker.stats` / :meth:`CostWorker.stats` with the
    mean added (``reward/mean``, ``cost/mean``)."""
    out = dict(stats)
    for prefix in ("reward", "cost"):
        if out.get(f"{prefix}/count"):
            out[f"{prefix}/mean"] = out[f"{prefix}/sum"] / out[f"{prefix}/count"]
    return out
