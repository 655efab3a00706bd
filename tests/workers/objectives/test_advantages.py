"""Advantage estimators against straightforward reference implementations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.objectives import (
    KLEstimator,
    fold_kl_into_rewards,
    gae_advantages,
    grpo_advantages,
    lagrangian_advantages,
    leave_one_out_advantages,
    overlong_penalties,
    remax_advantages,
    scores_to_token_rewards,
)

torch.set_num_threads(1)


def reference_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's loop: masked-out tokens are skipped (values and TD errors carried over)."""
    rows, length = rewards.shape
    mask = mask.double()
    next_value = torch.zeros(rows, dtype=torch.float64)
    last = torch.zeros(rows, dtype=torch.float64)
    out = torch.zeros(rows, length, dtype=torch.float64)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        out[:, t] = last
    out = out * mask
    return out, (out + values) * mask


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5),
    length=st.integers(1, 12),
    gamma=st.sampled_from([1.0, 0.99, 0.5]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
    interleaved=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_gae_matches_reference_loop(
    rows: int, length: int, gamma: float, lam: float, interleaved: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, length, generator=gen, dtype=torch.float64)
    values = torch.randn(rows, length, generator=gen, dtype=torch.float64)
    if interleaved:
        mask = (torch.rand(rows, length, generator=gen) > 0.3).long()
    else:
        lengths = torch.randint(0, length + 1, (rows,), generator=gen)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_outcome_reward_with_lambda_one_is_reward_minus_value() -> None:
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = scores_to_token_rewards(torch.tensor([2.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 2.0, 0.0]]
    values = torch.tensor([[0.5, 0.25, 1.0, 9.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.75, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0, 0.0]]))


def test_turn_rewards_stay_on_their_turns_and_the_rest_of_the_score_goes_last() -> None:
    # An episode: two sampled turns with an observation between them (mask 0).
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    turns = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]])
    rewards = scores_to_token_rewards(torch.tensor([1.5]), mask, turns)  # the score is their sum
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]]
    rewards = scores_to_token_rewards(torch.tensor([2.0]), mask, turns)  # a bonus beyond the turns'
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 1.5, 0.0]]
    assert scores_to_token_rewards(torch.tensor([1.5]), mask).tolist() == [[0, 0, 0, 0, 0, 1.5, 0]]


def test_grpo_advantages_match_per_group_normalisation() -> None:
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 3.0, 7.0])
    groups = torch.tensor([10, 10, 10, 4, 4, 99, 4])
    adv = grpo_advantages(scores, groups, eps=0.0)
    for gid in groups.unique():
        sel = groups == gid
        group = scores[sel]
        if sel.sum() == 1:
            assert adv[sel].tolist() == [0.0]
            continue
        expected = (group - group.mean()) / group.std()
        torch.testing.assert_close(adv[sel], expected)
    mask = torch.tensor([[1, 1, 0]] * 7)
    broadcast = grpo_advantages(scores, groups, eps=0.0, mask=mask)
    torch.testing.assert_close(broadcast[:, 1], adv)
    assert broadcast[:, 2].abs().sum().item() == 0.0
    mean_only = grpo_advantages(scores, groups, scale_by_std=False)
    assert mean_only[:3].tolist() == pytest.approx([0.0, -1.0, 1.0])


def test_remax_is_reward_to_go_minus_greedy_baseline() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards = torch.tensor([[0.5, 0.0, 1.0], [2.0, 7.0, 7.0]])
    adv = remax_advantages(rewards, torch.tensor([1.0, 0.5]), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [1.5, 0.0, 0.0]]))


def test_kl_folded_into_token_rewards() -> None:
    mask = torch.tensor([[1, 1, 0]])
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    rewards = fold_kl_into_rewards(torch.tensor([3.0]), logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 3.0 + 0.1, 0.0]]))
    k2 = fold_kl_into_rewards(
        torch.tensor([3.0]), logp, ref, mask, kl_coef=1.0, estimator=KLEstimator.K2
    )
    torch.testing.assert_close(k2, torch.tensor([[-0.125, 2.5, 0.0]]))


def test_leave_one_out_baseline() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 7.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 3])
    got = leave_one_out_advantages(scores, groups)
    # group 5: 1 - 0, 0 - 0.5, 0 - 0.5; group 9: 2 - 4, 4 - 2; a group of one: 0
    assert torch.allclose(got, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0, 0.0]))
    # k / (k - 1) times the deviation from the group mean
    assert torch.allclose(got[:3], 3 / 2 * (scores[:3] - scores[:3].mean()))


def test_overlong_penalty_falls_linearly_over_the_buffer() -> None:
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    got = overlong_penalties(lengths, max_len=16, buffer=4, penalty=2.0)
    # free up to 16 - 4 = 12 tokens, then -2 * (over / 4), at most -2
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    assert torch.equal(overlong_penalties(lengths, max_len=16, buffer=0, penalty=2.0), torch.zeros(6))


def test_lagrangian_advantages_weigh_cost_by_lambda_and_rescale() -> None:
    reward, cost = torch.tensor([[2.0, 1.0]]), torch.tensor([[1.0, 3.0]])
    assert torch.equal(lagrangian_advantages(reward, cost, 0.0), reward)
    # lambda 1: (A_r - A_c) / 2
    assert torch.allclose(lagrangian_advantages(reward, cost, 1.0), torch.tensor([[0.5, -1.0]]))
