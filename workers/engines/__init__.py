"""PyTorch-native training engine: FSDP2/TP training, checkpoints; the objectives
it minimises live in :mod:`workers.objectives`.

- :class:`TrainingEngine` trains one role's model (causal LM or value model) with AdamW,
  token-budget or fixed-size micro-batching and a parallel layout over a
  ``("pp", "dp", "tp")`` DeviceMesh (FSDP2 over ``dp``, DTensor TP over ``tp``).
- Precision (``TrainingConfig.precision``: fp32, or bf16 compute with float32 master
  weights), activation checkpointing, and offload of the optimizer state and weights
  to host memory (:meth:`TrainingEngine.offload`); :func:`estimate_memory` sizes a
  model's state per device before anything is built.
- With a mesh whose ``pp`` is above 1 each rank keeps its pipeline stages and
  calls run as 1F1B pipelines (:mod:`workers.engines.pipeline` holds the
  schedules); :func:`fused_train_steps` runs two engines' updates (actor and
  critic) as one fused schedule.
- The objective is pluggable (a ``workers.objectives.LossFn``, passed to the engine
  or to each :meth:`TrainingEngine.train_step`).
"""

from __future__ import annotations

from workers.engines._batch import (
    OBSERVATION_MASK,
    SEQUENCE_FIELDS,
    FixedSizeMicroBatches,
    MicroBatchPlanner,
    SequenceInputs,
    TokenBudgetMicroBatches,
    WholeBatch,
    build_inputs,
)
from workers.engines._config import REPLICATE_MAX_PARAMS, TrainingConfig
from workers.engines._engine import TrainingEngine
from workers.engines._errors import EngineConfigError
from workers.engines._fused import fused_train_steps
from workers.engines._heads import CausalLMHead, ModelHead, ValueHead
from workers.engines._megatron import MegatronConfig, MegatronTrainingEngine, megatron_available
from workers.engines._memory import MemoryFootprint, estimate_memory
from workers.engines._parallel import (
    MESH_DIM_NAMES,
    Parallelism,
    TensorParallelPlan,
    apply_tensor_parallel,
)
from workers.engines._precision import PrecisionName, resolve_precision

__all__ = [
    "MESH_DIM_NAMES",
    "OBSERVATION_MASK",
    "REPLICATE_MAX_PARAMS",
    "SEQUENCE_FIELDS",
    "CausalLMHead",
    "EngineConfigError",
    "FixedSizeMicroBatches",
    "MegatronConfig",
    "MegatronTrainingEngine",
    "MemoryFootprint",
    "MicroBatchPlanner",
    "ModelHead",
    "Parallelism",
    "PrecisionName",
    "SequenceInputs",
    "TensorParallelPlan",
    "TokenBudgetMicroBatches",
    "TrainingConfig",
    "TrainingEngine",
    "ValueHead",
    "WholeBatch",
    "apply_tensor_parallel",
    "build_inputs",
    "estimate_memory",
    "fused_train_steps",
    "megatron_available",
    "resolve_precision",
]
