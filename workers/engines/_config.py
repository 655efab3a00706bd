"""Settings of a training engine: optimizer, schedule, micro-batching, loss reduction,
precision and memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workers.engines._batch import (
    FixedSizeMicroBatches,
    MicroBatchPlanner,
    TokenBudgetMicroBatches,
    WholeBatch,
)
from workers.engines._errors import EngineConfigError, enum_field
from workers.engines._precision import PRECISION_SETTINGS
from workers.objectives import LossAggregation


def _positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineConfigError(f"TrainingConfig.{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise EngineConfigError(f"TrainingConfig.{name} must be {bound}, got {value}")


REPLICATE_MAX_PARAMS = 50_000_000
"""``data_parallel="auto"`` replicates models up to this many parameters (about
800 MB per rank with gradients and AdamW state in float32) and shards larger ones."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Optimizer, schedule, micro-batching and loss reduction of a training engine."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (not to norms and biases)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float | None = 1.0
    """Clip the total gradient norm to this; None or 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up: step s uses ``lr * min(1, (s + 1) / warmup_steps)``."""
    micro_batch_size: int | None = None
    """Rows per micro-batch (gradient accumulation), rows of similar length together;
    exclusive with max_tokens_per_micro_batch."""
    max_tokens_per_micro_batch: int | None = None
    """Micro-batches of at most this many tokens each as they run: rows times the
    widest prompt plus the longest response, padding included (what a micro-batch's
    forward computes and holds); rows of similar length together."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How per-token loss terms are averaged over the global batch, for objectives
    whose ``loss_agg`` is None (an objective's own setting wins)."""
    skip_non_finite: bool = True
    """Skip the optimizer step (and report it as ``step_skipped``) when the loss or the
    gradient norm, both global over the data-parallel ranks, is inf or nan."""
    data_parallel: Literal["auto", "shard", "replicate"] = "auto"
    """How the model lies over the data-parallel ranks. ``"shard"``: FSDP2 shards
    parameters, gradients and optimizer state, gathering each block's parameters
    when it runs (memory per rank shrinks with the ranks; several collectives per
    block and step). ``"replicate"``: every rank keeps the whole model and its
    optimizer state, and the gradients are all-reduced once per step in one flat
    buffer (the fast choice while they fit). ``"auto"``: replicate models of at
    most :data:`REPLICATE_MAX_PARAMS` parameters, shard larger ones (the whole
    model's count, with pipeline stages too: each stage is then sharded alone)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Numeric precision. ``"bf16"``: bfloat16 matrix products with float32 master
    weights, float32 optimizer state and float32 gradient reduction (FSDP2's mixed
    precision on a sharded model, ``torch.autocast`` on an unsharded one); an
    inference-only engine (``trainable=False``) stores its weights in bf16 instead.
    ``"fp32"``: float32 throughout. ``"auto"``: bf16 on a CUDA device with bfloat16,
    fp32 elsewhere (the engine exposes the resolved one as ``engine.precision``).
    Log-probs, entropy, values and losses are float32 in every case."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's forward in backward instead of keeping its
    activations (non-reentrant ``torch.utils.checkpoint``): much less activation
    memory for about one more forward per step. Needs a transformers model (or one
    holding a transformers backbone)."""
    pipeline_chunks: int = 1
    """With pipeline stages (the mesh's ``pp`` above 1): model pieces per stage. 1
    runs 1F1B; above 1 runs interleaved 1F1B (Megatron's virtual pipeline: each
    stage holds that many non-adjacent pieces, which shortens the pipeline's fill
    and drain at the cost of more messages). The model needs at least
    ``pp * pipeline_chunks`` decoder layers."""
    pipeline_reversed: bool = False
    """With pipeline stages: the first stage on the pipeline's last rank. The second
    model of a fused training stage (:func:`workers.engines.fused_train_steps`)
    runs its pipeline the other way than the first, so that each fills the other's
    bubbles."""

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("eps", self.eps)
        _positive("grad_clip", self.grad_clip, allow_zero=True)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        _positive("pipeline_chunks", self.pipeline_chunks)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise EngineConfigError(
                f"TrainingConfig.betas must be two numbers in [0, 1), got {self.betas}"
            )
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise EngineConfigError(
                "TrainingConfig: set micro_batch_size or max_tokens_per_micro_batch, not both"
            )
        if self.data_parallel not in ("auto", "shard", "replicate"):
            raise EngineConfigError(
                f"TrainingConfig.data_parallel must be 'auto', 'shard' or 'replicate', got {self.data_parallel!r}"
            )
        if self.precision not in PRECISION_SETTINGS:
            raise EngineConfigError(
                f"TrainingConfig.precision must be one of {PRECISION_SETTINGS}, got {self.precision!r}"
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise EngineConfigError(
                "TrainingConfig.activation_checkpointing must be True or False, got "
                f"{self.activation_checkpointing!r}"
            )
        aggregation = enum_field(
            "TrainingConfig.loss_aggregation", LossAggregation, self.loss_aggregation
        )
        object.__setattr__(self, "loss_aggregation", aggregation)

    def replicates(self, parameters: int) -> bool:
        """Whether a model of ``parameters`` parameters is replicated over the
        data-parallel ranks (see :attr:`data_parallel`)."""
        if self.data_parallel == "auto":
            return parameters <= REPLICATE_MAX_PARAMS
        return self.data_parallel == "replicate"

    def micro_batch_planner(self) -> MicroBatchPlanner:
        """The micro-batching strategy these settings select.

        Returns:
            Token-budget, fixed-size, or whole-batch planning.
        """
        if self.max_tokens_per_micro_batch is not None:
            return TokenBudgetMicroBatches(max_tokens=self.max_tokens_per_micro_batch)
        if self.micro_batch_size is not None:
            return FixedSizeMicroBatches(size=self.micro_batch_size)
        return WholeBatch()

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based) under linear warm-up.

        Args:
            step: the step index.

        Returns:
            The learning rate.
        """
        if self.warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)
