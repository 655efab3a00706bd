"""Micro-batch planners and sequence assembly."""

from __future__ import annotations

import dataclasses
import itertools

import torch
from engines_testlib import make_batch, tiny_lm
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engines import (
    CausalLMHead,
    FixedSizeMicroBatches,
    TokenBudgetMicroBatches,
    WholeBatch,
    build_inputs,
)
from workers.engines._batch import row_lengths, select_rows


def _lengths(tokens: list[int]) -> torch.Tensor:
    """``[B, 2]`` lengths of rows whose prompts are all 2 tokens long."""
    return torch.tensor([[2, t - 2] for t in tokens])


def _width(lengths: torch.Tensor, micro: torch.Tensor) -> int:
    """What a micro-batch runs as: its rows times its widest prompt plus its longest response."""
    return micro.numel() * int(lengths[micro].max(dim=0).values.sum()) if micro.numel() else 0


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=20),
    max_tokens=st.integers(1, 100),
    peer_count=st.integers(0, 25),
)
def test_token_budget_plan_covers_rows_once_and_keeps_the_budget(
    lengths: list[tuple[int, int]], max_tokens: int, peer_count: int
) -> None:
    counts = torch.tensor(lengths)
    plan = TokenBudgetMicroBatches(max_tokens=max_tokens).plan(counts, agree=lambda n: n)
    assert sorted(r for micro in plan for r in micro.tolist()) == list(range(len(lengths)))
    for micro in plan:
        assert _width(counts, micro) <= max_tokens or micro.numel() == 1  # an over-wide row runs alone
    assert 1 <= len(plan) <= len(lengths) and all(m.numel() for m in plan)

    # The fewest micro-batches of any cut of the shortest-first order within the budget.
    order = torch.argsort(counts.sum(dim=1), stable=True)
    fewest = [0] + [len(lengths)] * len(lengths)  # fewest[i]: for the first i rows of the order
    for end in range(1, len(lengths) + 1):
        for begin in range(end):
            if end - begin == 1 or _width(counts, order[begin:end]) <= max_tokens:
                fewest[end] = min(fewest[end], fewest[begin] + 1)
    assert len(plan) == fewest[-1]

    # Agreeing on a larger count (a DP peer needs more) adds empty micro-batches.
    agreed = max(len(plan), peer_count)
    padded = TokenBudgetMicroBatches(max_tokens=max_tokens).plan(counts, agree=lambda n: agreed)
    assert len(padded) == agreed and [m.tolist() for m in padded[:len(plan)]] == [m.tolist() for m in plan]


def test_a_token_budget_counts_what_a_micro_batch_runs() -> None:
    # Rows whose prompts and responses are long in turn: each micro-batch of the plan
    # stays within the budget as build_inputs pads it.
    batch = make_batch(rows=12, prompt=9, response=9, seed=3)
    lengths = row_lengths(batch)
    plan = TokenBudgetMicroBatches(max_tokens=40).plan(lengths, agree=lambda n: n)
    assert len(plan) > 1
    for micro in plan:
        inputs = build_inputs(select_rows(batch, micro))
        assert inputs.input_ids.numel() <= 40 or micro.numel() == 1


def test_fixed_and_whole_batch_plans_pad_to_the_agreed_count() -> None:
    counts = _lengths([3] * 5)
    plan = FixedSizeMicroBatches(size=2).plan(counts, agree=lambda n: 4)
    assert [m.tolist() for m in plan] == [[0, 1], [2, 3], [4], []]
    whole = WholeBatch().plan(counts, agree=lambda n: 2)
    assert [m.tolist() for m in whole] == [[0, 1, 2, 3, 4], []]


def test_fixed_size_plan_puts_rows_of_similar_length_together() -> None:
    counts = _lengths([9, 3, 8, 4, 7, 5, 4])
    plan = FixedSizeMicroBatches(size=2).plan(counts, agree=lambda n: n)
    assert [m.tolist() for m in plan] == [[1, 3], [6, 5], [4, 2], [0]]  # shortest first, ties in row order


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(2, 200), min_size=1, max_size=6), size=st.integers(1, 4))
def test_fixed_size_plan_pads_least_of_any_split(tokens: list[int], size: int) -> None:
    counts = _lengths(tokens)
    plan = FixedSizeMicroBatches(size=size).plan(counts, agree=lambda n: n)
    assert sorted(r for m in plan for r in m.tolist()) == list(range(len(tokens)))
    assert sorted(m.numel() for m in plan) == sorted(len(c) for c in torch.arange(len(tokens)).split(size))
    # Every order of the rows cut into micro-batches of these sizes, row order among them.
    least = min(sum(_width(counts, torch.tensor(order[k:k + size])) for k in range(0, len(order), size))
                for order in itertools.permutations(range(len(tokens))))
    assert sum(_width(counts, m) for m in plan) == least


def test_token_budget_plan_groups_rows_of_similar_length() -> None:
    counts = _lengths([10, 9, 8, 7, 3, 2, 2])
    plan = TokenBudgetMicroBatches(max_tokens=20).plan(counts, agree=lambda n: n)
    # 3 x 3, 2 x 8 and 2 x 10 tokens as they run; balancing the real tokens over two
    # micro-batches of 20 would run 3 x 10 and 4 x 9.
    assert [m.tolist() for m in plan] == [[5, 6, 4], [3, 2], [1, 0]]


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
    assert not inputs.dense


def test_rows_without_padding_are_dense_and_a_hugging_face_model_gets_one_row_of_positions() -> None:
    batch = make_batch(rows=3, prompt=6, response=7)
    batch["prompt_mask"][:] = 1
    batch["response_mask"][:] = 1
    dense = build_inputs(batch)
    assert dense.dense and dense.position_ids.tolist() == [list(range(13))] * 3
    model = tiny_lm()
    seen: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(tuple(kwargs["position_ids"].shape)),
                                    with_kwargs=True)
    head = CausalLMHead()
    with torch.no_grad():
        got = head(model, dense, entropy_grad=False)
        each = head(model, dataclasses.replace(dense, dense=False), entropy_grad=False)
    assert seen == [(1, 13), (3, 13)]
    assert torch.equal(got.logprobs, each.logprobs) and torch.equal(got.entropy, each.entropy)
