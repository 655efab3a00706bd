"""What ``ActorWorker.update`` derives from the rows' ``policy_version`` (asynchronous
training): the columns the loss corrects stale tokens by, and how old the tokens are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from channels import Batch
from workers.objectives import BEHAVIOUR_LOGPROBS, STALE_TOKENS
from workers.roles import _fields as F

VERSION_METRICS_REDUCE: dict[str, Literal["mean", "token_mean", "max"]] = {"actor/version_lag_mean": "token_mean", "actor/version_lag_max": "max",
                          "actor/mixed_version_samples": "mean"}
"""How :func:`version_metrics` combine over data-parallel ranks."""


def staleness_columns(batch: Batch, step: int) -> tuple[Mapping[str, Tensor], tuple[str, ...]]:
    """``batch`` with the columns :class:`~workers.objectives.PolicyLoss` corrects stale
    tokens by (when it has ``policy_version`` and ``rollout_logprobs``): which tokens
    an older version than ``step`` sampled, and their behaviour log-probs. Returns
    the batch and the added column names (none without those columns)."""
    if F.POLICY_VERSION not in batch or F.ROLLOUT_LOGPROBS not in batch:
        return batch, ()
    stale = (batch[F.POLICY_VERSION] < step).to(torch.float32)
    return ({**batch, STALE_TOKENS: stale, BEHAVIOUR_LOGPROBS: batch[F.ROLLOUT_LOGPROBS]},
            (STALE_TOKENS, BEHAVIOUR_LOGPROBS))


def version_metrics(batch: Mapping[str, Tensor], step: int) -> dict[str, float]:
    """How many versions behind ``step`` this rank's response tokens were sampled:
    ``actor/version_lag_mean`` (a token mean) and ``actor/version_lag_max``, and
    ``actor/mixed_version_samples``, the fraction of samples whose tokens more than
    one version sampled (partial rollouts continued under newer weights). Empty
    without ``policy_version`` or without response tokens."""
    if F.POLICY_VERSION not in batch:
        return {}
    mask = batch[F.RESPONSE_MASK].bool()
    if not mask.any():
        return {}
    versions = batch[F.POLICY_VERSION]
    lag = (step - versions)[mask].to(torch.float64)
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(mask, versions, -big).amax(1)
    oldest = torch.where(mask, versions, big).amin(1)
    answered = mask.any(1)
    mixed = (newest > oldest) & answered
    return {"actor/version_lag_mean": float(lag.mean()), "actor/version_lag_max": float(lag.max()),
            "actor/mixed_version_samples": float(mixed.sum()) / max(int(answered.sum()), 1)}
