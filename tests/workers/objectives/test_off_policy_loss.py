"""The off-policy correction of stale tokens: ``staleness_correction`` and
``PolicyLoss`` on batches that mark them (``stale_tokens``, ``behaviour_logprobs``).

Without a stale token the loss is bit for bit the on-policy one; ``decoupled``
weights each stale token's policy-gradient term (and so its gradient) by
``min(pi_prox / pi_behav, cap)``, not the KL term; ``behaviour`` takes the ratio of stale tokens
against the behaviour policy.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from channels import ConfigError
from workers.objectives import (
    BEHAVIOUR_LOGPROBS,
    STALE_TOKENS,
    ModelOutputs,
    OffPolicyCorrection,
    PolicyLoss,
)
from workers.objectives._policy_losses import staleness_correction

torch.set_num_threads(1)

CAP = 2.0


def _batch(*, seed: int = 0, rows: int = 4, width: int = 6) -> dict[str, Tensor]:
    """Random rows whose old, behaviour and current log-probs all differ (some ratios
    leave the clip range, some importance weights exceed the cap)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=gen) * 3
    return {
        "logprobs": old + 0.4 * torch.randn(rows, width, generator=gen),
        "old_logprobs": old,
        "advantages": torch.randn(rows, width, generator=gen),
        "ref_logprobs": old + 0.1 * torch.randn(rows, width, generator=gen),
        BEHAVIOUR_LOGPROBS: old + torch.randn(rows, width, generator=gen),
        STALE_TOKENS: (torch.rand(rows, width, generator=gen) < 0.5).float(),
    }


def _loss_and_grad(
    loss: PolicyLoss, batch: dict[str, Tensor]
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token loss, its gradient with respect to the log-probs (each token's loss
    depends only on its own log-prob, so this is the per-token gradient), metrics."""
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    terms = loss(ModelOutputs(logprobs=logprobs), batch)
    (grad,) = torch.autograd.grad(terms.per_token.sum(), logprobs)
    return terms.per_token.detach(), grad, dict(terms.metrics)


def _without_stale_columns(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k not in (STALE_TOKENS, BEHAVIOUR_LOGPROBS)}


@pytest.mark.parametrize("mode", list(OffPolicyCorrection))
def test_no_stale_token_is_bit_identical_to_on_policy(mode: OffPolicyCorrection) -> None:
    loss = PolicyLoss(off_policy=mode, dual_clip=3.0, kl_coef=0.1)
    batch = _batch() | {STALE_TOKENS: torch.zeros(4, 6)}
    per_token, grad, metrics = _loss_and_grad(loss, batch)
    want_per_token, want_grad, want_metrics = _loss_and_grad(loss, _without_stale_columns(batch))
    assert torch.equal(per_token, want_per_token)
    assert torch.equal(grad, want_grad)
    for name, value in want_metrics.items():
        assert torch.equal(metrics[name], value), name
    assert metrics["stale_fraction"].sum() == 0
    assert torch.equal(metrics["is_weight"], torch.ones(4, 6))
    assert metrics["is_truncated_fraction"].sum() == 0


def test_decoupled_weight_is_the_truncated_ratio_on_stale_tokens_only() -> None:
    old = torch.zeros(1, 6)
    behaviour = -torch.tensor([[-1.0, 0.0, 0.5, 1.0, 1.0, math.log(CAP)]])  # log weights
    stale = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    terms = staleness_correction(old, behaviour, stale, mode=OffPolicyCorrection.DECOUPLED, cap=CAP)
    want = torch.tensor([[math.exp(-1.0), 1.0, math.exp(0.5), CAP, 1.0, CAP]])
    torch.testing.assert_close(terms.weight, want)
    assert terms.weight[0, 4].item() == 1.0  # fresh: exactly 1 although e^1 > cap
    assert terms.truncated.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert terms.old_logprobs is old  # the ratio stays against the proximal policy


def test_decoupled_loss_and_gradient_are_the_weighted_on_policy_ones() -> None:
    batch = _batch(seed=1)
    loss = PolicyLoss(off_policy=OffPolicyCorrection.DECOUPLED, is_cap=CAP)
    per_token, grad, metrics = _loss_and_grad(loss, batch)
    plain_per_token, plain_grad, _ = _loss_and_grad(loss, _without_stale_columns(batch))
    stale = batch[STALE_TOKENS].bool()
    raw = torch.exp(batch["old_logprobs"] - batch[BEHAVIOUR_LOGPROBS])
    weight = torch.where(stale, raw.clamp(max=CAP), 1.0)
    # The batch has fresh tokens, capped stale ones and stale ones weighted below 1.
    assert (~stale).any() and (stale & (raw > CAP)).any() and (stale & (raw < 1)).any()
    torch.testing.assert_close(metrics["is_weight"], weight)
    assert torch.equal(metrics["is_truncated_fraction"], (stale & (raw > CAP)).float())
    assert torch.equal(metrics["stale_fraction"], batch[STALE_TOKENS])
    torch.testing.assert_close(per_token, weight * plain_per_token)
    torch.testing.assert_close(grad, weight * plain_grad)
    assert torch.equal(grad[~stale], plain_grad[~stale])  # fresh tokens untouched
    assert plain_grad[stale].abs().sum() > 0  # the comparison is not vacuous


def test_behaviour_mode_is_ppo_against_the_behaviour_policy_on_stale_tokens() -> None:
    batch = _batch(seed=2)
    stale = batch[STALE_TOKENS].bool()
    loss = PolicyLoss(off_policy=OffPolicyCorrection.BEHAVIOUR)
    per_token, grad, metrics = _loss_and_grad(loss, batch)
    swapped = _without_stale_columns(batch) | {
        "old_logprobs": torch.where(stale, batch[BEHAVIOUR_LOGPROBS], batch["old_logprobs"])}
    want_per_token, want_grad, _ = _loss_and_grad(PolicyLoss(), swapped)
    assert torch.equal(per_token, want_per_token)
    assert torch.equal(grad, want_grad)
    assert torch.equal(metrics["is_weight"], torch.ones_like(per_token))
    assert metrics["is_truncated_fraction"].sum() == 0
    plain_per_token, _, _ = _loss_and_grad(PolicyLoss(), _without_stale_columns(batch))
    assert not torch.equal(per_token[stale], plain_per_token[stale])


@pytest.mark.parametrize(
    "settings", [{"is_cap": 0.5}, {"is_cap": float("nan")}, {"off_policy": "nope"}]
)
def test_bad_settings_are_refused(settings: dict[str, object]) -> None:
    name = next(iter(settings))
    with pytest.raises(ConfigError, match=f"PolicyLoss.{name}"):
        PolicyLoss(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(OffPolicyCorrection))
def test_huge_log_differences_stay_finite(mode: OffPolicyCorrection) -> None:
    old = torch.full((1, 4), -1.0)
    behaviour = torch.tensor([[-1000.0, 1000.0, -1.0, -1e30]])
    batch = {"logprobs": old + 0.1, "old_logprobs": old,
             "advantages": torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
             BEHAVIOUR_LOGPROBS: behaviour, STALE_TOKENS: torch.ones(1, 4)}
    direct = staleness_correction(old, behaviour, batch[STALE_TOKENS], mode=mode, cap=CAP).weight
    per_token, grad, metrics = _loss_and_grad(PolicyLoss(off_policy=mode, is_cap=CAP), batch)
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    for weight in (direct, metrics["is_weight"]):
        assert (weight > 0).all()  # the log weight is clamped: e^-1001 would underflow to 0
        if mode == OffPolicyCorrection.DECOUPLED:
            assert weight[0, 0] == CAP and weight[0, 1].item() == pytest.approx(math.exp(-20))


def test_the_weight_scales_the_policy_term_not_the_kl_term() -> None:
    batch = _batch(seed=3)
    decoupled = PolicyLoss(off_policy=OffPolicyCorrection.DECOUPLED, is_cap=CAP)
    with_kl = PolicyLoss(off_policy=OffPolicyCorrection.DECOUPLED, is_cap=CAP, kl_coef=0.1)
    policy_term, _, _ = _loss_and_grad(decoupled, batch)
    total, _, metrics = _loss_and_grad(with_kl, batch)
    torch.testing.assert_close(total - policy_term, 0.1 * metrics["kl"])


def test_dual_clip_fraction_is_reported_with_dual_clip_on_an_on_policy_batch() -> None:
    _, _, metrics = _loss_and_grad(PolicyLoss(dual_clip=3.0), _without_stale_columns(_batch()))
    assert "dual_clip_fraction" in metrics
