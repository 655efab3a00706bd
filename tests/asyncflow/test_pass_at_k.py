"""pass@k of sampled held-out responses: the unbiased estimator, checked by hand
and against brute force over every k-subset."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from asyncflow.train._metrics import pass_at_k


def test_pass_at_k_by_hand() -> None:
    uid = torch.tensor([7, 7, 7, 7, 9, 9, 9, 9])
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = pass_at_k(uid, scores, n=4, threshold=1.0)
    assert out == pytest.approx({"eval/mean@4": 0.125, "eval/pass@1": 0.125, "eval/pass@2": 0.25,
                                 "eval/pass@4": 0.5})


def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_response() -> None:
    rng = random.Random(0)
    n, prompts = 8, 5
    uid = torch.tensor([u for u in range(prompts) for _ in range(n)])
    scores = torch.tensor([rng.choice([0.0, 0.5, 1.0]) for _ in range(n * prompts)])
    out = pass_at_k(uid, scores, n=n, threshold=0.5)
    for k in (1, 2, 4, 8):
        brute = 0.0
        for p in range(prompts):
            hits = [s >= 0.5 for s in scores[p * n:(p + 1) * n].tolist()]
            subsets = list(itertools.combinations(hits, k))
            brute += sum(any(s) for s in subsets) / len(subsets)
        assert out[f"eval/pass@{k}"] == pytest.approx(brute / prompts)


def test_pass_at_k_refuses_uneven_groups() -> None:
    with pytest.raises(ValueError, match="every prompt needs 2"):
        pass_at_k(torch.tensor([1, 1, 2]), torch.tensor([1.0, 0.0, 1.0]), n=2, threshold=1.0)
