"""A rule RewardWorker on real Ray workers (2 data-parallel ranks, CPU): a weighted
pair of keyword-form (TRL-style) functions over rows with extra columns."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from workers.models import CharTokenizer
from workers.rewards import RuleRewardConfig, text_column
from workers.roles import RewardWorker, ScoreConfig, score_summary

# The reward function below lives in this file, which workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

POOL = ResourcePool(name="rw", devices=2)
TOK = CharTokenizer()


def by_difficulty(prompts, completions, difficulty, solution, **columns):
    """The row's ``difficulty`` when the completion is the ``solution`` text's last word."""
    return [d * (c.strip() == s.split()[-1]) for c, d, s in zip(completions, difficulty, solution, strict=True)]


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    tokenizer_dir = str(TOK.save_pretrained(tmp_path_factory.mktemp("tok")))
    session = af.Session()
    rule = RuleRewardConfig(tokenizer_dir=tokenizer_dir, fn=[by_difficulty, "workers.rewards:exact_match"],
                            weights=[0.5, 2.0])
    roles = loop_thread.run(_start(session, rule))
    yield loop_thread, session, roles
    loop_thread.run(session.close())


async def _start(session: af.Session, rule: RuleRewardConfig) -> af.Roles:
    await session.__aenter__()
    return await session.spawn({"reward": RoleSpec(cls=RewardWorker, pool=POOL, config=ScoreConfig(scorer=rule))})


def _rows() -> dict[str, torch.Tensor]:
    prompts, completions, answers = ["1+2=", "2+2=", "3*3=", "9-1="], ["3", "5", "9", "8"], ["3", "4", "9", "8"]
    pad, eos = TOK.pad_token_id, TOK.eos_token_id
    p = [TOK.encode(x) for x in prompts]
    r = [[*TOK.encode(x, add_bos=False), eos] for x in completions]
    return {
        "prompt_ids": torch.tensor([[pad] * (5 - len(x)) + x for x in p]),
        "prompt_mask": torch.tensor([[0] * (5 - len(x)) + [1] * len(x) for x in p]),
        "response_ids": torch.tensor([x + [pad] * (3 - len(x)) for x in r]),
        "response_mask": torch.tensor([[1] * len(x) + [0] * (3 - len(x)) for x in r]),
        "answer_ids": torch.tensor([TOK.encode(a, add_bos=False) for a in answers]),
        "uid": torch.arange(4),
        "difficulty": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "solution": text_column(["one plus two is 3", "two plus two is 4", "three times three is 9", "eight"]),
    }


def test_a_weighted_pair_of_keyword_functions_reads_the_rows_columns(env) -> None:
    lt, session, roles = env

    async def main():
        src = await session.put(_rows(), pool=POOL)
        scores = roles.reward.score(src)
        return await scores.fetch(), score_summary(await roles.reward.stats(scores))

    rows, stats = lt.run(main())
    mine = [1.0, 0.0, 3.0, 0.0]  # difficulty where the completion is the solution's last word
    exact = [1.0, 0.0, 1.0, 1.0]
    assert rows["scores/by_difficulty"].tolist() == mine
    assert rows["scores/exact_match"].tolist() == exact
    assert rows["scores"].tolist() == [0.5 * m + 2.0 * e for m, e in zip(mine, exact, strict=True)]
    assert stats["reward/by_difficulty/mean"] == pytest.approx(1.0)  # over both ranks' rows
    assert stats["reward/exact_match/mean"] == pytest.approx(0.75)
    assert stats["reward/mean"] == pytest.approx((2.5 + 0 + 3.5 + 2.0) / 4)
