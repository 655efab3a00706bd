"""Advantage estimators for RLHF: GAE (PPO), group-normalised outcome advantages
(GRPO, DAPO), leave-one-out baselines (RLOO), ReMax, Safe-RLHF's Lagrangian; and the reward shaping they
start from (scores on the last token, the KL penalty folded in, DAPO's overlong
punishment).

All estimators are vectorised over the batch and the response length: GAE is one
matrix product of the TD residuals with a discount matrix, not a loop over tokens.
Inputs follow the training engine's convention: ``[B, R]`` tensors over response
tokens with a ``mask`` that is 1 on real tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.objectives._losses import KLEstimator


def scores_to_token_rewards(scores: Tensor, mask: Tensor, turn_rewards: Tensor | None = None) -> Tensor:
    """Place each sequence's outcome score on its last response token.

    Args:
        scores: ``[B]`` sequence-level rewards.
        mask: ``[B, R]`` response mask.
        turn_rewards: ``[B, R]`` an episode's per-turn rewards, each on its turn's
            last sampled token (``workers.episodes``); then each turn's reward stays
            on its turn and only what the score adds to their sum goes on the last
            token (the score is usually that sum: nothing is added).

    Returns:
        ``[B, R]`` float token rewards, zero except at each row's last masked-in token
        (and the turns' ends; all zero for a row with an empty mask).
    """
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask.to(positions.dtype) * positions).argmax(dim=1, keepdim=True)
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    outcome = scores.to(torch.float32)
    if turn_rewards is not None:
        placed = turn_rewards.to(torch.float32) * mask
        outcome = outcome - placed.sum(dim=1)
        rewards += placed
    rewards.scatter_add_(1, last, outcome.unsqueeze(1))
    return rewards * mask


def fold_kl_into_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = KLEstimator.K1,
    turn_rewards: Tensor | None = None,
) -> Tensor:
    """PPO token rewards: the outcome score on the last token (an episode's turn
    rewards on their turns, see :func:`scores_to_token_rewards`) minus a per-token
    KL penalty.

    Args:
        scores: ``[B]`` sequence-level rewards.
        logprobs: ``[B, R]`` rollout (old policy) log-probs.
        ref_logprobs: ``[B, R]`` reference log-probs.
        mask: ``[B, R]`` response mask.
        kl_coef: weight of the KL penalty.
        estimator: KL estimator used for the penalty.
        turn_rewards: see :func:`scores_to_token_rewards`.

    Returns:
        ``[B, R]`` token rewards, 0 on padding.
    """
    kl = estimator.estimate(logprobs, ref_logprobs)
    return scores_to_token_rewards(scores, mask, turn_rewards) - kl_coef * kl * mask


def _pack_left(mask: Tensor) -> Tensor:
    """Column order that moves each row's masked-in tokens to the front, keeping their order."""
    is_padding = (mask == 0).to(torch.int32)
    return torch.sort(is_padding, dim=1, stable=True).indices


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, vectorised.

    Masked-out tokens are skipped (not just zeroed): a token's successor is the next
    masked-in token of its row, and discounting counts masked-in steps only, so an
    interleaved mask (e.g. tool observations) is handled like a right-padded one.
    Each row's masked-in tokens are packed to the front, the TD residuals
    ``delta_i = r_i + gamma V_{i+1} - V_i`` are formed, and ``A = delta @ D^T`` with the
    upper-triangular ``D[i, j] = (gamma lam)^(j - i)``.

    Args:
        token_rewards: ``[B, R]`` per-token rewards (e.g. from :func:`fold_kl_into_rewards`).
        values: ``[B, R]`` critic values of the response tokens.
        mask: ``[B, R]`` response mask.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both float32 ``[B, R]`` and 0 on padding;
        ``returns = advantages + values``.
    """
    length = mask.shape[1]
    mask_f = mask.to(torch.float32)
    order = _pack_left(mask)
    packed_mask = mask_f.gather(1, order)
    packed_values = values.to(torch.float32).gather(1, order) * packed_mask
    packed_rewards = token_rewards.to(torch.float32).gather(1, order) * packed_mask
    next_values = torch.nn.functional.pad(packed_values[:, 1:], (0, 1))
    deltas = (packed_rewards + gamma * next_values - packed_values) * packed_mask

    steps = torch.arange(length, device=mask.device)
    offsets = steps.unsqueeze(0) - steps.unsqueeze(1)  # offsets[i, j] = j - i
    decay = torch.tensor(gamma * lam, dtype=torch.float32, device=mask.device)
    discount = torch.where(offsets >= 0, decay.pow(offsets.clamp(min=0)), 0.0)
    packed_adv = deltas @ discount.T

    advantages = torch.zeros_like(packed_adv).scatter(1, order, packed_adv) * mask_f
    returns = (advantages + values.to(torch.float32)) * mask_f
    return advantages, returns


def group_sums(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group row counts and sums of ``values``.

    Args:
        values: ``[B]`` float values.
        group_ids: ``[B]`` integer id of each row's group (any values).

    Returns:
        ``(inverse, counts, sums)``: each row's group index into ``[G]`` and the
        ``[G]`` float32 counts and sums.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(groups, dtype=torch.float32, device=values.device)
    return inverse, zeros.index_add(0, inverse, torch.ones_like(values)), zeros.index_add(0, inverse, values)


def leave_one_out_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO's advantages: each score minus the mean of the other scores of its
    prompt group (0 for a group of one, which has no baseline).

    Args:
        scores: ``[B]`` sequence-level rewards.
        group_ids: ``[B]`` integer id of each sample's prompt group (any values).

    Returns:
        ``[B]`` float32 advantages.
    """
    scores = scores.to(torch.float32)
    inverse, group_counts, group_totals = group_sums(scores, group_ids)
    counts, sums = group_counts[inverse], group_totals[inverse]
    others = (counts - 1).clamp(min=1)
    return torch.where(counts > 1, scores - (sums - scores) / others, torch.zeros_like(scores))


def overlong_penalties(lengths: Tensor, *, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment of a response of ``lengths`` tokens: 0 up to
    ``max_len - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_len``
    (no shaping when ``buffer`` is 0).

    Args:
        lengths: ``[B]`` response lengths.
        max_len: the longest response (the sampling's ``max_new_tokens``).
        buffer: how many tokens before ``max_len`` the punishment starts.
        penalty: the punishment at ``max_len``.

    Returns:
        ``[B]`` float32 reward terms, 0 or negative.
    """
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    over = (lengths - (max_len - buffer)).clamp(min=0.0) / buffer
    return -penalty * over.clamp(max=1.0)


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    mask: Tensor | None = None,
) -> Tensor:
    """Group-normalised outcome advantages (GRPO): ``(score - group mean) / (group std + eps)``.

    The standard deviation is the unbiased one (as ``torch.std``); a group of one
    sample gets advantage 0 (it has no baseline to compare against), as does a sample of
    a constant group when ``eps`` is 0.

    Args:
        scores: ``[B]`` sequence-level rewards.
        group_ids: ``[B]`` integer id of each sample's prompt group (any values).
        scale_by_std: divide by the group std (False gives Dr. GRPO's mean-only form).
        eps: added to the std.
        mask: optional ``[B, R]`` response mask; when given the advantage is broadcast
            over each row's tokens.

    Returns:
        ``[B]`` float32 advantages, or ``[B, R]`` when ``mask`` is given.
    """
    scores = scores.to(torch.float32)
    inverse, counts, sums = group_sums(scores, group_ids)
    centred = scores - (sums / counts)[inverse]
    advantages = centred
    if scale_by_std:
        squares = torch.zeros_like(sums).index_add(0, inverse, centred**2)
        stds = torch.sqrt(squares / (counts - 1).clamp(min=1))
        denominators = stds[inverse] + eps
        # eps=0 with a constant group would give 0/0; such samples carry no signal.
        advantages = torch.where(denominators > 0, centred / denominators, 0.0)
    if mask is None:
        return advantages
    return advantages.unsqueeze(1) * mask.to(torch.float32)


def lagrangian_advantages(reward_advantages: Tensor, cost_advantages: Tensor, lagrange: float) -> Tensor:
    """Safe-RLHF's advantages: reward and cost advantages combined as
    ``(A_r - lambda * A_c) / (1 + lambda)`` (the Lagrangian of "maximise reward
    subject to expected cost", scaled to stay comparable as ``lambda`` grows).

    Args:
        reward_advantages: ``[B, R]`` advantages of the reward model's scores.
        cost_advantages: ``[B, R]`` advantages of the cost model's scores.
        lagrange: the multiplier ``lambda`` (at least 0).

    Returns:
        ``[B, R]`` advantages.
    """
    return (reward_advantages - lagrange * cost_advantages) / (1.0 + lagrange)


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor) -> Tensor:
    """ReMax advantages: reward-to-go minus the greedy response's reward (the baseline).

    Args:
        token_rewards: ``[B, R]`` per-token rewards of the sampled responses.
        baseline_scores: ``[B]`` sequence reward of the greedy response to the same prompt.
        mask: ``[B, R]`` response mask.

    Returns:
        ``[B, R]`` float32 advantages, 0 on padding.
    """
    mask_f = mask.to(torch.float32)
    rewards = token_rewards.to(torch.float32) * mask_f
    to_go = rewards.flip(1).cumsum(1).flip(1)
    return (to_go - baseline_scores.to(torch.float32).unsqueeze(1)) * mask_f
