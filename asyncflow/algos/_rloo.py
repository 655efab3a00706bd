"""RLOO: REINFORCE with a leave-one-out baseline, no critic (Ahmadian et al., 2024,
"Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs").

Each prompt gets ``k`` samples; a sample's baseline is the mean reward of the
other ``k - 1`` samples of its prompt, so its advantage is ``r_i - mean_{j != i}
r_j = k / (k - 1) * (r_i - mean_j r_j)``: unbiased, with no learned critic and no
division by the group's standard deviation (GRPO's difference).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from asyncflow import DataFuture, RoleGroup, StreamOptions, gather, transform
from asyncflow.algos._checks import check_group_size
from asyncflow.algos._common import _CFG, PolicyConfig, SamplingConfig, ref_for_kl, sample_and_score
from asyncflow.algos._registry import algorithm
from asyncflow.algos._role_set import RoleSet
from channels import Batch
from workers.objectives import leave_one_out_advantages
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class RLOOConfig(msgspec.Struct, **_CFG):
    """RLOO settings."""

    sampling: SamplingConfig = SamplingConfig(n=4)
    """Sampling; ``n`` (at least 2) samples per prompt form its leave-one-out group."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update (RLOO's paper uses the PPO clip; ``clip_ratio`` large
    turns it into plain REINFORCE)."""

    def check(self) -> None:
        """Raises ConfigError unless each prompt has a group of samples."""
        check_group_size(self.sampling.n, "RLOO's baseline is the other samples of the prompt; 4 is usual")


class RLOORoles(RoleSet):
    """RLOO's roles: the actor and the reward; the reference when placed."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: RLOOConfig) -> dict[str, str]:
        """The reference when the loss has a KL term."""
        return ref_for_kl(config.policy)


@transform(reads=("scores", "uid", "response_mask"), writes=("advantages",))
def rloo_advantages(batch: Batch) -> dict[str, torch.Tensor]:
    """RLOO's advantages on every response token. The rows of a prompt's group must
    be on this rank (``generate`` keeps them together)."""
    mask = batch["response_mask"]
    adv = leave_one_out_advantages(batch["scores"], batch["uid"])
    return {"advantages": adv[:, None].expand_as(mask).to(torch.float32) * mask}


@algorithm("rloo", config=RLOOConfig, roles=RLOORoles)
async def rloo_step(roles: RLOORoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any], config: RLOOConfig,
                    *, seed: int | None = None, stream: StreamOptions | None = None) -> dict[str, float]:
    """One RLOO step: ``n`` samples per prompt, scored; each sample's advantage is
    its score minus the mean score of its prompt's other samples; then the actor's
    update. With ``stream``, the inference calls on other pools than the actor's
    take the samples as they finish."""
    r = RLOORoles.of(roles, config=config, algorithm="RLOO")
    batch, scores = sample_and_score(r, prompts, config, seed=seed, stream=stream)
    stats = r.reward.stats(scores)  # asked for first: it runs behind the scores, not after the update
    actor, summary = await gather(r.actor.update(batch.map(rloo_advantages), **config.policy.update_kwargs()),
                                  stats)
    return actor | score_summary(summary)
