"""The actor role: generates rollouts, scores its own log-probs, and trains the policy.

Each rank holds a training engine (FSDP2/TP over the role's DeviceMesh on pools of
more than one rank) and a rollout engine. Two ways to give the rollout engine the
weights:

- without a generation layout (the default), the native rollout engine samples
  from the training parameters themselves where each rank holds them whole in the
  rollout's dtype and device (float32 on the CPU by default; rebound after every
  optimizer update and checkpoint load, no copy); otherwise it keeps a full copy of
  the weights, and after every optimizer update, and after a checkpoint load, the
  training weights are gathered and loaded into it;
- with one (the placement's ``Layout.gen``, native engine), the hybrid engine
  reshards the training shards into generation shards at the start of every
  ``generate`` (tensor parallel over the generation TP group when ``tg > 1``) and
  frees them at its end (:class:`~workers.roles._hybrid.HybridWeights`).

With ``ActorConfig.rollout=None`` the actor does not generate (a
:class:`~workers.roles.RolloutWorker` on another pool does, from ``weights()``):
it holds no second copy of the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from channels import DP, AllToAll, Batch, ConfigError, Metrics, MicroDP
from workers.engines import (
    CausalLMHead,
    PrecisionName,
    TrainingEngine,
    resolve_precision,
)
from workers.episodes import EPISODE_METRIC_FIELDS, episode_metrics
from workers.host import CallInfo, StreamMethod, WorkerContext, register
from workers.models import load_model, save_pretrained_here
from workers.objectives import LossFn, NLLLoss, OnPolicy, PolicyLoss, rollout_consistency_terms
from workers.roles import _fields as F
from workers.roles._actor_config import ActorConfig
from workers.roles._checkpoint import TrainedRole
from workers.roles._critic import CriticWorker
from workers.roles._engine_choice import build_engine
from workers.roles._episodes import EpisodeSetup
from workers.roles._generation import checked_generate
from workers.roles._hybrid import HybridWeights
from workers.roles._rollout import bind_training_weights, build_rollout, model_eos
from workers.roles._staleness import VERSION_METRICS_REDUCE, staleness_columns, version_metrics
from workers.roles._training import (
    UpdateConfig,
    UpdateRun,
    dp_token_stats,
    require_fields,
    run_together,
    run_updates,
    shuffle_generator,
    update_run,
)
from workers.roles._weights import weight_rows
from workers.rollout import (
    NativeRolloutConfig,
    NativeRolloutEngine,
    SamplingParams,
)

UPDATE_METRICS = Metrics(over=DP(), tokens="actor/response_tokens", reduce={
    "actor/response_tokens": "sum", "actor/logprob_mismatch": "token_mean", "actor/kl_to_ref": "token_mean",
    "actor/logprob_mismatch_max": "max", "actor/steps": "max", "actor/steps_skipped": "max",
    **VERSION_METRICS_REDUCE,
})
"""How :meth:`ActorWorker.update`'s metrics combine over its data-parallel ranks. The
update already reduces them over the ranks (equal on every rank) except
``response_tokens``, this rank's count, which is summed; each key still says what it
is, so that a rank-local value would combine right: token means weighted by the
ranks' response tokens, other means by their rows (a rank without rows does not
count), step counts by their max."""


class ActorWorker(TrainedRole):
    """The policy: ``generate``, ``log_prob``, ``update``, checkpoints.

    Args:
        ctx: where this rank runs.
        config: the actor's settings.
    """

    Config = ActorConfig

    def __init__(self, ctx: WorkerContext, config: ActorConfig) -> None:
        super().__init__(ctx)
        self.config = config
        torch.manual_seed(config.seed)
        model = load_model(config.model_dir)
        # In place; transformers' annotation of PreTrainedModel.to confuses type checkers.
        nn.Module.to(model, ctx.device)
        self._eos = model_eos(model)
        self._episodes = EpisodeSetup.of(config.episodes, config.model_dir)
        gen = ctx.layout.gen
        # The ranks of one generation replica sample alike (tensor parallel ones must).
        self._seed_rank = ctx.layout.gen_coords(ctx.rank).replica if gen is not None else ctx.rank
        if gen is not None and not isinstance(config.rollout, NativeRolloutConfig):
            raise ConfigError(f"actor: a generation layout ({ctx.layout}) needs the native rollout engine; "
                              "vLLM with the hybrid engine is planned")
        if gen is not None and config.rollout is None:
            raise ConfigError(f"actor: a generation layout ({ctx.layout}) needs a rollout engine "
                              "(ActorConfig.rollout is None)")
        if gen is not None and config.offload_params:
            raise ConfigError(f"actor: offload_params with a generation layout ({ctx.layout}): its rollout engine "
                              "samples from the training parameters; offload the optimizer state only")
        # The rollout engine takes its copy (its model) before the training engine shards the model.
        self.rollout = None if config.rollout is None else build_rollout(
            config.rollout, model=model, model_dir=config.model_dir, rank=self._seed_rank,
            precision=_rollout_precision(config, ctx))
        self.engine = build_engine(ctx, model, engine=config.engine, config=config.training,
                                   head=CausalLMHead(), loss=config.loss)
        self._shuffle = shuffle_generator(config.seed, ctx)
        self._hybrid: HybridWeights | None = None
        if gen is not None:
            assert isinstance(self.rollout, NativeRolloutEngine)
            self._hybrid = HybridWeights(ctx, self.engine.model, self.rollout,
                                         bucket_bytes=int(config.reshard_bucket_mb * (1 << 20)))
        # Offloaded parameters move between devices: the rollout engine keeps its copy then.
        self._shares_weights = (gen is None and not config.offload_params and self.engine.infers_alone
                                and bind_training_weights(self.rollout, self.engine.named_full_weights()))

    @register(protocol=MicroDP(), reads=(F.PROMPT_IDS, F.PROMPT_MASK), carries="prompts",
              writes=(F.RESPONSE_IDS, F.RESPONSE_MASK, F.ROLLOUT_LOGPROBS), row_lengths=F.RESPONSE_MASK)
    def generate(self, prompts: Batch, *, n: int = 1, params: SamplingParams | None = None) -> StreamMethod:
        """Sample ``n`` responses per prompt with the rollout engine.

        Every rank generates its own share of the prompts with full weights (the
        hybrid engine's micro-DP layout with ``tg=1``). Every prompt column (ids,
        ``uid``, answers, any user column) is carried along into the output rows.

        An optional prompt column ``max_new_tokens`` (int64, one value per prompt
        row) gives that prompt's own token budget, in ``1..params.max_new_tokens``:
        each of its ``n`` samples stops there at the latest (exactly there with
        ``SamplingParams(ignore_eos=True)``), a migrated sample included. Responses
        keep the width ``params.max_new_tokens``.

        It streams: called with ``stream=True`` (or ``StreamOptions``), each
        prompt's group of ``n`` rows is reported as soon as its last sample
        finishes, and unfinished samples can migrate to another rank (long-tail
        migration); called without, it returns all rows at once. The rows are the
        same either way.

        With ``config.episodes``, each sample is an episode with the environment
        it names: the rows are laid out as :func:`workers.episodes.episode_rows`
        says (response width ``episodes.max_tokens``; a turn samples at most
        ``params.max_new_tokens``), and groups stream without migration.

        Args:
            prompts: ``prompt_ids``/``prompt_mask``, optionally ``max_new_tokens``,
                plus any columns to carry along (``uid``, ``answer_ids``, ...).
            n: samples per prompt; a prompt's samples are consecutive rows.
            params: sampling settings; None uses ``config.sampling``.

        Returns:
            ``rows * n`` rows: every prompt column repeated, plus ``response_ids``,
            ``response_mask`` (int64 ``[R]``, R = ``max_new_tokens``),
            ``rollout_logprobs`` (float32 ``[R]``, raw log-probs) and
            ``policy_version`` (int64 ``[R]``: the optimizer step count).

        Raises:
            ConfigError: ``n`` < 1, ``params`` is not a SamplingParams, a
                ``max_new_tokens`` value is not an int in ``1..params.max_new_tokens``
                (naming the row), or the actor has no rollout engine.
            MissingFieldError: the prompts lack ``prompt_ids`` or ``prompt_mask``.
        """
        if self.rollout is None:
            raise ConfigError("actor.generate: this actor has no rollout engine (ActorConfig.rollout=None); "
                              "generate with the rollout role (rollout.load_weights(actor.weights()) first)")
        # A prompt's n samples are one group: data-parallel splits keep them together.
        run = functools.partial(checked_generate, self.rollout, prompts, n=n, params=params,
                                default=self.config.sampling, eos_token_id=self._eos, seed_rank=self._seed_rank,
                                rank=self.ctx.rank, where="actor.generate", version=self.engine.step,
                                episodes=self._episodes)
        offload = self.config.offload_optimizer or self.config.offload_params
        if offload:  # generation's device memory: the training state waits in host memory
            self.engine.offload(params=self.config.offload_params)
        try:
            if self._hybrid is None:
                return (yield from run())
            self._hybrid.to_generation()
            try:
                # Tensor-parallel ranks step together: their samples cannot migrate alone.
                return (yield from run(migratable=self.ctx.layout.generation.tg == 1))
            finally:
                self._hybrid.to_training()
        finally:
            if offload:
                self.engine.reload()

    @register(protocol=AllToAll())
    def weights(self) -> dict[str, Tensor]:
        """The policy's current weights as a data future, for a rollout role on
        another pool (``roles.rollout.load_weights(roles.actor.weights())``).

        The ranks of the first data-parallel replica publish one row each: every
        parameter (by its Hugging Face name) as this rank's tensor-parallel shard,
        a parameter held whole cut into ``t`` parts, and ``weights_version`` (the
        optimizer step count); together the rows hold each byte of the model once.

        Raises:
            ConfigError: a whole parameter's first dimension is not divisible by ``t``.
        """
        return weight_rows(self.engine.model, self.ctx, version=self.engine.step)

    @register(protocol=DP(), reads=F.SEQUENCE, optional=F.SEQUENCE_OPTIONAL, writes=(F.OLD_LOGPROBS, F.ENTROPY))
    def log_prob(self, batch: Batch) -> dict[str, Tensor]:
        """The current policy's log-probs and entropy of the response tokens.

        Args:
            batch: the sequence fields (a rank's share may be empty).

        Returns:
            ``old_logprobs`` and ``entropy``, float32 ``[R]``, 0 on padding; raw
            (temperature 1), comparable with ``rollout_logprobs``.

        Raises:
            ConfigError: a row is longer than the model's ``max_position_embeddings``.
        """
        logprobs, entropy = self.engine.log_probs(batch)
        return {F.OLD_LOGPROBS: logprobs, F.ENTROPY: entropy}

    @register(protocol=UPDATE_METRICS, reads=lambda call: _update_reads(call),
              optional=(F.ROLLOUT_LOGPROBS, F.REF_LOGPROBS, F.OLD_LOGPROBS, F.POLICY_VERSION, *EPISODE_METRIC_FIELDS))
    def update(self, batch: Batch, *, loss: PolicyLoss | None = None,
               schedule: UpdateConfig | None = None, ptx: Batch | None = None,
               ptx_coef: float = 0.0, with_critic: bool = False) -> dict[str, float]:
        """Train the policy on ``batch``, then load the new weights into the rollout engine.

        Reads the sequence fields, ``advantages``, ``old_logprobs`` and, when the loss
        has a KL term, ``ref_logprobs``; other columns are not used. Without
        ``old_logprobs`` the rows are taken as sampled by the current policy (on-policy
        training, no ``log_prob`` call in between): one optimizer step then takes them
        from its own forward pass, detached, which gives the same loss and update as
        passing ``log_prob``'s (see :class:`~workers.objectives.OnPolicy`); a schedule of
        several steps computes them first with a no-grad pass.

        Rows with ``policy_version`` and ``rollout_logprobs`` (asynchronous training)
        may have been sampled by an older policy: tokens whose version is below this
        actor's step are stale, and the loss corrects them as its ``off_policy``
        says (``old_logprobs`` is then the proximal policy: this actor's at the
        update's start). Fresh tokens are trained exactly as on-policy ones.

        Args:
            batch: this rank's rows.
            loss: the objective; None uses ``config.loss``.
            schedule: epochs and mini-batches; None uses ``config.update``.
            ptx: optional supervised rows (prompt + response sequence fields) for a
                pretraining loss step after the policy step (Safe-RLHF's ptx).
            ptx_coef: weight of that loss (0 skips it).
            with_critic: also run the update of the critic this process hosts (role
                ``"critic"``, its pipeline stages on the same ranks, reversed), each
                pair of optimizer steps as one fused pipeline schedule (RLHFuse's
                intra-stage fusion); the batch then also carries ``values`` and
                ``returns``, and the critic's metrics come back with the actor's. Do
                not also call the critic's ``update`` on these rows.

        Returns:
            Metrics named ``actor/<name>``, equal for every layout of the same rows
            (see :data:`UPDATE_METRICS`): the engine's (``loss``, ``grad_norm``, ``lr``,
            ``clip_fraction``, ``approx_kl``, ...: token means over every rank's rows,
            aggregated as the loss's ``loss_agg`` says) averaged over the steps,
            ``steps``, ``steps_skipped`` (non-finite loss or gradient), ``response_tokens``
            (summed over ranks) and, as token means over every rank's rows,
            ``logprob_mismatch`` / ``logprob_mismatch_max``: how far the rollout
            engine's log-probs of the sampled tokens are from the training engine's
            (mean and max absolute difference; a silent failure when large) and
            ``kl_to_ref`` when the batch has ``ref_logprobs``; for episodes' rows,
            ``episode/*`` (:func:`~workers.episodes.episode_metrics`).

        Raises:
            MissingFieldError: the batch lacks a field the loss reads.
            ConfigError: the batch (all ranks' rows) has fewer rows than
                ``schedule.mini_batches``; ``with_critic`` without a critic in this
                process, or with a schedule of another step count than the critic's.
        """
        loss = loss if loss is not None else self.config.loss
        schedule = schedule or self.config.update
        critic = self._critic_run(batch) if with_critic else None

        def train(rows: Mapping[str, Tensor], objective: LossFn, fields: Sequence[str]) -> dict[str, float]:
            run = update_run(self.engine, rows, loss=objective, fields=fields, schedule=schedule,
                             generator=self._shuffle, prefix="actor/")
            results = run_together([run] if critic is None else [run, critic])
            return results[0] if critic is None else results[0] | results[1]

        rows, stale_fields = staleness_columns(batch, self.engine.step)
        lags = version_metrics(rows, self.engine.step)
        if F.OLD_LOGPROBS in rows or F.OLD_LOGPROBS not in loss.required_fields:
            fields = (*F.SEQUENCE, *loss.required_fields, *stale_fields)
            require_fields(rows, fields, where="actor.update")
            metrics = rollout_consistency(rows, self.engine) | train(rows, loss, fields)
        else:
            metrics = self._update_on_policy(rows, loss, schedule, stale_fields, train)
        if ptx is not None and ptx_coef > 0:
            nll = NLLLoss(coef=ptx_coef)
            ptx_metrics = run_updates(self.engine, ptx, loss=nll, fields=(*F.SEQUENCE, *nll.required_fields),
                                      schedule=UpdateConfig(), generator=self._shuffle, prefix="actor/ptx_")
            metrics |= ptx_metrics
        self._sync_rollout()
        return metrics | lags | episode_metrics(batch)

    def _update_on_policy(self, batch: Mapping[str, Tensor], loss: PolicyLoss, schedule: UpdateConfig,
                          stale_fields: tuple[str, ...], train: _Train) -> dict[str, float]:
        """``update`` of rows without ``old_logprobs``: they take the current policy's
        (the proximal policy; the sampling one unless rows are stale). One optimizer
        step takes them from its own forward (:class:`~workers.objectives.OnPolicy`);
        more steps compute them first, here, with a no-grad pass (what ``log_prob``
        would return, without its call)."""
        fields = (*F.SEQUENCE, *(f for f in loss.required_fields if f != F.OLD_LOGPROBS), *stale_fields)
        require_fields(batch, fields, where="actor.update")
        if schedule.epochs * schedule.mini_batches > 1:
            old, _ = self.engine.log_probs(batch, entropy=False)
            with_old = {**batch, F.OLD_LOGPROBS: old}
            return rollout_consistency(with_old, self.engine) | train(with_old, loss, (*fields, F.OLD_LOGPROBS))
        # The step's objective reports rollout_consistency's metrics, in the step's
        # own reduction: it needs the log-probs the two compare with.
        compared = tuple(f for f in (F.ROLLOUT_LOGPROBS, F.REF_LOGPROBS) if f in batch)
        metrics = train(batch, OnPolicy(loss), (*fields, *compared))
        return {"actor/response_tokens": float(batch[F.RESPONSE_MASK].bool().sum())} | metrics

    def _critic_run(self, batch: Mapping[str, Tensor]) -> UpdateRun:
        """The co-located critic's update of ``batch``, not yet run."""
        critic = self.ctx.roles.get("critic")
        if not isinstance(critic, CriticWorker):
            raise ConfigError("actor.update(with_critic=True) needs the critic on the actor's pool (role "
                              f"'critic' in this process; it hosts {sorted(self.ctx.roles)}); place them together "
                              "or update the critic with its own call")
        return critic.update_run(batch)

    def _after_load(self) -> None:
        self._sync_rollout()

    def _save_export(self, state: dict[str, Tensor], out: Path) -> None:
        save_pretrained_here(self.engine.model, out, state_dict=state)  # type: ignore[arg-type]

    def _sync_rollout(self) -> None:
        if self._hybrid is not None or self.rollout is None:
            return  # the next generate reshards the new weights, or there is no engine
        if self._shares_weights and bind_training_weights(self.rollout, self.engine.named_full_weights()):
            return
        # Collective: every rank gathers every tensor, in the same order.
        self.rollout.update_weights(self.engine.named_full_weights())


def _rollout_precision(config: ActorConfig, ctx: WorkerContext) -> PrecisionName:
    """What the rollout engine's ``dtype="auto"`` follows: the policy's training
    precision on this device; with a generation layout, the training weights' own
    float32 (the hybrid engine binds their memory, it does not copy it).

    Raises:
        ConfigError: an explicit bfloat16 rollout with a generation layout.
    """
    if ctx.layout.gen is None:
        return resolve_precision(config.training.precision, ctx.device)
    if config.rollout is not None and config.rollout.dtype == "bfloat16":
        raise ConfigError(f"actor: a bfloat16 rollout engine with a generation layout ({ctx.layout}): the hybrid "
                          "engine binds the float32 training weights without a copy; use dtype 'auto' (float32 "
                          "there) or no generation layout (bf16 generation in a generation layout is planned)")
    return "fp32"


def _update_reads(call: CallInfo) -> dict[str, tuple[str, ...]]:
    """What ``update`` reads: the sequence, and what its loss needs (the call's
    ``loss``, else the role's default), with the critic's ``values`` and ``returns``
    when it runs the critic's update too; ``ptx`` rows are a plain sequence."""
    loss = call.arguments.get("loss") or getattr(call.config, "loss", None) or PolicyLoss()
    needed = (f for f in loss.required_fields if f != F.OLD_LOGPROBS)  # computed when absent
    critic = (F.VALUES, F.RETURNS) if call.arguments.get("with_critic") else ()
    return {"batch": (*F.SEQUENCE, *needed, *critic), "ptx": F.SEQUENCE}


_Train = Callable[[Mapping[str, Tensor], LossFn, Sequence[str]], dict[str, float]]
"""One update's steps on some rows (alone, or fused with the critic's)."""


def rollout_consistency(batch: Mapping[str, Tensor], engine: TrainingEngine) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the
    training engine's (``old_logprobs``), how many response tokens this rank has and,
    when the batch carries ``ref_logprobs``, the policy's KL to the reference.

    Collective over the engine's data-parallel group: the mismatch and the KL are token
    means (and a max) over every rank's rows, equal on every rank, so they do not depend
    on how rows are spread; ``actor/response_tokens`` is this rank's count (the
    ``Metrics`` protocol sums it).
    """
    mask = batch[F.RESPONSE_MASK].bool()
    terms = rollout_consistency_terms(batch[F.OLD_LOGPROBS], batch) if F.OLD_LOGPROBS in batch else {}
    stats = dp_token_stats(engine, terms, mask)
    out = {"actor/response_tokens": float(mask.sum())} | {f"actor/{name}": s.mean for name, s in stats.items()}
    if "logprob_mismatch" in stats:
        out["actor/logprob_mismatch_max"] = stats["logprob_mismatch"].max
    return out
