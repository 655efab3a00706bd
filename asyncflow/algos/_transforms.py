"""The algorithms' advantage steps as row transforms: which columns feed which
estimator of ``workers.objectives`` (where the math lives) and the fields each step
reads and writes, which the driver needs to plan pulls at call time. They run on
the ranks that consume the rows (``fut.map``), never on the driver.

Per-row math needs only the rank's rows. Whitening needs the mean and variance of
the whole batch: the ranks add up their partial sums (``sum_over_call_rows``, a few
numbers per call), so advantages do not depend on how rows are spread over ranks.

Column names follow ``workers.roles``: ``scores`` (one per sample), ``values``,
``old_logprobs``, ``ref_logprobs`` and ``response_mask`` (per response token).
"""

from __future__ import annotations

import torch

from asyncflow import transform
from channels import Batch
from workers.objectives import (
    KLEstimator,
    fold_kl_into_rewards,
    gae_advantages,
    grpo_advantages,
    lagrangian_advantages,
    masked_whiten,
    remax_advantages,
    scores_to_token_rewards,
)
from workers.roles import sum_over_call_rows


@transform(reads=("scores", "response_mask"), optional=("turn_rewards",), writes=("token_rewards",))
def token_rewards(batch: Batch) -> dict[str, torch.Tensor]:
    """Sequence scores placed on each response's last token (an episode's turn
    rewards, when the rows have them, on their turns)."""
    return {"token_rewards": scores_to_token_rewards(batch["scores"].float(), batch["response_mask"],
                                                     batch.get("turn_rewards"))}


@transform(reads=("scores", "old_logprobs", "ref_logprobs", "response_mask"), optional=("turn_rewards",),
           writes=("token_rewards",))
def kl_penalised_rewards(batch: Batch, *, kl_coef: float, estimator: str = "k1") -> dict[str, torch.Tensor]:
    """Scores on the last token (turn rewards on their turns) minus ``kl_coef`` times
    the per-token KL to the reference policy (the KL folded into the reward, as in
    InstructGPT's PPO)."""
    rewards = fold_kl_into_rewards(
        batch["scores"].float(), batch["old_logprobs"], batch["ref_logprobs"], batch["response_mask"],
        kl_coef=kl_coef, estimator=KLEstimator(estimator), turn_rewards=batch.get("turn_rewards"),
    )
    return {"token_rewards": rewards}


@transform(reads=("token_rewards", "values", "response_mask"), writes=("advantages", "returns"))
def gae(batch: Batch, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> dict[str, torch.Tensor]:
    """Generalised advantage estimation (one matrix product over the response
    length); with ``whiten``, advantages whitened over every response token of the
    call's whole batch (all consumer ranks' rows: a collective over the consumer's
    ranks, which a rank without rows joins too)."""
    mask = batch["response_mask"]
    adv, returns = gae_advantages(batch["token_rewards"], batch["values"], mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask, sum_over_ranks=sum_over_call_rows)
    return {"advantages": adv * mask, "returns": returns}


@transform(reads=("scores", "uid", "response_mask"), writes=("advantages",))
def group_advantages(batch: Batch, *, scale_by_std: bool = True) -> dict[str, torch.Tensor]:
    """GRPO: each sample's score minus its prompt group's mean (over std), on every
    response token. The rows of a group must be on this rank (generate keeps
    them together)."""
    mask = batch["response_mask"]
    adv = grpo_advantages(batch["scores"].float(), batch["uid"], scale_by_std=scale_by_std, mask=mask)
    return {"advantages": adv}


@transform(reads=("scores", "baseline_scores", "response_mask"), writes=("advantages",))
def greedy_baseline_advantages(batch: Batch) -> dict[str, torch.Tensor]:
    """ReMax: the sampled response's score minus the greedy response's score."""
    mask = batch["response_mask"]
    rewards = scores_to_token_rewards(batch["scores"].float(), mask)
    return {"advantages": remax_advantages(rewards, batch["baseline_scores"].float(), mask)}


@transform(
    reads=("scores", "costs", "values", "cost_values", "response_mask"),
    writes=("advantages", "returns", "cost_returns"),
)
def safe_advantages(batch: Batch, *, lagrange: float, gamma: float = 1.0, lam: float = 0.95
                    ) -> dict[str, torch.Tensor]:
    """Safe-RLHF: reward and cost advantages by GAE, combined as
    ``(A_r - lambda * A_c) / (1 + lambda)`` and whitened over every response token
    of the call's whole batch (as :func:`gae`); also the returns both critics fit."""
    mask = batch["response_mask"]
    r_adv, r_ret = gae_advantages(scores_to_token_rewards(batch["scores"].float(), mask), batch["values"],
                                  mask, gamma=gamma, lam=lam)
    c_adv, c_ret = gae_advantages(scores_to_token_rewards(batch["costs"].float(), mask), batch["cost_values"],
                                  mask, gamma=gamma, lam=lam)
    adv = masked_whiten(lagrangian_advantages(r_adv, c_adv, lagrange), mask, sum_over_ranks=sum_over_call_rows)
    return {"advantages": adv * mask, "returns": r_ret, "cost_returns": c_ret}
