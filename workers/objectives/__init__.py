"""Losses and advantages of RLHF training, in one place below the engines and the
algorithms (both use them).

- Objectives (:class:`PolicyLoss`, :class:`ValueLoss`, :class:`NLLLoss`;
  :class:`OnPolicy` wraps one): what a training engine minimises, given a
  micro-batch's :class:`ModelOutputs`; a :class:`LossAggregation` makes their
  per-token terms one scalar over the global batch. A custom objective follows the
  :class:`LossFn` protocol and returns :class:`LossTerms`.
- Advantage estimators (GAE, GRPO, RLOO's leave-one-out, ReMax, Safe-RLHF's
  Lagrangian) and reward shaping
  (scores on the last token, a KL penalty folded in, DAPO's overlong punishment),
  vectorised over padded ``[B, R]`` response tokens.
- Token statistics the model heads compute (log-probs and entropy from logits),
  KL estimators, the rollout-consistency comparisons and masked whitening.

Pure tensor functions: they hold no state and know nothing about parallelism.
"""

from workers.objectives._advantages import (
    fold_kl_into_rewards,
    gae_advantages,
    grpo_advantages,
    lagrangian_advantages,
    leave_one_out_advantages,
    overlong_penalties,
    remax_advantages,
    scores_to_token_rewards,
)
from workers.objectives._losses import (
    KLEstimator,
    LossAggregation,
    kl_k3,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    masked_whiten,
    rollout_consistency_terms,
)
from workers.objectives._objectives import (
    BEHAVIOUR_LOGPROBS,
    STALE_TOKENS,
    LossFn,
    LossTerms,
    ModelOutputs,
    NLLLoss,
    OnPolicy,
    PolicyLoss,
    ValueLoss,
)
from workers.objectives._policy_losses import OffPolicyCorrection

__all__ = [
    "BEHAVIOUR_LOGPROBS", "STALE_TOKENS", "KLEstimator", "LossAggregation", "LossFn", "LossTerms",
    "ModelOutputs", "NLLLoss", "OffPolicyCorrection", "OnPolicy", "PolicyLoss", "ValueLoss", "fold_kl_into_rewards",
    "gae_advantages", "grpo_advantages", "kl_k3", "lagrangian_advantages", "leave_one_out_advantages",
    "logprobs_and_entropy_from_logits", "logprobs_from_logits", "masked_whiten", "overlong_penalties",
    "remax_advantages", "rollout_consistency_terms", "scores_to_token_rewards",
]
