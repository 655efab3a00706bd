"""Pluggable training objectives: what the engine minimises, separate from how it runs.

An objective is a callable ``loss(outputs, batch) -> LossTerms``: it reads the model
outputs of one micro-batch (log-probs, entropy or values over the response tokens)
and the batch tensors of the same rows, and returns *per-token* loss terms. The
objective names how they are aggregated (``loss_agg``, a :class:`LossAggregation`);
the engine applies it over the global batch (every data-parallel rank's rows and
every micro-batch), which keeps gradient accumulation and data parallelism exact
whatever the objective.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from torch import Tensor

from channels import ConfigError
from workers.objectives._losses import KLEstimator, LossAggregation, rollout_consistency_terms
from workers.objectives._policy_losses import (
    OffPolicyCorrection,
    clipped_value_loss,
    ppo_policy_loss,
    staleness_correction,
)

E = TypeVar("E", bound=enum.Enum)

BEHAVIOUR_LOGPROBS = "behaviour_logprobs"
"""Optional column of :class:`PolicyLoss`, float32 ``[R]``: the log-probs of the policy
that sampled the tokens (the rollout engine's), read with :data:`STALE_TOKENS`."""
STALE_TOKENS = "stale_tokens"
"""Optional column of :class:`PolicyLoss`, ``[R]``: 1 on tokens an older policy than the
update's sampled (``PolicyLoss.off_policy`` corrects them)."""


@dataclass(frozen=True, kw_only=True)
class ModelOutputs:
    """What a model head computed for a micro-batch, over its response tokens (``[b, R]``)."""

    logprobs: Tensor | None = None
    """Log-probs of the response tokens (causal LM heads)."""
    entropy: Tensor | None = None
    """Entropy of the next-token distribution at each response position (causal LM heads)."""
    values: Tensor | None = None
    """Value predictions for the response positions (value heads)."""

    def require(self, name: str) -> Tensor:
        """Return the output ``name``, or fail saying which head produces it.

        Args:
            name: ``"logprobs"``, ``"entropy"`` or ``"values"``.

        Returns:
            The tensor.

        Raises:
            ConfigError: if the engine's head did not produce it.
        """
        value = getattr(self, name)
        if value is None:
            head = "ValueHead" if name == "values" else "CausalLMHead"
            raise ConfigError(
                f"the loss needs model output {name!r}, which this engine's head does not "
                f"produce; build the engine with head={head}()"
            )
        return value


@dataclass(frozen=True, kw_only=True)
class LossTerms:
    """Per-token results of an objective on one micro-batch."""

    per_token: Tensor
    """``[b, R]`` loss terms; the engine aggregates them over the global batch."""
    metrics: Mapping[str, Tensor] = field(default_factory=dict)
    """``[b, R]`` per-token statistics, reported as their token mean over the global batch."""
    maxima: Mapping[str, Tensor] = field(default_factory=dict)
    """``[b, R]`` per-token statistics, reported as their largest value over the global
    batch's real tokens (0 when it has none)."""


class LossFn(Protocol):
    """A training objective (see the module docstring)."""

    @property
    def required_fields(self) -> tuple[str, ...]:
        """Batch fields the objective reads, checked before any compute."""
        ...

    @property
    def uses_entropy(self) -> bool:
        """Whether the loss differentiates through the entropy (so it needs its graph)."""
        ...

    @property
    def loss_agg(self) -> LossAggregation | None:
        """How the per-token terms become one scalar over the global batch; None: the
        engine's ``TrainingConfig.loss_aggregation``."""
        ...

    def __call__(self, outputs: ModelOutputs, batch: Mapping[str, Tensor]) -> LossTerms:
        """Per-token loss terms for one micro-batch (``batch`` holds the same rows)."""
        ...


def _member(field_name: str, kind: type[E], value: object) -> E:
    """``value`` as a member of ``kind`` (members and their values are accepted);
    a :class:`ConfigError` naming ``field_name`` and the allowed values otherwise."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{field_name} must be one of {allowed}, got {value!r}") from None


def _check_non_negative(owner: str, name: str, value: float | None) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"{owner}.{name} must be >= 0, got {value}")


def _loss_agg(owner: str, value: object) -> LossAggregation | None:
    """``value`` as an aggregation (strings such as ``"token-mean"`` accepted), or None."""
    return None if value is None else _member(f"{owner}.loss_agg", LossAggregation, value)


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """PPO clipped policy loss with optional dual clip, entropy bonus and KL loss term.

    GRPO is this loss with ``kl_coef > 0`` (k3), group-normalised advantages
    (:func:`grpo_advantages`) and ``loss_agg="seq-mean-token-mean"``.
    Reads ``old_logprobs``, ``advantages`` (``[B, R]`` or ``[B]``) and, with a KL term,
    ``ref_logprobs``.
    """

    clip_ratio_low: float = 0.2
    """Lower ratio clip epsilon."""
    clip_ratio_high: float | None = None
    """Upper ratio clip epsilon; None uses ``clip_ratio_low``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl_coef: float = 0.0
    """Weight of the KL(pi || ref) loss term; 0 disables it (and the need for ref_logprobs)."""
    kl_estimator: KLEstimator = KLEstimator.K3
    """Estimator of the KL loss term."""
    loss_agg: LossAggregation | None = None
    """How the per-token terms are aggregated over the global batch: ``"token-mean"``
    (every token weighs the same; normalised by the global token count across
    data-parallel ranks and micro-batches, as verl does), ``"seq-mean-token-mean"``
    or ``"seq-mean-token-sum"``. None uses the engine's
    ``TrainingConfig.loss_aggregation``, whose default is ``"token-mean"``: the
    behaviour before this setting existed."""
    off_policy: OffPolicyCorrection = OffPolicyCorrection.BEHAVIOUR
    """How tokens an older policy sampled are corrected, when the batch marks them
    (:data:`STALE_TOKENS`, with :data:`BEHAVIOUR_LOGPROBS`): ``"behaviour"``
    (default) or ``"decoupled"`` (see :class:`OffPolicyCorrection`).
    Fresh tokens are never touched."""
    is_cap: float = 2.0
    """The largest importance weight of a stale token (``"decoupled"``)."""

    def __post_init__(self) -> None:
        for name in ("clip_ratio_low", "clip_ratio_high", "entropy_coef", "kl_coef"):
            _check_non_negative("PolicyLoss", name, getattr(self, name))
        object.__setattr__(self, "off_policy", _member("PolicyLoss.off_policy", OffPolicyCorrection,
                                                          self.off_policy))
        if not self.is_cap >= 1.0:
            raise ConfigError(f"PolicyLoss.is_cap must be >= 1 (it caps pi_prox / pi_behav), "
                                    f"got {self.is_cap}")
        object.__setattr__(self, "loss_agg", _loss_agg("PolicyLoss", self.loss_agg))
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(
                f"PolicyLoss.dual_clip must be > 1 (typically 3.0) or None, got {self.dual_clip}"
            )
        estimator = _member("PolicyLoss.kl_estimator", KLEstimator, self.kl_estimator)
        object.__setattr__(self, "kl_estimator", estimator)

    @property
    def required_fields(self) -> tuple[str, ...]:
        """Batch fields read: old_logprobs, advantages (and ref_logprobs with a KL term)."""
        ref = ("ref_logprobs",) if self.kl_coef else ()
        return ("old_logprobs", "advantages", *ref)

    @property
    def uses_entropy(self) -> bool:
        """True when the entropy bonus is on."""
        return self.entropy_coef != 0.0

    def __call__(self, outputs: ModelOutputs, batch: Mapping[str, Tensor]) -> LossTerms:
        """Per-token PPO loss; metrics: clip_fraction, approx_kl, entropy, kl,
        dual_clip_fraction and, on a batch with :data:`STALE_TOKENS`,
        ``stale_fraction``, ``is_weight`` and ``is_truncated_fraction``.

        Args:
            outputs: the micro-batch's model outputs (needs ``logprobs``).
            batch: the micro-batch's tensors.

        Returns:
            The per-token terms.
        """
        logprobs = outputs.require("logprobs")
        old = batch["old_logprobs"]
        stale = None
        if STALE_TOKENS in batch:
            stale = staleness_correction(old, batch[BEHAVIOUR_LOGPROBS], batch[STALE_TOKENS],
                                         mode=self.off_policy, cap=self.is_cap)
            old = stale.old_logprobs
        terms = ppo_policy_loss(
            logprobs,
            old,
            batch["advantages"],
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            dual_clip=self.dual_clip,
        )
        per_token = terms.loss
        metrics: dict[str, Tensor] = {"clip_fraction": terms.clipped, "approx_kl": terms.approx_kl}
        if stale is not None:  # the importance weight scales the policy-gradient term only
            per_token = per_token * stale.weight
            metrics |= {"stale_fraction": batch[STALE_TOKENS].float(), "is_weight": stale.weight,
                        "is_truncated_fraction": stale.truncated}
        if self.dual_clip is not None:
            metrics["dual_clip_fraction"] = terms.dual_clipped
        if outputs.entropy is not None:
            metrics["entropy"] = outputs.entropy.detach()
        if self.entropy_coef:
            per_token = per_token - self.entropy_coef * outputs.require("entropy")
        if self.kl_coef:
            kl = self.kl_estimator.estimate(logprobs, batch["ref_logprobs"])
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        return LossTerms(per_token=per_token, metrics=metrics)


@dataclass(frozen=True, kw_only=True)
class ValueLoss:
    """Clipped value regression for critics; reads ``old_values`` and ``returns``."""

    clip_range: float | None = 0.2
    """How far predictions may move from old_values before the clipped error applies; None
    disables clipping."""
    coef: float = 1.0
    """Multiplies the loss."""
    loss_agg: LossAggregation | None = None
    """How the per-token errors are aggregated over the global batch (as
    :attr:`PolicyLoss.loss_agg`); None uses the engine's
    ``TrainingConfig.loss_aggregation`` (``"token-mean"`` unless set, as before)."""

    def __post_init__(self) -> None:
        _check_non_negative("ValueLoss", "clip_range", self.clip_range)
        object.__setattr__(self, "loss_agg", _loss_agg("ValueLoss", self.loss_agg))

    @property
    def required_fields(self) -> tuple[str, ...]:
        """Batch fields read: old_values, returns."""
        return ("old_values", "returns")

    @property
    def uses_entropy(self) -> bool:
        """Always False."""
        return False

    def __call__(self, outputs: ModelOutputs, batch: Mapping[str, Tensor]) -> LossTerms:
        """Per-token clipped value loss; metrics: value_clip_fraction, values.

        Args:
            outputs: the micro-batch's model outputs (needs ``values``).
            batch: the micro-batch's tensors.

        Returns:
            The per-token terms.
        """
        values = outputs.require("values")
        terms = clipped_value_loss(
            values, batch["old_values"], batch["returns"], clip_range=self.clip_range
        )
        metrics = {"value_clip_fraction": terms.clipped, "values": values.detach()}
        return LossTerms(per_token=self.coef * terms.loss, metrics=metrics)


@dataclass(frozen=True, kw_only=True)
class NLLLoss:
    """Negative log-likelihood of the response tokens (supervised fine-tuning)."""

    coef: float = 1.0
    """Weight of the loss (e.g. Safe-RLHF's ``ptx_coef``)."""
    loss_agg: LossAggregation | None = None
    """How the per-token terms are aggregated (as :attr:`PolicyLoss.loss_agg`); None
    uses the engine's ``TrainingConfig.loss_aggregation``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_agg", _loss_agg("NLLLoss", self.loss_agg))

    @property
    def required_fields(self) -> tuple[str, ...]:
        """No fields beyond the sequence itself."""
        return ()

    @property
    def uses_entropy(self) -> bool:
        """Always False."""
        return False

    def __call__(self, outputs: ModelOutputs, batch: Mapping[str, Tensor]) -> LossTerms:
        """Per-token ``-log p``; no metrics.

        Args:
            outputs: the micro-batch's model outputs (needs ``logprobs``).
            batch: unused.

        Returns:
            The per-token terms.
        """
        return LossTerms(per_token=-self.coef * outputs.require("logprobs"))


class OnPolicy:
    """``loss`` with ``old_logprobs`` taken from the step's own forward pass, detached.

    For one optimizer step on rows the current policy has just sampled, a separate
    no-grad pass (``actor.log_prob``) gives the same log-probs as the step's own
    forward: the ratio is 1 and the gradient and loss are those of the objective with
    that pass, which is then not needed.

    The objective's metrics gain what compares those log-probs with the batch's
    others, where the micro-batch carries them (the actor's ``rollout_consistency``
    metrics, reported by the step's own reduction instead of a collective of their
    own): ``logprob_mismatch`` (token mean) and ``logprob_mismatch_max`` (largest) of
    ``|rollout_logprobs - old_logprobs|``, and ``kl_to_ref`` (token mean of the k3
    estimate of KL(policy || reference) from ``ref_logprobs``): see
    :func:`~workers.objectives.rollout_consistency_terms`.

    Reads what ``loss`` reads, less ``old_logprobs``.

    Args:
        loss: an objective that reads ``old_logprobs`` and ``outputs.logprobs``.
    """

    def __init__(self, loss: LossFn) -> None:
        self.loss = loss

    @property
    def required_fields(self) -> tuple[str, ...]:
        """``loss``'s fields without ``old_logprobs``."""
        return tuple(f for f in self.loss.required_fields if f != "old_logprobs")

    @property
    def uses_entropy(self) -> bool:
        """As ``loss``."""
        return self.loss.uses_entropy

    @property
    def loss_agg(self) -> LossAggregation | None:
        """As ``loss``."""
        return self.loss.loss_agg

    def __call__(self, outputs: ModelOutputs, batch: Mapping[str, Tensor]) -> LossTerms:
        """``loss`` on the micro-batch with ``old_logprobs`` = this forward's log-probs."""
        own = outputs.require("logprobs").detach()
        terms = self.loss(outputs, {**batch, "old_logprobs": own})
        consistency = rollout_consistency_terms(own, batch)
        maxima = dict(terms.maxima)
        if "logprob_mismatch" in consistency:
            maxima["logprob_mismatch_max"] = consistency["logprob_mismatch"]
        return LossTerms(per_token=terms.per_token, metrics={**terms.metrics, **consistency}, maxima=maxima)
