"""PyTorch-native training engine: losses, advantage estimators, FSDP2/TP training, checkpoints.

- :class:`TrainingEngine` trains one role's model (causal LM or value model) with AdamW,
  token-balanced or fixed-size micro-batching and a parallel layout over a
  ``("pp", "dp", "tp")`` DeviceMesh (FSDP2 over ``dp``, DTensor TP over ``tp``).
- Precision (``TrainingConfig.precision``: fp32, or bf16 compute with float32 master
  weights), activation checkpointing, and offload of the optimizer state and weights
  to host memory (:meth:`TrainingEngine.offload`); :func:`estimate_memory` sizes a
  model's state per device before anything is built.
- Objectives (:class:`PolicyLoss`, :class:`ValueLoss`, :class:`NLLLoss`; :class:`OnPolicy` wraps one) are pluggable;
  the pure functions beneath them (PPO/GRPO losses, KL estimators, masked ops) and the
  advantage estimators (GAE, GRPO, ReMax) are usable on their own.
"""

from __future__ import annotations

from workers.engines._advantages import (
    fold_kl_into_rewards,
    gae_advantages,
    group_sums,
    grpo_advantages,
    remax_advantages,
    scores_to_token_rewards,
)
from workers.engines._batch import (
    SEQUENCE_FIELDS,
    FixedSizeMicroBatches,
    MicroBatchPlanner,
    SequenceInputs,
    TokenBalancedMicroBatches,
    WholeBatch,
    build_inputs,
)
from workers.engines._config import REPLICATE_MAX_PARAMS, TrainingConfig
from workers.engines._engine import TrainingEngine
from workers.engines._errors import EngineConfigError
from workers.engines._heads import CausalLMHead, ModelHead, ValueHead
from workers.engines._losses import (
    KLEstimator,
    LossAggregation,
    entropy_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from workers.engines._megatron import MegatronConfig, MegatronTrainingEngine, megatron_available
from workers.engines._memory import MemoryFootprint, estimate_memory
from workers.engines._objectives import (
    BEHAVIOUR_LOGPROBS,
    ROW_INDEX,
    STALE_TOKENS,
    LossFn,
    LossTerms,
    ModelOutputs,
    NLLLoss,
    OnPolicy,
    PolicyLoss,
    ValueLoss,
)
from workers.engines._parallel import (
    MESH_DIM_NAMES,
    Parallelism,
    TensorParallelPlan,
    apply_tensor_parallel,
    clip_grad_norm,
)
from workers.engines._policy_losses import (
    OffPolicyCorrection,
    PolicyLossTerms,
    StalenessTerms,
    ValueLossTerms,
    clipped_value_loss,
    grpo_loss,
    ppo_policy_loss,
    staleness_correction,
)
from workers.engines._precision import PrecisionName, resolve_precision

__all__ = [
    "BEHAVIOUR_LOGPROBS",
    "MESH_DIM_NAMES",
    "REPLICATE_MAX_PARAMS",
    "ROW_INDEX",
    "SEQUENCE_FIELDS",
    "STALE_TOKENS",
    "CausalLMHead",
    "EngineConfigError",
    "FixedSizeMicroBatches",
    "KLEstimator",
    "LossAggregation",
    "LossFn",
    "LossTerms",
    "MegatronConfig",
    "MegatronTrainingEngine",
    "MemoryFootprint",
    "MicroBatchPlanner",
    "ModelHead",
    "ModelOutputs",
    "NLLLoss",
    "OffPolicyCorrection",
    "OnPolicy",
    "Parallelism",
    "PolicyLoss",
    "PolicyLossTerms",
    "PrecisionName",
    "SequenceInputs",
    "StalenessTerms",
    "TensorParallelPlan",
    "TokenBalancedMicroBatches",
    "TrainingConfig",
    "TrainingEngine",
    "ValueHead",
    "ValueLoss",
    "ValueLossTerms",
    "WholeBatch",
    "apply_tensor_parallel",
    "build_inputs",
    "clip_grad_norm",
    "clipped_value_loss",
    "entropy_from_logits",
    "estimate_memory",
    "fold_kl_into_rewards",
    "gae_advantages",
    "group_sums",
    "grpo_advantages",
    "grpo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "megatron_available",
    "ppo_policy_loss",
    "remax_advantages",
    "resolve_precision",
    "scores_to_token_rewards",
    "staleness_correction",
]
