"""A rollout role on its own pool: generates with its own engine and takes the
actor's weights as a data future (``roles.rollout.load_weights(roles.actor.weights())``).

Colocated training (the actor generates itself) and disaggregated generation (the
actor trains on one pool, this role generates on another) are two placements of
the same algorithm: the rows ``generate`` returns are the actor's ``generate`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from channels import Batch, ConfigError, MicroDP, OneToAll
from workers import WorkerContext, register
from workers._role import Role
from workers._streaming import StreamMethod
from workers.models import load_model
from workers.roles import _fields as F
from workers.roles._generation import checked_generate
from workers.roles._rollout import RolloutConfig, build_rollout, model_eos
from workers.roles._training import check_model_dir, check_seed, check_types
from workers.roles._weights import assemble_weights
from workers.rollout import NativeRolloutConfig, SamplingParams, VLLMRolloutConfig


@dataclass(frozen=True, kw_only=True)
class RolloutWorkerConfig:
    """Settings of a :class:`RolloutWorker`."""

    model_dir: str
    """The policy's Hugging Face directory: the architecture, and the weights until
    the first :meth:`RolloutWorker.load_weights`."""
    rollout: RolloutConfig = field(default_factory=NativeRolloutConfig)
    """The engine: ``NativeRolloutConfig()`` or ``VLLMRolloutConfig()``; its seed is
    offset by the rank."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Default sampling of :meth:`RolloutWorker.generate`."""
    seed: int = 0
    """Seeds torch's global RNG."""

    def __post_init__(self) -> None:
        check_model_dir("RolloutWorkerConfig", self.model_dir)
        check_seed("RolloutWorkerConfig", self.seed)
        check_types("RolloutWorkerConfig", self, {
            "sampling": SamplingParams, "rollout": (NativeRolloutConfig, VLLMRolloutConfig)})


class RolloutWorker(Role):
    """Generation on its own pool: ``generate`` and ``load_weights``.

    Args:
        ctx: where this rank runs.
        config: the role's settings.
    """

    Config = RolloutWorkerConfig

    def __init__(self, ctx: WorkerContext, config: RolloutWorkerConfig) -> None:
        super().__init__(ctx)
        self.config = config
        torch.manual_seed(config.seed)
        model = load_model(config.model_dir)
        nn.Module.to(model, ctx.device)
        self._eos = model_eos(model)
        self._shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.rollout = build_rollout(config.rollout, model=model, model_dir=config.model_dir, rank=ctx.rank)
        self.weights_version: int | None = None
        """The version of the weights loaded last (None: the model directory's, which
        are the actor's version 0 when both start from the same directory)."""
        self._partial: tuple[int, set[str]] | None = None
        """A version loaded in part (by buckets), and its parameters loaded so far."""

    def rank_local(self) -> frozenset[str]:
        """``generate``: every rank generates with whole weights (``load_weights``
        runs on every rank: each must hold the new version)."""
        return frozenset({"generate"})

    @register(protocol=MicroDP(), reads=(F.PROMPT_IDS, F.PROMPT_MASK), carries="prompts",
              writes=(F.RESPONSE_IDS, F.RESPONSE_MASK, F.ROLLOUT_LOGPROBS), row_lengths=F.RESPONSE_MASK)
    def generate(self, prompts: Batch, *, n: int = 1, params: SamplingParams | None = None) -> StreamMethod:
        """Sample ``n`` responses per prompt: the same rows as ``ActorWorker.generate``
        (see it for the columns, budgets and streaming); ``policy_version`` is the
        version loaded last (0: the model directory's weights, the actor's start).

        Raises:
            ConfigError: ``n`` < 1, ``params`` is not a SamplingParams, or the
                weights are loaded in part (see :meth:`load_weights`).
            MissingFieldError: the prompts lack ``prompt_ids`` or ``prompt_mask``.
        """
        if self._partial is not None:
            raise ConfigError(f"rollout.generate: the weights of version {self._partial[0]} are loaded in part "
                              f"({self._loaded_in_part()}); load the rest of them first")
        return (yield from checked_generate(self.rollout, prompts, n=n, params=params, default=self.config.sampling,
                                            eos_token_id=self._eos, seed_rank=self.ctx.rank, rank=self.ctx.rank,
                                            where="rollout.generate", version=self.weights_version or 0))

    @register(protocol=OneToAll())
    def load_weights(self, weights: Batch) -> int:
        """Load the actor's weights (the rows of ``actor.weights()``, or a bucket of
        them: ``weights.select([...names, "weights_version"])``): every rank pulls
        each parameter's shards from the actor ranks that hold them, peer to peer,
        once each, assembles the whole tensors and copies them into its engine.

        A bucket loads its parameters at once; the version becomes the one
        ``generate`` samples with when every parameter of it is loaded, and
        ``generate`` refuses to run on weights loaded in part.

        Args:
            weights: the future ``actor.weights()`` returned, or a selection of it.

        Returns:
            Their version (the actor's optimizer step count); one value per rank.

        Raises:
            ConfigError: the rows are not a weights future of this model, are older
                than the loaded version, or start a new version while another is
                loaded in part.
        """
        tensors, version = assemble_weights(weights, self._shapes, partial=True)
        if self.weights_version is not None and version < self.weights_version:
            raise ConfigError(f"rollout.load_weights: version {version} is older than the loaded "
                              f"{self.weights_version}")
        if self._partial is not None and self._partial[0] != version:
            raise ConfigError(f"rollout.load_weights: version {version} arrived while version {self._partial[0]} "
                              f"is loaded in part ({self._loaded_in_part()}); load the rest of it first")
        self.rollout.update_weights(tensors.items())
        names = (self._partial[1] if self._partial is not None else set()) | set(tensors)
        if names >= self._shapes.keys():
            self.weights_version, self._partial = version, None
        else:
            self._partial = (version, names)
        return version

    def _loaded_in_part(self) -> str:
        assert self._partial is not None
        return f"{len(self._partial[1])} of {len(self._shapes)} parameters"
