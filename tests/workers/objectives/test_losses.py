"""Unit tests of the engine's pure loss functions and estimators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.objectives import (
    KLEstimator,
    LossAggregation,
    ModelOutputs,
    PolicyLoss,
    kl_k3,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    masked_whiten,
)
from workers.objectives._losses import kl_k1, kl_k2, masked_mean
from workers.objectives._policy_losses import clipped_value_loss, ppo_policy_loss

torch.set_num_threads(1)


def test_masked_mean_and_whiten_ignore_padding() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.5)
    assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 3.5])
    white = masked_whiten(values, mask)
    assert white[:, 2].tolist() == [0.0, 0.0]
    assert masked_mean(white, mask).item() == pytest.approx(0.0, abs=1e-6)
    picked = white[mask.bool()]
    assert picked.var(unbiased=True).item() == pytest.approx(1.0, rel=1e-4)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_ratio_one_has_no_clipping_and_loss_is_minus_advantage() -> None:
    logp = torch.randn(4, 5)
    adv = torch.randn(4, 5)
    terms = ppo_policy_loss(logp, logp.clone(), adv, clip_ratio_low=0.2, dual_clip=3.0)
    assert terms.clipped.sum().item() == 0.0
    assert terms.dual_clipped.sum().item() == 0.0
    torch.testing.assert_close(terms.loss, -adv)
    torch.testing.assert_close(terms.ratio, torch.ones_like(logp))


def test_clip_bounds_with_asymmetric_clip_higher() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    terms = ppo_policy_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A>0, r=1.5: clipped at 1.28.  A>0, r=0.5: the unclipped (smaller objective) wins.
    # A<0, r=1.5: unclipped 1.5 wins.  A<0, r=0.5: clipped at 0.8.
    torch.testing.assert_close(terms.loss, torch.tensor([-1.28, -0.5, 1.5, 0.8]))
    assert terms.clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_dual_clip_bounds_negative_advantages_only() -> None:
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([10.0, 10.0, 2.0]))
    adv = torch.tensor([-2.0, 2.0, -2.0])
    terms = ppo_policy_loss(logp, old, adv, dual_clip=3.0)
    # A<0 with r=10: -A*r = 20 is bounded by -A*c = 6; A>0 is untouched (clip 1.2);
    # A<0 with r=2: 4 < 6 stays.
    torch.testing.assert_close(terms.loss, torch.tensor([6.0, -2.4, 4.0]))
    assert terms.dual_clipped.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(logp, old, adv, dual_clip=1.0)


def test_kl_estimators_known_values() -> None:
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    # r = ref/p = 0.5, log r = -log 2
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - 1 + math.log(2))
    same = torch.tensor([-1.3])
    for est in KLEstimator:
        assert est.estimate(same, same).item() == pytest.approx(0.0)


def test_k1_and_k3_are_unbiased_for_sampled_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    exact = (p * (p.log() - q.log())).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[tokens], q.log()[tokens]
    assert kl_k1(logp, logq).mean().item() == pytest.approx(exact, abs=0.01)
    assert kl_k3(logp, logq).mean().item() == pytest.approx(exact, abs=0.01)
    assert (kl_k3(logp, logq) >= 0).all() and (kl_k2(logp, logq) >= 0).all()


def test_value_loss_clipping() -> None:
    old = torch.zeros(3)
    returns = torch.tensor([1.0, 1.0, -1.0])
    values = torch.tensor([0.5, -0.1, 0.05])
    terms = clipped_value_loss(values, old, returns, clip_range=0.2)
    # v=0.5 clips to 0.2: (0.2-1)^2=0.64 > (0.5-1)^2=0.25 -> clipped error taken.
    # v=-0.1 within range: both errors equal.  v=0.05: inside range as well.
    expected = 0.5 * torch.tensor([0.64, 1.21, 1.05**2])
    torch.testing.assert_close(terms.loss, expected)
    assert terms.clipped.tolist() == [1.0, 0.0, 0.0]
    plain = clipped_value_loss(values, old, returns, clip_range=None)
    torch.testing.assert_close(plain.loss, 0.5 * (values - returns) ** 2)


def test_logprobs_and_entropy_match_log_softmax_with_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    for temperature in (1.0, 0.7):
        ref_lsm = torch.log_softmax(logits / temperature, -1)
        ref = ref_lsm.gather(-1, labels[..., None]).squeeze(-1)
        got = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=4)
        torch.testing.assert_close(got, ref)
        (g_ref,) = torch.autograd.grad(ref.sum(), logits)
        (g_got,) = torch.autograd.grad(got.sum(), logits)
        torch.testing.assert_close(g_got, g_ref)
        both, ent = logprobs_and_entropy_from_logits(logits, labels, temperature=temperature, chunk_size=4)
        torch.testing.assert_close(both, ref)
        torch.testing.assert_close(ent, -(ref_lsm.exp() * ref_lsm).sum(-1))
        (g_both,) = torch.autograd.grad((both + ent).sum(), logits)
        lsm = torch.log_softmax(logits / temperature, -1)  # (the graph above is spent)
        expected = lsm.gather(-1, labels[..., None]).squeeze(-1) - (lsm.exp() * lsm).sum(-1)
        (g_ref_both,) = torch.autograd.grad(expected.sum(), logits)
        torch.testing.assert_close(g_both, g_ref_both)
        _, detached = logprobs_and_entropy_from_logits(logits, labels, temperature=temperature, entropy_grad=False)
        assert not detached.requires_grad
        torch.testing.assert_close(detached, ent.detach())


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    split=st.integers(0, 6),
    mode=st.sampled_from(list(LossAggregation)),
    seed=st.integers(0, 1000),
)
def test_aggregation_parts_add_up_over_row_splits(
    rows: int, split: int, mode: LossAggregation, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, 5, generator=gen)
    mask = (torch.rand(rows, 5, generator=gen) > 0.3).long()
    split = min(split, rows)
    num_a, den_a = mode.parts(values[:split], mask[:split])
    num_b, den_b = mode.parts(values[split:], mask[split:])
    whole = mode.reduce(values, mask)
    torch.testing.assert_close((num_a + num_b) / (den_a + den_b).clamp(min=1), whole)


def test_grpo_objective_is_the_policy_loss_with_a_k3_kl_term_and_seq_mean_token_mean() -> None:
    logp = torch.full((2, 4), -1.0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    batch = {"old_logprobs": logp, "advantages": torch.tensor([1.0, -3.0])}
    outputs = ModelOutputs(logprobs=logp)
    plain = PolicyLoss()(outputs, batch)
    token_mean = LossAggregation.TOKEN_MEAN.reduce(plain.per_token, mask)
    seq_mean = LossAggregation.SEQ_MEAN_TOKEN_MEAN.reduce(plain.per_token, mask)
    assert token_mean.item() == pytest.approx((-4 * 1.0 + 3.0) / 5)
    assert seq_mean.item() == pytest.approx((-1.0 + 3.0) / 2)
    assert masked_mean(plain.metrics["clip_fraction"], mask).item() == 0.0
    ref = torch.full((2, 4), -1.5)
    with_kl = PolicyLoss(kl_coef=0.1)(outputs, batch | {"ref_logprobs": ref})
    k3 = math.exp(-0.5) - 1 + 0.5
    got = LossAggregation.SEQ_MEAN_TOKEN_MEAN.reduce(with_kl.per_token, mask)
    assert got.item() == pytest.approx(seq_mean.item() + 0.1 * k3, rel=1e-6)
    assert masked_mean(with_kl.metrics["kl"], mask).item() == pytest.approx(k3, rel=1e-6)
    assert PolicyLoss(kl_coef=0.1).required_fields == ("old_logprobs", "advantages", "ref_logprobs")
