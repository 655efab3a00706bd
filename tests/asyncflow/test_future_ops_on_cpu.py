"""Selections on data futures with real Ray workers: rows filtered by group on one
pool, taken on another, concatenated and consumed; the consumer pulls exactly
those rows, in order, and the shards go once no future names them."""

from __future__ import annotations

import gc

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, concat, merge
from support import Consumer, Producer, expected_x

A = ResourcePool(name="a", devices=2)
B = ResourcePool(name="b", devices=2)
W = 4


@pytest.fixture(scope="module")
def env(loop_thread, shared_ray):
    session = af.Session()
    roles = loop_thread.run(_start(session))
    yield loop_thread, session, roles
    loop_thread.run(session.close())


async def _start(session: af.Session) -> af.Roles:
    await session.__aenter__()
    return await session.spawn({
        "producer_a": RoleSpec(cls=Producer, pool=A),
        "producer_b": RoleSpec(cls=Producer, pool=B),
        "consumer": RoleSpec(cls=Consumer, pool=B),
    })


def _varied(r: torch.Tensor) -> torch.Tensor:
    return r.amax(dim=1) > r.amin(dim=1)


def _shards(stats) -> dict[str, int]:
    out: dict[str, int] = {}
    for pool, _, s in stats:
        out[pool] = out.get(pool, 0) + s.shards
    return out


def test_filtered_taken_and_concatenated_rows_reach_a_consumer_and_are_freed(env) -> None:
    lt, session, roles = env

    async def main():
        src_a = await session.put({"idx": torch.arange(16)}, pool=A, group_size=4)
        src_b = await session.put({"idx": torch.arange(100, 108)}, pool=B, group_size=4)
        rewards = await session.put({"reward": torch.tensor([[1.0] * 4, [0, 1, 0, 0], [2.0] * 4, [3, 0, 1, 1]]
                                                            ).flatten()}, pool=A, group_size=4)
        made_a = roles.producer_a.produce(src_a, width=W)
        made_b = roles.producer_b.produce(src_b, width=W)
        kept = merge(made_a, rewards).filter("reward", _varied, by_group=True)  # groups 1 and 3
        # produce's rows have no groups of their own: the merge with its prompts gives them back
        grouped_b = merge(made_b, src_b.rename(idx="prompt"))
        batch = concat(kept.select(["idx", "x"]), grouped_b.take(1, groups=True).select(["idx", "x"]))
        names = (await batch).shard_keys()
        echoed = await roles.consumer.echo(batch).fetch()
        one = await roles.consumer.echo(made_b[5:6]).fetch()
        del src_a, src_b, rewards, made_a, made_b, kept, grouped_b
        gc.collect()
        while_named = _shards(await session.store_stats())
        del batch
        gc.collect()
        return names, echoed, one, while_named, _shards(await session.store_stats())

    names, echoed, one, while_named, after = lt.run(main(), timeout=120)
    assert echoed["idx"].tolist() == [*range(4, 8), *range(12, 16), *range(100, 104)]
    assert torch.equal(echoed["x"], expected_x(echoed["idx"], W).float())
    assert echoed["rank"].tolist() == [0] * 8 + [1] * 4  # whole groups per consumer rank
    assert one["idx"].tolist() == [105] and one["rank"].tolist() == [0]  # rank 1 had no row
    # Only the produced shards the batch names are left: one per producer rank of
    # pool a (rows 4-7 and 12-15), one of pool b (rows 100-103).
    assert len(names) == 3 and while_named == {"a": 2, "b": 1}
    assert after == {"a": 0, "b": 0}
