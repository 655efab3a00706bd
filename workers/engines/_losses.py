"""Loss functions and estimators for RLHF training, as pure vectorised tensor functions.

Every function here takes padded ``[B, R]`` tensors over the response tokens and a
``mask`` (1 on real response tokens, 0 on padding) and never loops over tokens. They
hold no state and know nothing about parallelism, so the training engine, the
algorithms and the tests all call the same code.

The per-token policy and value losses return their unreduced terms; how the terms
become one scalar is a :class:`LossAggregation`, kept separate so that the engine can
split a batch into micro-batches and data-parallel shards and still reduce exactly as
one full-batch step would.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engines._errors import EngineConfigError

_LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to this magnitude before ``exp`` so that a stale sample cannot
overflow to ``inf`` (e^20 is far beyond any clip range)."""


# --------------------------------------------------------------------------- masked ops


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is non-zero.

    Args:
        values: any shape.
        mask: broadcastable to ``values``; 1 keeps an entry, 0 drops it.
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked sum (a scalar when ``dim`` is None).
    """
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is non-zero.

    Args:
        values: any shape.
        mask: broadcastable to ``values``.
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked mean; 0 where the mask selects nothing.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of ``values`` (a scalar).

    Args:
        values: any shape.
        mask: broadcastable to ``values``.
        unbiased: apply Bessel's correction (n / (n - 1)).

    Returns:
        The masked variance; 0 when fewer than two entries are selected.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Normalise the masked entries of ``values`` to zero mean and unit variance.

    The mean and the (unbiased) variance are those of every selected entry of the
    whole batch: with ``sum_over_ranks`` this rank's rows are one share of a batch
    spread over ranks, and the statistics are computed from sums over all shares
    (two reductions: count and sum, then the squared deviations), so the result
    does not depend on how the rows are spread. Sums are taken in float64.

    Args:
        values: any shape, e.g. advantages ``[B, R]`` (``B`` may be 0).
        mask: broadcastable to ``values``.
        shift_mean: when False the mean is added back (only the scale changes).
        eps: added to the variance before the square root.
        sum_over_ranks: adds a float64 tensor of partial sums over the ranks that
            hold the batch's other rows (e.g. :func:`workers.roles.sum_over_call_rows`);
            None: these rows are the whole batch.

    Returns:
        Whitened values (``values``' dtype), 0 at masked-out entries.
    """
    total = sum_over_ranks if sum_over_ranks is not None else _identity
    keep = torch.broadcast_to(mask, values.shape).bool()
    wide = torch.where(keep, values.to(torch.float64), 0.0)
    count, summed = total(torch.stack([keep.sum().to(torch.float64), wide.sum()])).unbind()
    mean = summed / count.clamp(min=1)
    deviations = torch.where(keep, wide - mean, 0.0)
    squares = total(deviations.pow(2).sum().reshape(1))[0]
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares))
    whitened = deviations * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * keep).to(values.dtype)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


# ------------------------------------------------------------------ log-probs, entropy


def _row_chunks(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    size = n if not chunk_size or chunk_size <= 0 else chunk_size
    return [(lo, min(lo + size, n)) for lo in range(0, max(n, 1), max(size, 1))]


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 1024
) -> Tensor:
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)``.

    Computed as ``logit[label] - logsumexp(logits)`` over chunks of rows, so the full
    ``[N, V]`` log-softmax is never materialised and only one chunk at a time is
    upcast to float32 (under autograd each chunk's float copy is kept for backward).

    Args:
        logits: ``[..., V]`` in any float dtype.
        labels: ``[...]`` integer token ids, the shape of ``logits`` without ``V``.
        temperature: divides the logits; 1.0 is the rollout engines' convention.
        chunk_size: rows (flattened leading dims) per chunk; None or 0 for one chunk.

    Returns:
        float32 ``[...]`` log-probabilities.
    """
    vocab = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1)
    parts = []
    for lo, hi in _row_chunks(flat_labels.shape[0], chunk_size):
        chunk = flat_logits[lo:hi].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_labels[lo:hi, None]).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts).reshape(labels.shape)


def entropy_from_logits(
    logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 1024
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` chunk by chunk (see
    :func:`logprobs_from_logits` for the memory behaviour).

    Args:
        logits: ``[..., V]``.
        temperature: divides the logits.
        chunk_size: rows per chunk; None or 0 for one chunk.

    Returns:
        float32 ``[...]`` entropies in nats.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    parts = []
    for lo, hi in _row_chunks(flat.shape[0], chunk_size):
        chunk = flat[lo:hi].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        probs = torch.softmax(chunk, dim=-1)
        parts.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


# -------------------------------------------------------------------- KL estimators


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator of KL(pi || ref) per token: ``log pi - log ref`` (unbiased, high variance).

    Args:
        logprobs: log-probs of the sampled tokens under the policy (samples drawn from it).
        ref_logprobs: log-probs of the same tokens under the reference model.

    Returns:
        Per-token estimates, same shape as the inputs.
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator: ``0.5 * (log ref - log pi)^2`` (biased, low variance, always >= 0).

    Args:
        logprobs: policy log-probs of the sampled tokens.
        ref_logprobs: reference log-probs of the same tokens.

    Returns:
        Per-token estimates.
    """
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator: ``r - 1 - log r`` with ``r = ref / pi`` (unbiased, low variance, >= 0).

    The log-ratio is clamped to +-20 before ``exp`` to keep it finite.

    Args:
        logprobs: policy log-probs of the sampled tokens.
        ref_logprobs: reference log-probs of the same tokens.

    Returns:
        Per-token estimates.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - 1.0 - log_ratio


class KLEstimator(enum.StrEnum):
    """Which per-token KL(pi || ref) estimator to use (Schulman, "Approximating KL divergence")."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"

    def estimate(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """Per-token KL estimate.

        Args:
            logprobs: policy log-probs of the sampled tokens.
            ref_logprobs: reference log-probs of the same tokens.

        Returns:
            Per-token estimates, same shape as the inputs.
        """
        return _KL_FUNCTIONS[self](logprobs, ref_logprobs)


_KL_FUNCTIONS: dict[KLEstimator, Callable[[Tensor, Tensor], Tensor]] = {
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
}


# ------------------------------------------------------------------------ aggregation


def _token_mean_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return masked_sum(values, mask), mask.sum().to(values.dtype)


def _seq_mean_token_mean_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    lengths = mask.sum(dim=-1)
    seq_means = masked_sum(values, mask, dim=-1) / lengths.clamp(min=1)
    return seq_means.sum(), (lengths > 0).sum().to(values.dtype)


def _seq_mean_token_sum_parts(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    lengths = mask.sum(dim=-1)
    return masked_sum(values, mask), (lengths > 0).sum().to(values.dtype)


class LossAggregation(enum.StrEnum):
    """How per-token loss terms become one scalar.

    Every mode is a sum of per-row contributions divided by a normaliser that is also
    a sum over rows, which is what lets micro-batches and data-parallel shards add
    their parts and divide once by the global normaliser.
    """

    TOKEN_MEAN = "token-mean"
    """Mean over all response tokens of the batch (long answers weigh more)."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Mean over sequences of each sequence's token mean (the GRPO paper's form)."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Mean over sequences of each sequence's token sum."""

    def parts(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Numerator and normaliser of this aggregation over some rows.

        Args:
            values: ``[B, R]`` per-token terms.
            mask: ``[B, R]`` response mask.

        Returns:
            ``(numerator, normaliser)`` scalars; the loss is the sum of numerators over
            all rows divided by the sum of normalisers.
        """
        return _AGGREGATION_PARTS[self](values, mask)

    def reduce(self, values: Tensor, mask: Tensor) -> Tensor:
        """The aggregated scalar over exactly these rows.

        Args:
            values: ``[B, R]`` per-token terms.
            mask: ``[B, R]`` response mask.

        Returns:
            A scalar; 0 when the mask is empty.
        """
        numerator, normaliser = self.parts(values, mask)
        return numerator / normaliser.clamp(min=1)


_AGGREGATION_PARTS: dict[LossAggregation, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    LossAggregation.TOKEN_MEAN: _token_mean_parts,
    LossAggregation.SEQ_MEAN_TOKEN_MEAN: _seq_mean_token_mean_parts,
    LossAggregation.SEQ_MEAN_TOKEN_SUM: _seq_mean_token_sum_parts,
}


# ----------------------------------------------------------------------- policy, value


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
        EngineConfigError: if ``dual_clip`` is not greater than 1.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise EngineConfigError(
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


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = KLEstimator.K3,
    aggregation: LossAggregation = LossAggregation.SEQ_MEAN_TOKEN_MEAN,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO objective: clipped ratio on group-normalised advantages plus a KL loss term.

    Args:
        logprobs: ``[B, R]`` current log-probs.
        old_logprobs: ``[B, R]`` sampling-policy log-probs.
        advantages: ``[B]`` group-normalised outcome advantages (see
            :func:`grpo_advantages`) or ``[B, R]``.
        mask: ``[B, R]`` response mask.
        clip_ratio: ratio clip epsilon (lower, and upper unless ``clip_ratio_high``).
        clip_ratio_high: upper clip epsilon.
        ref_logprobs: ``[B, R]`` reference log-probs; required when ``kl_coef > 0``.
        kl_coef: weight of the KL(pi || ref) loss term (the GRPO paper uses k3).
        kl_estimator: estimator for the KL term.
        aggregation: how tokens and sequences are averaged.

    Returns:
        ``(loss, metrics)`` with metrics ``clip_fraction``, ``approx_kl`` and ``kl``.

    Raises:
        EngineConfigError: if ``kl_coef > 0`` without ``ref_logprobs``.
    """
    terms = ppo_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio_high,
    )
    per_token = terms.loss
    kl = torch.zeros_like(per_token)
    if kl_coef:
        if ref_logprobs is None:
            raise EngineConfigError(
                "grpo_loss: kl_coef > 0 needs ref_logprobs; pass them or set kl_coef=0"
            )
        kl = kl_estimator.estimate(logprobs, ref_logprobs)
        per_token = per_token + kl_coef * kl
    metrics = {
        "clip_fraction": masked_mean(terms.clipped, mask),
        "approx_kl": masked_mean(terms.approx_kl, mask),
        "kl": masked_mean(kl.detach(), mask),
    }
    return aggregation.reduce(per_token, mask), metrics
