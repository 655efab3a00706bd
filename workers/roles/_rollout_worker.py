"""A rollout role on its own pool: generates with its own engine and takes the
actor's weights as a data future (``roles.rollout.load_weights(roles.actor.weights())``).

Colocated training (the actor generates itself) and disaggregated generation (the
actor trains on one pool, this role generates on another) are two placements of
the same algorithm: the rows ``generate`` returns are the actor's ``generate`` rows.

Its layout is its generation layout: with ``t > 1`` (native engine) the ranks of a
replica generate tensor parallel, each holding its shards of the split parameters
(:meth:`RolloutWorker.load_weight_shards` pulls only those).

Partial rollouts (``generate(..., partial=PartialRollout(decode_steps=T))``): a call
decodes at most ``T`` steps once it has finished a group; each rank keeps its
unfinished samples and the next such call continues them (under the weights it
holds then: each token's ``policy_version`` says which generated it) or restarts
them, beside its own prompts' samples, up to ``max_carries`` calls. A long response then spreads over calls
instead of holding one up. The carried samples are this role's state:
:meth:`RolloutWorker.carried` and :meth:`RolloutWorker.restore_carried` checkpoint them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from channels import DP, Batch, ConfigError, OneToAll, TensorShards
from workers._dtensor import is_dtensor
from workers.engines import apply_tensor_parallel, resolve_precision
from workers.episodes import EpisodeConfig
from workers.host import Role, StreamMethod, WorkerContext, register
from workers.models import load_model
from workers.roles import _fields as F
from workers.roles._episodes import EpisodeSetup
from workers.roles._generation import TAIL_LENGTH, CarryOver, checked_generate
from workers.roles._rollout import RolloutConfig, build_rollout, model_eos
from workers.roles._training import check_model_dir, check_seed, check_types
from workers.roles._weights import assemble_shards, assemble_weights, local_shard
from workers.rollout import (
    NativeRolloutConfig,
    NativeRolloutEngine,
    SamplingParams,
    VLLMRolloutConfig,
)

_CARRIED_COLUMNS = "rows"


@dataclass(frozen=True)
class PartialRollout:
    """How :meth:`RolloutWorker.generate` carries long samples over to its next call."""

    decode_steps: int
    """Engine steps a call runs (once it has finished a group of its own, and every
    carried sample) before it returns what finished and keeps the rest; the
    native engine's first step samples two tokens (prefill and one decode)."""
    mode: Literal["continue", "restart"] = "continue"
    """``continue``: the next call goes on from the tokens so far, under its weights;
    ``restart``: it samples them again from the prompt (every token of a sample
    then comes from one version)."""
    max_carries: int = 1
    """How many calls a sample may be carried over to: one carried this many times
    finishes in the call it reaches, whatever its length (its first tokens are
    then at most this many calls older than the call's weights)."""

    def __post_init__(self) -> None:
        steps = self.decode_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"PartialRollout.decode_steps must be an int >= 1, got {steps!r}")
        carries = self.max_carries
        if not isinstance(carries, int) or isinstance(carries, bool) or carries < 1:
            raise ConfigError(f"PartialRollout.max_carries must be an int >= 1, got {carries!r}")
        if self.mode not in ("continue", "restart"):
            raise ConfigError(f"PartialRollout.mode must be 'continue' or 'restart', got {self.mode!r}")


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
    episodes: EpisodeConfig | None = None
    """Multi-turn generation: each sample of ``generate`` is an episode with the
    environment this names (see ``workers.episodes``); None: one response each."""
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
        layout = ctx.layout
        if layout.p != 1:
            raise ConfigError(f"rollout role: pipeline stages (layout {layout}) are not supported; use p = 1")
        if layout.t > 1 and not isinstance(config.rollout, NativeRolloutConfig):
            raise ConfigError(f"rollout role: tensor-parallel generation (layout {layout}) needs the native rollout "
                              "engine; vLLM's tensor parallelism is planned")
        self._tp, self._tp_size = ctx.coords.tp, layout.t
        replica = ctx.coords.dp  # the ranks of one replica sample the same tokens
        model = load_model(config.model_dir)
        nn.Module.to(model, ctx.device)
        self._eos = model_eos(model)
        self._episodes = EpisodeSetup.of(config.episodes, config.model_dir)
        self._shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        # "auto" follows the training precision's rule on this device (the actor's default).
        self.rollout = build_rollout(config.rollout, model=model, model_dir=config.model_dir, rank=replica,
                                     precision=resolve_precision("auto", ctx.device))
        if layout.t > 1:
            assert isinstance(self.rollout, NativeRolloutEngine)
            model = self.rollout.model  # the engine's own copy
            apply_tensor_parallel(model, ctx.mesh["tp"])
        self._split = _split_parameters(model)
        """Tensor-parallel parameters: name -> (this rank's shard shape, split dim)."""
        self._replica = replica
        self.weights_version: int | None = None
        """The version of the weights loaded last (None: the model directory's, which
        are the actor's version 0 when both start from the same directory)."""
        self._partial: tuple[int, set[str]] | None = None
        """A version loaded in part (by buckets), and its parameters loaded so far."""
        self._carry = CarryOver(after=1)
        """Partial rollouts: the samples the last ``generate`` with ``partial`` left
        unfinished (each such call sets how it goes on)."""

    def rank_local(self) -> frozenset[str]:
        """``generate`` when every rank holds whole weights (``load_weights`` runs on
        every rank: each must hold the new version); nothing when tensor parallel
        (the ranks of a replica decode together)."""
        return frozenset({"generate"}) if self._tp_size == 1 else frozenset()

    @register(protocol=DP(), reads=(F.PROMPT_IDS, F.PROMPT_MASK), carries="prompts",
              writes=(F.RESPONSE_IDS, F.RESPONSE_MASK, F.ROLLOUT_LOGPROBS), row_lengths=F.RESPONSE_MASK)
    def generate(self, prompts: Batch, *, n: int = 1, params: SamplingParams | None = None,
                 partial: PartialRollout | None = None) -> StreamMethod:
        """Sample ``n`` responses per prompt: the same rows as ``ActorWorker.generate``
        (see it for the columns, budgets and streaming); ``policy_version`` is the
        version loaded last (0: the model directory's weights, the actor's start).

        With ``partial`` (partial rollouts, see the module docstring) the rows are
        the groups that finished in this call: its own prompts' first, then the
        carried ones (continued from the last such call; their earlier tokens keep
        the version that sampled them); each rank's output is then not its
        prompts' groups, and the call is not streamed.

        Raises:
            ConfigError: ``n`` < 1, ``params`` is not a SamplingParams, ``partial``
                is not a PartialRollout, or the weights are loaded in part (see
                :meth:`load_weights`).
            MissingFieldError: the prompts lack ``prompt_ids`` or ``prompt_mask``.
        """
        if self._partial is not None:
            raise ConfigError(f"rollout.generate: the weights of version {self._partial[0]} are loaded in part "
                              f"({self._loaded_in_part()}); load the rest of them first")
        carry = None
        if partial is not None:
            if not isinstance(partial, PartialRollout):
                raise ConfigError(f"rollout.generate: partial must be a PartialRollout, got {partial!r}")
            carry = self._carry
            carry.after, carry.limit, carry.restart = partial.decode_steps, partial.max_carries, partial.mode == "restart"
        return (yield from checked_generate(self.rollout, prompts, n=n, params=params, default=self.config.sampling,
                                            eos_token_id=self._eos, seed_rank=self._replica, rank=self.ctx.rank,
                                            where="rollout.generate", version=self.weights_version or 0,
                                            migratable=self._tp_size == 1, carry=carry,
                                            episodes=self._episodes))

    @register(protocol=OneToAll())
    def carried(self) -> dict[str, Any]:
        """The samples partial rollouts carry to the next call, for a checkpoint:
        ``{"rank": r, "rows": columns or None, "tokens": their response tokens so
        far}``, ``r`` the data-parallel replica; one value per rank (the other
        tensor-parallel ranks of a replica hold copies and report none)."""
        rows = self._carry.rows if self._tp == 0 else None
        tokens = 0 if rows is None else int(rows[TAIL_LENGTH].sum())
        return {"rank": self._replica, _CARRIED_COLUMNS: None if rows is None else dict(rows), "tokens": tokens}

    @register(protocol=OneToAll())
    def restore_carried(self, carried: list[dict[str, Any]]) -> int:
        """Hold the carried samples :meth:`carried` returned (a resumed run's): this
        rank takes those of the replicas ``r`` with ``r % d`` = its replica.
        Returns how many samples it holds."""
        d = self.ctx.layout.d
        mine = [Batch(c[_CARRIED_COLUMNS]) for c in carried
                if c[_CARRIED_COLUMNS] is not None and int(c["rank"]) % d == self._replica]
        rows = Batch.concat(mine) if mine else None
        self._carry.rows = rows
        return 0 if rows is None else rows.num_rows

    @register(protocol=OneToAll())
    def load_weights(self, weights: Batch) -> int:
        """Load the actor's weights (the rows of ``actor.weights()``, or a bucket of
        them: ``weights.select([...names, "weights_version"])``): every rank pulls
        each parameter's shards from the actor ranks that hold them, peer to peer,
        once each, assembles the whole tensors and copies them into its engine (a
        tensor-parallel rank keeps its shard of the parameters it splits;
        :meth:`load_weight_shards` pulls only that shard).

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
        for name, (_, dim) in self._split.items():
            if name in tensors:
                tensors[name] = local_shard(tensors[name], dim, self._tp, self._tp_size)
        return self._load(tensors, version)

    @register(protocol=TensorShards())
    def load_weight_shards(self, weights: Batch) -> int:
        """Load this rank's tensor-parallel shards of split parameters (a selection
        of ``actor.weights()`` naming only parameters this role splits, see
        :meth:`split_parameters`): rank ``j`` of ``t`` pulls only the rows that make
        its shard (:class:`~channels.TensorShards`), so a tensor-parallel rollout
        moves each split parameter's bytes once over its ranks. Same versions and
        loading in part as :meth:`load_weights`; one value per rank.

        Raises:
            ConfigError: as :meth:`load_weights`, or a parameter is not split here.
        """
        tensors, version = assemble_shards(weights, self._split, index=self._tp, parts=self._tp_size)
        return self._load(tensors, version)

    @register(protocol=OneToAll())
    def split_parameters(self) -> list[str]:
        """The parameters this role holds tensor-parallel shards of (none when
        ``t = 1``), for :meth:`load_weight_shards`; one value per rank."""
        return sorted(self._split)

    def _load(self, tensors: dict[str, torch.Tensor], version: int) -> int:
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


def _split_parameters(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    """``model``'s tensor-parallel parameters: name -> (this rank's shard shape, split dim)."""
    if not any(is_dtensor(p) for p in model.parameters()):
        return {}
    from torch.distributed.tensor import Shard  # imported already: the model has DTensors

    return {name: (tuple(p._local_tensor.shape), p.placements[0].dim) for name, p in model.named_parameters()
            if is_dtensor(p) and isinstance(p.placements[0], Shard)}
