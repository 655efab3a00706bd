"""The policy and value losses of RLHF training (PPO's clipped objective, the
correction of tokens an older policy sampled, the clipped value loss),
as pure vectorised tensor functions over padded ``[B, R]`` response tokens, built
on :mod:`workers.objectives._losses`' masked reductions and estimators.

Like those, they return unreduced per-token terms; a
:class:`~workers.objectives.LossAggregation` makes them one scalar.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from channels import ConfigError
from workers.objectives._losses import _LOG_RATIO_LIMIT


@dataclass(frozen=True, kw_only=True)
class PolicyLossTerms:
    """Unreduced terms of the PPO clipped policy loss (all ``[B, R]``)."""

    loss: Tensor
    """Per-token loss to aggregate."""
    clipped: Tensor
    """1.0 where the ratio clip was active (the clipped objective was taken)."""
    dual_clipped: Tensor
    """1.0 where the dual clip bound was active (negative advantages only)."""
    ratio: Tensor
    """pi / pi_old per token."""
    approx_kl: Tensor
    """k1 estimate of KL(pi_old || pi): ``log pi_old - log pi``."""


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate per token, with optional dual clip (Ye et al., 2020).

    ``loss = max(-A r, -A clip(r, 1 - low, 1 + high))``; with ``dual_clip = c`` the loss of
    tokens with ``A < 0`` is further bounded by ``-A c``.

    Args:
        logprobs: ``[B, R]`` current log-probs (carry gradients).
        old_logprobs: ``[B, R]`` log-probs of the policy that sampled the tokens.
        advantages: ``[B, R]`` or ``[B]`` (broadcast over tokens).
        clip_ratio_low: lower clip epsilon.
        clip_ratio_high: upper clip epsilon; None uses ``clip_ratio_low`` (DAPO's
            "clip-higher" sets it larger).
        dual_clip: the constant c > 1 of dual clip; None disables it.

    Returns:
        The per-token terms; reduce ``loss`` with a :class:`LossAggregation`.

    Raises:
        ConfigError: if ``dual_clip`` is not greater than 1.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ConfigError(
            f"dual_clip must be > 1 (it bounds -A*ratio at -A*c), got {dual_clip}"
        )
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).float()
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_mask = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_mask, bound.expand_as(loss), loss)
        dual_active = dual_mask.float()
    return PolicyLossTerms(
        loss=loss,
        clipped=clip_active,
        dual_clipped=dual_active,
        ratio=ratio.detach(),
        approx_kl=(-log_ratio).detach(),
    )


class OffPolicyCorrection(enum.StrEnum):
    """How the policy loss treats tokens an older policy sampled (asynchronous
    training): their behaviour policy (the rollout's log-probs) is not the
    proximal policy the update starts from (``old_logprobs``)."""

    DECOUPLED = "decoupled"
    """Decoupled PPO (Hilton et al. 2021; AReaL): the clipped ratio is taken
    against the proximal policy, and each stale token's policy-gradient term is
    weighted by the truncated importance weight ``min(pi_prox / pi_behav, cap)``."""
    BEHAVIOUR = "behaviour"
    """Plain PPO against the behaviour policy: the ratio of stale tokens is taken
    against the rollout's log-probs (the clip bounds the step); no weight."""


@dataclass(frozen=True, kw_only=True)
class StalenessTerms:
    """What :func:`staleness_correction` gives the policy loss (all ``[B, R]``)."""

    old_logprobs: Tensor
    """The log-probs the PPO ratio is taken against."""
    weight: Tensor
    """Each token's importance weight (1 on fresh tokens)."""
    truncated: Tensor
    """1.0 where the weight was capped."""


def staleness_correction(old_logprobs: Tensor, behaviour_logprobs: Tensor, stale: Tensor, *,
                         mode: OffPolicyCorrection, cap: float) -> StalenessTerms:
    """The off-policy correction of tokens sampled by an older policy.

    Fresh tokens (``stale`` 0: sampled by the policy the update starts from) are
    left exactly as on-policy training has them (weight 1, ``old_logprobs``), so a
    run without stale tokens computes what synchronous training computes.

    Args:
        old_logprobs: ``[B, R]`` the proximal policy's log-probs (the update's start).
        behaviour_logprobs: ``[B, R]`` the sampling policy's (the rollout engine's).
        stale: ``[B, R]`` 1 where the token's policy version is older than the update's.
        mode: decoupled (truncated importance weight) or behaviour (ratio against
            the behaviour policy).
        cap: the largest importance weight (``decoupled``).

    Returns:
        The ratio's reference log-probs, the weights and where they were capped.
    """
    stale = stale.bool()
    if mode == OffPolicyCorrection.BEHAVIOUR:
        ones = torch.ones_like(old_logprobs)
        return StalenessTerms(old_logprobs=torch.where(stale, behaviour_logprobs, old_logprobs), weight=ones,
                              truncated=torch.zeros_like(ones))
    log_weight = (old_logprobs - behaviour_logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    raw = torch.exp(log_weight)
    weight = torch.where(stale, raw.clamp(max=cap), torch.ones_like(raw))
    return StalenessTerms(old_logprobs=old_logprobs, weight=weight.detach(),
                          truncated=(stale & (raw > cap)).float())


@dataclass(frozen=True, kw_only=True)
class ValueLossTerms:
    """Unreduced terms of the clipped value loss (all ``[B, R]``)."""

    loss: Tensor
    """Per-token loss ``0.5 * max((v - G)^2, (v_clipped - G)^2)``."""
    clipped: Tensor
    """1.0 where the clipped error was the larger one."""


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, clip_range: float | None = 0.2
) -> ValueLossTerms:
    """PPO's clipped value loss per token.

    Args:
        values: ``[B, R]`` current value predictions (carry gradients).
        old_values: ``[B, R]`` predictions at rollout time.
        returns: ``[B, R]`` regression targets.
        clip_range: how far a prediction may move from ``old_values``; None disables
            clipping (plain squared error).

    Returns:
        The per-token terms.
    """
    error = (values - returns) ** 2
    if clip_range is None:
        return ValueLossTerms(loss=0.5 * error, clipped=torch.zeros_like(error))
    moved = old_values + (values - old_values).clamp(-clip_range, clip_range)
    error_clipped = (moved - returns) ** 2
    return ValueLossTerms(
        loss=0.5 * torch.maximum(error, error_clipped),
        clipped=(error_clipped > error).float(),
    )
