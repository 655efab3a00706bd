"""Micro-batch planners and sequence assembly."""

from __future__ import annotations

import torch
from engines_testlib import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engines import (
    FixedSizeMicroBatches,
    TokenBalancedMicroBatches,
    WholeBatch,
    build_inputs,
)


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 40), min_size=1, max_size=20),
    max_tokens=st.integers(1, 100),
    peer_count=st.integers(0, 25),
)
def test_token_balanced_plan_covers_rows_once_and_respects_budget(
    tokens: list[int], max_tokens: int, peer_count: int
) -> None:
    counts = torch.tensor(tokens)
    plan = TokenBalancedMicroBatches(max_tokens=max_tokens).plan(counts, agree=lambda n: n)
    rows = sorted(r for micro in plan for r in micro.tolist())
    assert rows == list(range(len(tokens)))
    for micro in plan:
        load = int(counts[micro].sum())
        assert load <= max_tokens or micro.numel() == 1  # an over-long row rides alone
    assert len(plan) <= len(tokens)  # no empty micro-batches of our own

    # Agreeing on a larger count (a DP peer needs more) pads with balanced or empty bins.
    agreed = max(len(plan), peer_count)
    padded = TokenBalancedMicroBatches(max_tokens=max_tokens).plan(counts, agree=lambda n: agreed)
    assert len(padded) == agreed
    assert sorted(r for m in padded for r in m.tolist()) == list(range(len(tokens)))


def test_fixed_and_whole_batch_plans_pad_to_the_agreed_count() -> None:
    counts = torch.ones(5, dtype=torch.int64)
    plan = FixedSizeMicroBatches(size=2).plan(counts, agree=lambda n: 4)
    assert [m.tolist() for m in plan] == [[0, 1], [2, 3], [4], []]
    whole = WholeBatch().plan(counts, agree=lambda n: 2)
    assert [m.tolist() for m in whole] == [[0, 1, 2, 3, 4], []]


def test_balanced_plan_is_balanced() -> None:
    counts = torch.tensor([10, 9, 8, 7, 3, 2, 1])
    plan = TokenBalancedMicroBatches(max_tokens=20).plan(counts, agree=lambda n: n)
    loads = sorted(int(counts[m].sum()) for m in plan)
    assert loads == [20, 20]


def test_build_inputs_trims_padding_columns_and_counts_positions() -> None:
    batch = make_batch(rows=3, prompt=6, response=7)
    batch["prompt_mask"][:, :2] = 0  # the two leftmost prompt columns are padding everywhere
    batch["response_mask"][:, 5:] = 0
    inputs = build_inputs(batch)
    assert inputs.prompt_width == 4 and inputs.response_width == 5
    assert inputs.input_ids.shape == (3, 9)
    mask = inputs.attention_mask
    torch.testing.assert_close(inputs.position_ids, (mask.cumsum(1) - 1).clamp(min=0))
    torch.testing.assert_close(inputs.response_ids, batch["response_ids"][:, :5])
