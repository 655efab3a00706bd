"""What every algorithm loop shares: sampling and policy-update settings."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from asyncflow import DataFuture, DataStream, RoleGroup, StreamOptions, collect, merge
from asyncflow.algos._feed import Feed
from channels import ConfigError
from workers.objectives import LossAggregation, OffPolicyCorrection, PolicyLoss
from workers.roles import REF_LOGPROBS, SCORES, ActorWorker, ReferenceWorker, RewardWorker
from workers.rollout import SamplingParams

_CFG = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class PolicyConfig(msgspec.Struct, **_CFG):
    """The actor's objective, passed to ``actor.update`` each step."""

    clip_ratio: float = 0.2
    """PPO clip range of the probability ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None: same as ``clip_ratio``."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) bounding negative-advantage losses; None disables."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (0 disables it and the reference)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg: LossAggregation = LossAggregation.TOKEN_MEAN
    """How the per-token losses become one number over the global batch (every
    data-parallel rank's rows and every micro-batch, so the step does not depend on
    the layout): ``"token-mean"`` (every token weighs the same), ``"seq-mean-token-mean"``
    (each response's token mean, averaged over responses; the GRPO paper's form) or
    ``"seq-mean-token-sum"``. Overrides the actor's ``TrainingConfig.loss_aggregation``,
    whose default was, and is, token-mean."""
    off_policy: OffPolicyCorrection = OffPolicyCorrection.BEHAVIOUR
    """Asynchronous training (``train.max_staleness`` > 0): how tokens an older policy
    sampled are corrected. ``"behaviour"`` (default): the clipped ratio against the
    rollout's log-probs, so the clip also stops pushing a stale token the updates
    since its sampling already moved past the clip range; ``"decoupled"``: the
    ratio against the proximal policy (the actor's at the update's start), each
    stale token's policy-gradient term weighted by ``min(pi_prox / pi_behav, is_cap)``
    (decoupled PPO, AReaL). Fresh tokens are trained exactly as synchronous
    training trains them. How the two compare on the main job is on the docs'
    benchmarks page."""
    is_cap: float = 2.0
    """The largest importance weight of a stale token (``"decoupled"``)."""

    def __post_init__(self) -> None:
        allowed = [m.value for m in LossAggregation]
        if self.loss_agg not in allowed:
            raise ConfigError(f"policy.loss_agg must be one of {', '.join(map(repr, allowed))}, "
                              f"got {self.loss_agg!r}")
        if not self.is_cap >= 1.0:
            raise ConfigError(f"policy.is_cap must be >= 1 (it caps pi_prox / pi_behav), got {self.is_cap}")

    def update_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``actor.update``."""
        loss = PolicyLoss(clip_ratio_low=self.clip_ratio, clip_ratio_high=self.clip_ratio_high,
                          dual_clip=self.dual_clip, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                          loss_agg=self.loss_agg, off_policy=self.off_policy, is_cap=self.is_cap)
        return {"loss": loss}


class SamplingConfig(msgspec.Struct, **_CFG):
    """How the actor samples responses."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 16
    """Most tokens per response."""
    ignore_eos: bool = False
    """Run every response to its budget (``max_new_tokens``, or the prompt's own
    ``max_new_tokens`` column): fixed response lengths, for benchmarks."""
    min_new_tokens: int = 0
    """Fewest tokens before EOS or a stop string may end a response (vLLM's
    ``min_tokens``; 0 disables it): EOS is masked out of sampling until then."""
    stop: tuple[str, ...] = ()
    """Stop strings: a response ends at the token whose text completes one. The
    response keeps that token (the stop string is in its decoded text; see
    ``SamplingParams.stop``). Decoded with the model directory's tokenizer."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"sampling.n must be >= 1, got {self.n}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"sampling.min_new_tokens must be in 0..sampling.max_new_tokens={self.max_new_tokens} "
                              f"(0 disables it), got {self.min_new_tokens}; lower it or raise max_new_tokens")
        if any(not text for text in self.stop):
            raise ConfigError(f"sampling.stop must list non-empty strings, got {list(self.stop)!r}; remove the "
                              "empty ones")

    def params(self, *, seed: int | None, greedy: bool = False) -> SamplingParams:
        """The actor's sampling parameters (its EOS comes from the model)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0 if greedy else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed, ignore_eos=self.ignore_eos,
                              min_new_tokens=self.min_new_tokens, stop=self.stop)


class OutcomeRoles(Protocol):
    """The roles the sampling helpers call: a role set with these three (as every
    built-in's has)."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None


def ref_for_kl(policy: PolicyConfig) -> dict[str, str]:
    """``RoleSet.needed`` of an algorithm whose reference enters only the loss's KL
    term: ``ref`` when ``policy.kl_coef`` > 0."""
    return {"ref": "algorithm.policy.kl_coef > 0"} if policy.kl_coef > 0 else {}


def sample_and_score(roles: OutcomeRoles, prompts: DataFuture[Any], config: Any, *, seed: int | None,
                     stream: StreamOptions | None, rollout: DataFuture[Any] | None = None
                     ) -> tuple[DataFuture[Any], DataFuture[Any]]:
    """The first half of a critic-free, outcome-reward step: ``config.sampling.n``
    samples per prompt from ``roles.actor``, their ``roles.reward`` scores and, when
    placed, the reference's log-probs, merged. Returns ``(the whole batch, the
    scores)`` (streamed as :class:`Feed` says).

    No ``actor.log_prob`` call: the batch goes to ``actor.update`` of the policy
    that sampled it, which takes ``old_logprobs`` from its own forward pass (the
    same numbers, one forward fewer per step; see ``ActorWorker.update``).
    ``rollout``: samples generated ahead (see :func:`sampled`)."""
    feed = Feed(sampled(roles, prompts, config, seed=seed, stream=stream, rollout=rollout), producer=roles.actor,
                stream=stream)
    scores, parts = scores_and_ref(roles, feed)
    return whole(merge_rows(feed.rows, *parts)), whole(scores)


def carries(rows: DataFuture[Any] | DataStream[Any], field: str) -> bool:
    """Whether ``rows`` carry ``field`` already: samples generated ahead come with the
    scores and reference log-probs of the roles that share the rollout's pool (the
    trainer queues those calls right behind each generation), and a step does not
    compute them again."""
    return rows.fields is not None and field in rows.fields


def scores_and_ref(roles: OutcomeRoles, feed: Feed) -> tuple[DataFuture[Any] | DataStream[Any], list[Any]]:
    """The samples' scores (``roles.reward.score``) and the parts a step merges into
    the samples: those scores and, when a reference is placed, its log-probs, each
    fed the samples (``feed``) unless they carry them (:func:`carries`)."""
    scores = feed.rows if carries(feed.rows, SCORES) else feed(roles.reward.score)
    parts: list[Any] = [] if scores is feed.rows else [scores]
    if roles.ref is not None and not carries(feed.rows, REF_LOGPROBS):
        parts.append(feed(roles.ref.log_prob))
    return scores, parts


def sampled(roles: OutcomeRoles, prompts: DataFuture[Any], config: Any, *, seed: int | None,
            stream: StreamOptions | None, rollout: DataFuture[Any] | None = None
            ) -> DataFuture[Any] | DataStream[Any]:
    """The step's samples: ``rollout`` when the trainer generated them ahead (a
    rollout role's rows, possibly of an older policy: ``actor.update`` corrects
    them by their ``policy_version``), else ``config.sampling.n`` samples per prompt
    from ``roles.actor.generate``."""
    if rollout is not None:
        return rollout
    sampling: SamplingConfig = config.sampling
    return roles.actor.generate(prompts, n=sampling.n, params=sampling.params(seed=seed), stream=stream)


def merge_rows(*parts: Any) -> Any:
    """``merge`` of the parts: micro-batch by micro-batch when all are streams,
    else of the whole batch (every stream collected)."""
    if all(isinstance(p, DataStream) for p in parts):
        return merge(*parts)
    return merge(*(whole(p) for p in parts))


def whole(rows: Any) -> Any:
    """Every row of ``rows`` as one future: a stream collected (in row order), a
    future as is. Stages that need the whole batch (GAE's whitening-free
    per-row math is fine either way; updates shuffle mini-batches) take this."""
    return collect(rows) if isinstance(rows, DataStream) else rows
