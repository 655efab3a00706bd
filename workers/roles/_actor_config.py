"""The settings of the actor role (:class:`~workers.roles.ActorWorker`): its policy,
training engine, default objective and update schedule, rollout engine and default
sampling, multi-turn episodes, and offloading during generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from channels import ConfigError
from workers.engines import TrainingConfig
from workers.episodes import EpisodeConfig
from workers.objectives import PolicyLoss
from workers.roles._engine_choice import EngineName, check_engine
from workers.roles._rollout import RolloutConfig
from workers.roles._training import UpdateConfig, check_model_dir, check_seed, check_types
from workers.rollout import NativeRolloutConfig, SamplingParams, VLLMRolloutConfig

__all__ = ["ActorConfig"]


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """Settings of an :class:`ActorWorker`."""

    model_dir: str
    """The policy's Hugging Face directory (a causal LM of a supported architecture)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimizer, schedule and micro-batching of the training engine."""
    loss: PolicyLoss = field(default_factory=PolicyLoss)
    """The default objective of :meth:`ActorWorker.update` (a call may pass another)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Epochs and mini-batches of one update call."""
    rollout: RolloutConfig | None = field(default_factory=NativeRolloutConfig)
    """The rollout engine: ``NativeRolloutConfig()`` or ``VLLMRolloutConfig()``; its seed
    is offset by the rank. None: the actor does not generate (a rollout role on
    another pool does, from :meth:`ActorWorker.weights`)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Default sampling of :meth:`ActorWorker.generate`; an unset ``eos_token_id`` is
    taken from the model's config."""
    episodes: EpisodeConfig | None = None
    """Multi-turn generation: each sample of ``generate`` is an episode with the
    environment this names (see ``workers.episodes``); None: one response each."""
    seed: int = 0
    """Seeds torch's global RNG and the mini-batch shuffling."""
    reshard_bucket_mb: float = 64.0
    """With a generation layout: the most megabytes one resharding gather moves (the
    transition's staging memory beyond the generation shards)."""
    offload_optimizer: bool = False
    """Move the optimizer state to host memory (pinned on a GPU) while :meth:`ActorWorker.generate`
    runs, so that generation (its KV cache) has that device memory; it is back
    when generation ends. For an actor that generates on the device it trains on."""
    offload_params: bool = False
    """With generation, also move the training parameters and gradients to host
    memory (the rollout engine samples from its own copy). Not with a generation
    layout, whose rollout engine samples from the training parameters."""
    engine: EngineName = "native"
    """The training engine: ``"native"`` (FSDP2/DTensor) or ``"megatron"`` (Megatron-core
    over the same layout; CUDA and megatron-core >= 0.16, no pipeline stages, no
    generation layout)."""

    def __post_init__(self) -> None:
        check_model_dir("ActorConfig", self.model_dir)
        check_seed("ActorConfig", self.seed)
        check_engine("ActorConfig", self.engine)
        if not isinstance(self.reshard_bucket_mb, int | float) or not self.reshard_bucket_mb > 0:
            raise ConfigError(f"ActorConfig.reshard_bucket_mb must be > 0, got {self.reshard_bucket_mb!r}")
        for name in ("offload_optimizer", "offload_params"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ActorConfig.{name} must be True or False, got {getattr(self, name)!r}")
        check_types("ActorConfig", self, {
            "training": TrainingConfig, "loss": PolicyLoss, "update": UpdateConfig,
            "sampling": SamplingParams, "rollout": (NativeRolloutConfig, VLLMRolloutConfig, type(None)),
        })
