"""The advantage transforms on plain batches (they run on worker ranks in a run)."""

from __future__ import annotations

import pytest
import torch

from asyncflow.algos import (
    gae,
    greedy_baseline_advantages,
    group_advantages,
    kl_penalised_rewards,
    safe_advantages,
    token_rewards,
)
from channels import Batch


def _batch(**extra: torch.Tensor) -> Batch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    cols = {"response_mask": mask, "scores": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "uid": torch.tensor([7, 7, 9, 9]), "values": torch.zeros(4, 4),
            "old_logprobs": torch.full((4, 4), -1.0), "ref_logprobs": torch.full((4, 4), -1.5)}
    return Batch(cols | extra)


def test_token_rewards_sit_on_the_last_response_token() -> None:
    b = _batch()
    r = token_rewards(b)["token_rewards"]
    assert r.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]


def test_kl_penalty_lowers_every_response_token() -> None:
    b = _batch()
    r = kl_penalised_rewards(b, kl_coef=0.1)["token_rewards"]
    plain = token_rewards(b)["token_rewards"]
    mask = b["response_mask"].bool()
    assert torch.allclose((plain - r)[mask], torch.full((int(mask.sum()),), 0.05))  # 0.1 * (-1 - -1.5)
    assert torch.all(r[~mask] == 0)


def test_gae_with_zero_values_and_lambda_one_returns_the_reward_to_go() -> None:
    b = _batch()
    b = b.update(token_rewards(b))
    out = gae(b, gamma=1.0, lam=1.0, whiten=False)
    assert out["returns"][0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert torch.all(out["advantages"][b["response_mask"] == 0] == 0)


def test_group_advantages_normalise_within_each_prompt() -> None:
    out = group_advantages(_batch())["advantages"]
    first = out[:, 0]
    assert first[0] > 0 > first[1] and first[2] > 0 > first[3]
    assert first[0] == pytest.approx(-first[1])


def test_remax_subtracts_the_greedy_score() -> None:
    b = _batch(baseline_scores=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    adv = greedy_baseline_advantages(b)["advantages"]
    assert adv[:, 0].tolist() == [0.0, -1.0, 1.0, 0.0]


def test_safe_advantages_trade_reward_against_cost() -> None:
    b = _batch(costs=torch.tensor([1.0, 0.0, 0.0, 1.0]), cost_values=torch.zeros(4, 4))
    low = safe_advantages(b, lagrange=0.0, lam=1.0)["advantages"][:, 0]
    high = safe_advantages(b, lagrange=10.0, lam=1.0)["advantages"][:, 0]
    # Sample 0 is rewarded but costly: a large multiplier makes its advantage drop below sample 2's.
    assert low[0] == pytest.approx(low[2])
    assert high[0] < high[2]
