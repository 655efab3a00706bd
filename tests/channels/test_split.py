"""Splitting rows over ranks: the even split, and the token-balanced one that keeps
rows where the even split puts them unless moving them evens the loads out."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels import DP, BatchMeta, ConfigError, Layout, MicroDP, RowRuns, runs_length, split_rows


def _loads(split: Sequence[RowRuns | None], weights: list[int]) -> list[int]:
    return [sum(weights[i] for a, b in runs or () for i in range(a, b)) for runs in split]


def _rows(runs: RowRuns) -> set[int]:
    return {i for a, b in runs for i in range(a, b)}


@settings(max_examples=120, deadline=None)
@given(groups=st.integers(1, 30), gs=st.integers(1, 4), parts=st.integers(1, 6), data=st.data())
def test_balanced_split_keeps_groups_and_counts_and_evens_the_loads(groups: int, gs: int, parts: int,
                                                                    data: st.DataObject) -> None:
    n = groups * gs
    weights = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    out = split_rows(n, parts, group_size=gs, weights=weights)
    assert sorted(i for runs in out for i in _rows(runs)) == list(range(n))  # every row exactly once
    assert [runs_length(r) for r in out] == [runs_length(r) for r in split_rows(n, parts, group_size=gs)]
    for runs in out:  # groups whole
        assert all(a % gs == 0 and b % gs == 0 for a, b in runs)
    loads, even = _loads(out, weights), _loads(split_rows(n, parts, group_size=gs), weights)
    heaviest_group = max(sum(weights[g * gs:(g + 1) * gs]) for g in range(groups))
    assert max(loads) <= max(even)  # never worse than the even split
    assert max(loads) - min(loads) <= heaviest_group


def test_balanced_split_beats_contiguous_on_skewed_lengths() -> None:
    weights = [100] * 8 + [1] * 8
    assert _loads(split_rows(16, 2), weights) == [800, 8]
    assert _loads(split_rows(16, 2, weights=weights), weights) == [404, 404]


def test_equal_lengths_keep_the_even_split() -> None:
    # a data-parallel producer's rows stay on the rank that made them: nothing to pull
    for n, parts, gs in ((64, 2, 4), (24, 3, 1), (10, 4, 2)):
        assert split_rows(n, parts, group_size=gs, weights=[32] * n) == split_rows(n, parts, group_size=gs)


def test_balanced_split_moves_only_the_groups_that_even_the_loads() -> None:
    weights = [4, 4, 1, 1, 1, 1, 1, 1]  # even loads 10 and 4: one swap of a 4 for a 1 makes 7 and 7
    out = split_rows(8, 2, weights=weights)
    assert _loads(out, weights) == [7, 7]
    assert len(_rows(out[0]) - set(range(4))) == 1 and len(_rows(out[1]) - set(range(4, 8))) == 1
    # already within one group's weight of even: the even split stays
    assert split_rows(8, 2, weights=[3, 3, 3, 3, 3, 3, 3, 9]) == split_rows(8, 2)


def test_long_tailed_groups_of_samples_balance_over_two_ranks() -> None:
    # bench.async_rl's batch: 8 prompts x 4 samples, budgets up to 144 tokens
    weights = [b for b in (13, 7, 36, 12, 3, 20, 144, 69) for _ in range(4)]
    assert _loads(split_rows(32, 2, group_size=4), weights) == [272, 944]
    out = split_rows(32, 2, group_size=4, weights=weights)
    assert sorted(_loads(out, weights)) == [552, 664]


def test_token_balance_needs_row_lengths_and_splits_like_split_rows() -> None:
    meta = BatchMeta(num_rows=8)
    lengths = [100] * 4 + [1] * 4
    layout = Layout(d=2)
    assert DP(balance="tokens").distribute(meta, layout, lengths) == split_rows(8, 2, weights=lengths)
    assert _loads(DP(balance="tokens").distribute(meta, layout, lengths), lengths) == [202, 202]
    assert MicroDP(balance="tokens").distribute(meta, layout, lengths) == split_rows(8, 2, weights=lengths)
    assert DP().distribute(meta, layout, lengths) == [((0, 4),), ((4, 8),)]
    with pytest.raises(ConfigError, match="row_lengths=FIELD"):
        DP(balance="tokens").distribute(meta, layout, None)
    with pytest.raises(ConfigError, match="'rows' or 'tokens'"):
        DP(balance="bytes")  # type: ignore[arg-type]
