"""The math that makes results independent of the data-parallel layout, without Ray:
whitening from sums over shards (one of them empty), metric reductions weighted by
rows and tokens, and the objectives' ``loss_agg`` setting."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from engines_testlib import make_batch, tiny_lm

from channels import (
    DP,
    ConfigError,
    Layout,
    Metrics,
    OneToAll,
    RankResult,
    RankZero,
    SchemaError,
    reduce_metrics,
)
from workers.engines import TrainingConfig, TrainingEngine
from workers.objectives import LossAggregation, NLLLoss, PolicyLoss, ValueLoss, masked_whiten

torch.set_num_threads(1)


class _ThreadSums:
    """``sum_over_ranks`` for shards run on threads: each call waits for every
    shard's partial and returns their sum (as an all-reduce would)."""

    def __init__(self, shards: int) -> None:
        self._barrier = threading.Barrier(shards)
        self._parts: list[torch.Tensor | None] = [None] * shards

    def for_shard(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def total(partial: torch.Tensor) -> torch.Tensor:
            self._parts[i] = partial.clone()
            self._barrier.wait()
            out = torch.stack([p for p in self._parts if p is not None]).sum(0)
            self._barrier.wait()  # nobody overwrites a part before all have read them
            return out
        return total


def _whiten_in_shards(values: torch.Tensor, mask: torch.Tensor, cuts: list[int], **kw: object) -> torch.Tensor:
    bounds = list(zip([0, *cuts], [*cuts, values.shape[0]], strict=True))
    sums, out = _ThreadSums(len(bounds)), [torch.empty(0)] * len(bounds)

    def run(i: int, lo: int, hi: int) -> None:
        out[i] = masked_whiten(values[lo:hi], mask[lo:hi], sum_over_ranks=sums.for_shard(i), **kw)

    threads = [threading.Thread(target=run, args=(i, lo, hi)) for i, (lo, hi) in enumerate(bounds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return torch.cat(out)


@pytest.mark.parametrize("cuts", [[2], [5], [1, 1, 4], [0]])
def test_whitening_from_shard_sums_equals_whole_batch_whitening(cuts: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(6, 7, generator=gen) * 3 + 1
    mask = (torch.arange(7)[None] < torch.tensor([7, 1, 3, 5, 2, 6])[:, None]).long()
    whole = masked_whiten(values, mask)
    sharded = _whiten_in_shards(values, mask, cuts)  # [0] and [5]: shards without rows or nearly
    torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-6)
    kept = whole[mask.bool()]
    assert abs(float(kept.mean())) < 1e-6 and float(kept.std()) == pytest.approx(1.0, rel=1e-5)
    # Whitening each shard on its own would differ: the test can fail.
    alone = torch.cat([masked_whiten(values[:2], mask[:2]), masked_whiten(values[2:], mask[2:])])
    assert (alone - whole).abs().max() > 1e-2


def test_whitening_keeps_the_mean_when_asked_and_ignores_padding() -> None:
    values = torch.tensor([[1.0, 3.0, float("nan")], [5.0, 7.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = masked_whiten(values, mask, shift_mean=False)
    assert out[0, 2] == 0 and torch.isfinite(out).all()
    assert float(out[mask.bool()].mean()) == pytest.approx(5.0, rel=1e-6)
    assert masked_whiten(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)


def test_mean_metrics_are_weighted_by_rows_and_ignore_empty_ranks() -> None:
    # Rank 0 had 3 rows with mean 1.0, rank 1 one row with mean 5.0, rank 2 none.
    dicts = [{"m": 1.0, "n": 3}, {"m": 5.0, "n": 1}, {"m": 0.0, "n": 0}]
    out = reduce_metrics(dicts, {"n": "sum"}, weights=[3, 1, 0])
    assert out == {"m": pytest.approx(2.0), "n": 4.0}
    assert reduce_metrics([{"m": 0.25}, {"m": 0.25}], weights=[0, 0]) == {"m": 0.25}


def test_token_means_are_weighted_by_the_tokens_each_rank_reports() -> None:
    dicts = [{"kl": 0.1, "tok": 30.0, "hi": 2.0, "lo": 1.0},
             {"kl": 0.4, "tok": 10.0, "hi": 3.0, "lo": 0.5},
             {"kl": 9.0, "tok": 0.0}]  # no tokens: does not count
    reduce = {"kl": "token_mean", "tok": "sum", "hi": "max", "lo": "min"}
    out = reduce_metrics(dicts, reduce, weights=[1, 5, 1], tokens="tok")
    assert out == {"kl": pytest.approx((0.1 * 30 + 0.4 * 10) / 40), "tok": 40.0, "hi": 3.0, "lo": 0.5}
    with pytest.raises(SchemaError, match="'tok'"):
        reduce_metrics([{"kl": 0.1}], reduce, tokens="tok")
    with pytest.raises(ConfigError, match="tokens=KEY"):
        reduce_metrics([{"kl": 0.1}], reduce)


def test_metrics_protocol_weights_by_assigned_rows_and_checks_its_settings() -> None:
    layout = Layout(d=2)
    proto = Metrics(over=DP(), reduce={"tok": "sum", "kl": "token_mean"}, tokens="tok")
    assignments = [((0, 3),), ()]
    results = [RankResult(rank=0, worker=0, value={"m": 2.0, "kl": 0.5, "tok": 7.0}),
               RankResult(rank=1, worker=1, value={"m": 0.0, "kl": 0.0, "tok": 0.0})]
    assert proto.collect(results, layout, assignments) == {"m": 2.0, "kl": 0.5, "tok": 7.0}
    with pytest.raises(ConfigError, match="tokens=KEY"):
        Metrics(reduce={"kl": "token_mean"})
    with pytest.raises(ConfigError, match=r"Metrics.default must be one of"):
        Metrics(default="median")  # type: ignore[arg-type]


def test_counting_ranks_count_each_row_once() -> None:
    assert DP().counting_ranks(Layout(d=2, t=2)) == [True, False, True, False]
    assert DP().counting_ranks(Layout(t=2)) is None  # one replica holds every row
    assert Metrics(over=DP()).counting_ranks(Layout(d=2)) == [True, True]
    assert OneToAll().counting_ranks(Layout(d=2)) is None
    assert RankZero().counting_ranks(Layout(d=2)) is None


def test_objectives_validate_and_name_their_loss_agg() -> None:
    assert PolicyLoss(loss_agg="seq-mean-token-sum").loss_agg is LossAggregation.SEQ_MEAN_TOKEN_SUM  # type: ignore[arg-type]
    assert PolicyLoss().loss_agg is None and ValueLoss().loss_agg is None and NLLLoss().loss_agg is None
    with pytest.raises(ConfigError, match=r"ValueLoss.loss_agg must be one of 'token-mean'"):
        ValueLoss(loss_agg="mean")  # type: ignore[arg-type]


def test_the_objectives_loss_agg_overrides_the_engines_setting() -> None:
    rows = make_batch(4)
    seq = LossAggregation.SEQ_MEAN_TOKEN_MEAN

    def step(config: dict[str, object], loss: PolicyLoss) -> dict[str, float]:
        engine = TrainingEngine(tiny_lm(layers=1, hidden=32), config=TrainingConfig(lr=1e-3, **config), loss=loss)  # type: ignore[arg-type]
        return engine.train_step(rows)

    by_config = step({"loss_aggregation": seq}, PolicyLoss())
    by_loss = step({}, PolicyLoss(loss_agg=seq))
    token_mean = step({"loss_aggregation": seq}, PolicyLoss(loss_agg=LossAggregation.TOKEN_MEAN))
    assert by_loss == pytest.approx(by_config, rel=1e-9)
    assert token_mean["loss"] != pytest.approx(by_config["loss"], rel=1e-3)
