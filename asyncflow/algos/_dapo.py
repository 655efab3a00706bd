"""DAPO: GRPO with dynamic sampling, decoupled clip ranges, a token-level loss and
overlong reward shaping (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale").

- **Dynamic sampling**: a prompt whose samples all got the same reward (all right
  or all wrong) has zero advantage everywhere and teaches nothing. DAPO drops such
  groups and samples further prompt batches (``more``) until the training batch
  has as many groups as the step's prompts, then takes exactly that many. Only
  the score column comes to the driver (``DataFuture.filter``); the kept rows stay
  where they were generated.
- **Clip-higher**: ``policy.clip_ratio`` (low) and ``policy.clip_ratio_high``
  (high) apart, 0.2 and 0.28 by default, so low-probability tokens can rise.
- **Token-level loss**: ``policy.loss_agg = "token-mean"`` over the global batch.
- **Overlong shaping**: a response within ``overlong_buffer`` tokens of
  ``sampling.max_new_tokens`` is penalised linearly, up to ``overlong_penalty`` at
  the limit (0 turns it off).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from asyncflow import DataFuture, RoleGroup, concat, merge, transform
from asyncflow.algos._checks import at_least, check_group_size
from asyncflow.algos._common import _CFG, PolicyConfig, SamplingConfig, ref_for_kl
from asyncflow.algos._registry import PromptSource, algorithm
from asyncflow.algos._role_set import RoleSet
from channels import Batch, ConfigError
from workers.objectives import LossAggregation, grpo_advantages, overlong_penalties
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class DAPOConfig(msgspec.Struct, **_CFG):
    """DAPO settings."""

    sampling: SamplingConfig = SamplingConfig(n=8)
    """Sampling; ``n`` (at least 2) samples per prompt form its group."""
    policy: PolicyConfig = PolicyConfig(clip_ratio=0.2, clip_ratio_high=0.28,
                                        loss_agg=LossAggregation.TOKEN_MEAN)
    """The actor's update: decoupled clip ranges and a token-level loss by default."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more prompts until the
    batch is full."""
    max_rounds: int = 4
    """Most prompt batches sampled in one step (the first included); a step that
    has not filled its batch by then trains on the groups it has."""
    overlong_buffer: int = 0
    """Tokens before ``sampling.max_new_tokens`` where the overlong penalty starts
    (0: no shaping)."""
    overlong_penalty: float = 1.0
    """Penalty of a response that reaches ``sampling.max_new_tokens``."""

    def check(self) -> None:
        """Raises ConfigError naming a group size, round count or overlong setting
        out of range."""
        check_group_size(self.sampling.n, "DAPO compares the samples of one prompt; 8 or 16 is usual")
        at_least("algorithm.max_rounds", self.max_rounds, 1, "3 or 4 is usual")
        at_least("algorithm.overlong_buffer", self.overlong_buffer, 0, "0 turns the shaping off")
        if self.overlong_buffer >= self.sampling.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer = {self.overlong_buffer} must be below "
                              f"algorithm.sampling.max_new_tokens = {self.sampling.max_new_tokens}")
        at_least("algorithm.overlong_penalty", self.overlong_penalty, 0, "1.0 is DAPO's")


class DAPORoles(RoleSet):
    """DAPO's roles: the actor and the reward; the reference when placed."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: DAPOConfig) -> dict[str, str]:
        """The reference when the loss has a KL term."""
        return ref_for_kl(config.policy)


@transform(reads=("scores", "uid", "response_mask"), writes=("advantages",))
def dapo_advantages(batch: Batch, *, max_len: int, buffer: int, penalty: float) -> dict[str, torch.Tensor]:
    """Group-normalised advantages of the overlong-shaped rewards, on every response
    token. The rows of a group must be on this rank (generate keeps them together)."""
    mask = batch["response_mask"]
    shaped = batch["scores"].float() + overlong_penalties(mask.sum(-1), max_len=max_len, buffer=buffer,
                                                          penalty=penalty)
    return {"advantages": grpo_advantages(shaped, batch["uid"], mask=mask)}


def _varied(scores: torch.Tensor) -> torch.Tensor:
    """Per group (``[groups, n]``): its rewards are not all equal."""
    return scores.amax(dim=1) > scores.amin(dim=1)


@algorithm("dapo", config=DAPOConfig, roles=DAPORoles)
async def dapo_step(roles: DAPORoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any], config: DAPOConfig,
                    *, seed: int | None = None, more: PromptSource | None = None) -> dict[str, float]:
    """One DAPO step (see the module docstring). ``more`` draws further prompt
    batches for dynamic sampling (None: only ``prompts``). Reports, besides the
    update's metrics, ``dapo/batch_groups`` (groups trained on: the step's prompts
    unless ``max_rounds`` ran out), ``dapo/sampled_groups``, ``dapo/kept_fraction``
    and ``dapo/rounds``; ``reward/*`` are over every sampled response."""
    r = DAPORoles.of(roles, config=config, algorithm="DAPO")
    n = config.sampling.n
    target = (await prompts).num_rows
    # [docs:dynamic-sampling] docs/algorithms.md shows this loop, to its end mark.
    source: DataFuture[Any] = prompts
    kept: list[DataFuture[Any]] = []
    sampled: list[DataFuture[Any]] = []
    have = rounds = sampled_groups = 0
    while True:
        round_seed = None if seed is None else seed + 7919 * rounds
        rounds += 1
        rollout = r.actor.generate(source, n=n, params=config.sampling.params(seed=round_seed))
        scored = merge(rollout, r.reward.score(rollout))
        sampled.append(scored)
        sampled_groups += (await scored).num_rows // n
        useful = scored.filter("scores", _varied, by_group=True) if config.dynamic_sampling else scored
        groups = (await useful).num_rows // n
        if groups:
            kept.append(useful)
            have += groups
        if have >= target or rounds >= config.max_rounds or more is None:
            break
        source = await more()
    summary = {"dapo/batch_groups": float(min(have, target)), "dapo/rounds": float(rounds),
               "dapo/sampled_groups": float(sampled_groups), "dapo/kept_fraction": have / sampled_groups}
    stats = score_summary(await r.reward.stats(concat(*sampled)))
    if not kept:  # nothing to learn from in any round
        return stats | summary
    batch = concat(*kept).take(min(have, target), groups=True)
    # [/docs:dynamic-sampling]
    # The policy that sampled every round is the one updated: the update takes
    # old_logprobs from its own forward (no actor.log_prob call).
    parts = [batch] + ([r.ref.log_prob(batch)] if r.ref else [])
    batch = merge(*parts).map(dapo_advantages, max_len=config.sampling.max_new_tokens,
                              buffer=config.overlong_buffer, penalty=config.overlong_penalty)
    actor = await r.actor.update(batch, **config.policy.update_kwargs())
    return actor | stats | summary
