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


def test_fixed_size_plan_puts_rows_of_similar_length_together() -> None:
    counts = torch.tensor([9, 1, 8, 2, 7, 3, 2])
    plan = FixedSizeMicroBatches(size=2).plan(counts, agree=lambda n: n)
    assert [m.tolist() for m in plan] == [[1, 3], [6, 5], [4, 2], [0]]  # shortest first, ties in row order


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(1, 200), min_size=1, max_size=40), size=st.integers(1, 9))
def test_fixed_size_plan_pads_no_more_than_row_order(tokens: list[int], size: int) -> None:
    # A micro-batch runs as wide as its longest row: the padded tokens it computes.
    counts = torch.tensor(tokens)

    def padded(plan: list[torch.Tensor]) -> int:
        return sum(m.numel() * int(counts[m].max()) for m in plan if m.numel())

    plan = FixedSizeMicroBatches(size=size).plan(counts, agree=lambda n: n)
    assert sorted(r for m in plan for r in m.tolist()) == list(range(len(tokens)))
    assert all(m.numel() <= size for m in plan) and len(plan) == -(-len(tokens) // size)
    assert padded(plan) <= padded(list(torch.arange(len(tokens)).split(size)))


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
