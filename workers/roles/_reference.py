"""The reference role: the frozen initial policy's log-probs, for KL penalties and losses.

It runs the same training engine as the actor (forward only), so at step 0 its
log-probs equal the actor's exactly and the KL starts at zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from channels import DP, Batch
from workers.engines import CausalLMHead, TrainingConfig, resolve_precision
from workers.host import Role, WorkerContext, register
from workers.models import load_model
from workers.roles import _fields as F
from workers.roles._engine_choice import EngineName, build_engine, check_engine
from workers.roles._training import (
    check_model_dir,
    check_seed,
    check_types,
)


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """Settings of a :class:`ReferenceWorker`."""

    model_dir: str
    """The reference policy's Hugging Face directory (usually the actor's initial one)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Its micro-batching (``micro_batch_size``, ``max_tokens_per_micro_batch``) and
    ``precision`` apply: the reference is never trained (no optimizer), and in bf16 its
    weights are stored in bf16."""
    seed: int = 0
    """Seeds torch's global RNG."""
    replicate: bool = False
    """Keep a full copy of the model on every rank instead of sharding it (FSDP),
    whatever its size: ``log_prob`` then needs no other rank, so the driver may run
    it on any free ranks of the pool, e.g. ranks that long-tail migration freed
    while the actor finishes its tail (as it may when ``training.data_parallel``
    replicates the model). Costs a full model's memory per rank."""
    engine: EngineName = "native"
    """The engine that runs the model: ``"native"`` or ``"megatron"`` (as the actor's,
    so that their log-probs agree at step 0)."""

    def __post_init__(self) -> None:
        check_model_dir("ReferenceConfig", self.model_dir)
        check_seed("ReferenceConfig", self.seed)
        check_engine("ReferenceConfig", self.engine)
        check_types("ReferenceConfig", self, {"training": TrainingConfig})


class ReferenceWorker(Role):
    """The frozen reference policy: ``log_prob``.

    Args:
        ctx: where this rank runs.
        config: the reference's settings.
    """

    Config = ReferenceConfig

    def __init__(self, ctx: WorkerContext, config: ReferenceConfig) -> None:
        super().__init__(ctx)
        self.config = config
        torch.manual_seed(config.seed)
        model = load_model(config.model_dir)
        if config.engine == "native" and resolve_precision(config.training.precision, ctx.device) == "bf16":
            nn.Module.to(model, torch.bfloat16)  # on the host: the device never holds a float32 copy
        # In place; transformers' annotation of PreTrainedModel.to confuses type checkers.
        nn.Module.to(model, ctx.device)
        self.engine = build_engine(ctx, model, engine=config.engine, config=config.training, head=CausalLMHead(),
                                   replicate=config.replicate, trainable=False)

    def rank_local(self) -> frozenset[str]:
        """``log_prob`` when each rank holds the whole model (``ReferenceConfig.replicate``,
        or ``TrainingConfig.data_parallel`` replicating it): it then needs no other rank."""
        return frozenset({"log_prob"}) if self.engine.infers_alone else frozenset()

    @register(protocol=DP(), reads=F.SEQUENCE, optional=F.SEQUENCE_OPTIONAL, writes=(F.REF_LOGPROBS,))
    def log_prob(self, batch: Batch) -> dict[str, Tensor]:
        """The reference policy's log-probs of the response tokens.

        Args:
            batch: the sequence fields (a rank's share may be empty).

        Returns:
            ``ref_logprobs``: float32 ``[R]``, raw (temperature 1), 0 on padding.
        """
        logprobs, _ = self.engine.log_probs(batch, entropy=False)
        return {F.REF_LOGPROBS: logprobs}
