"""A rollout role on its own pool takes the actor's weights as a data future, on real
Ray workers: after an update of a tensor-parallel actor (t = 2), ``rollout.load_weights(
actor.weights())`` makes the rollout's greedy samples the actor's, and the future holds
each byte of the model once."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import prompt_columns
from rollout_testlib import (
    GREEDY,
    MODEL,
    POLICY,
    actor_and_rollout,
    alternating_advantages,
    updated_and_planned,
)

import asyncflow as af
from asyncflow import ResourcePool
from workers.models import load_model, save_tiny_model
from workers.roles import WEIGHTS_VERSION

GEN = ResourcePool(name="gen", devices=1)


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("policy"), MODEL, seed=0))
    with actor_and_rollout(loop_thread, model_dir, gen=GEN) as (session, roles):
        yield loop_thread, session, roles, model_dir


def test_the_rollout_role_samples_what_the_actor_samples_after_loading_its_weights(env) -> None:
    lt, session, roles, model_dir = env

    async def main():
        src = await session.put(prompt_columns(), pool=POLICY)
        rows = roles.actor.generate(src, n=2)
        await roles.actor.update(rows.map(alternating_advantages))
        before = await roles.rollout.generate(src, params=GREEDY).fetch()
        weights = roles.actor.weights()
        versions = await roles.rollout.load_weights(weights)
        after = await roles.rollout.generate(src, params=GREEDY).fetch()
        actor = await roles.actor.generate(src, params=GREEDY).fetch()
        return before, versions, after, actor, await weights.fetch()

    before, versions, after, actor, weights = lt.run(main())
    assert versions == [1]  # one optimizer step
    assert torch.equal(after["response_ids"], actor["response_ids"])
    assert not torch.equal(before["response_ids"], actor["response_ids"])  # the load changed the policy
    # One row per tensor-parallel rank; together they hold each byte of the model
    # once, plus one padding row of each whole 19-row parameter (the vocabulary).
    assert weights[WEIGHTS_VERSION].tolist() == [1, 1]
    params = dict(load_model(model_dir).named_parameters())
    assert set(weights) == {*params, WEIGHTS_VERSION}
    assert {col.shape[0] for col in weights.values()} == {2}
    padding = sum(p[0].nbytes for p in params.values() if p.shape[0] % 2)
    assert sum(weights[n].nbytes for n in params) == sum(p.nbytes for p in params.values()) + padding


def test_rows_that_are_not_weights_are_refused(env) -> None:
    lt, session, roles, _ = env

    async def main():
        src = await session.put(prompt_columns(), pool=POLICY)
        await roles.rollout.load_weights(src)

    with pytest.raises(af.RemoteStageError, match=r"ConfigError: rollout\.load_weights needs the rows of actor\.weights"):
        lt.run(main())


def test_bucketed_loads_give_the_actors_samples_and_generate_waits_for_the_last_bucket(env) -> None:
    """``WeightSync`` with small buckets: several ``load_weights`` calls, each a
    selection of one weights future; between them the rollout refuses to generate
    on weights loaded in part, and after the last it samples what the actor does."""
    lt, session, roles, _ = env

    async def main():
        src, sync = await updated_and_planned(session, roles)
        assert sync.buckets is not None
        weights = roles.actor.weights()
        await roles.rollout.load_weights(weights.select((*sync.buckets[0], WEIGHTS_VERSION)))
        with pytest.raises(af.RemoteStageError, match=r"weights of version \d+ are loaded in part \(\d+ of \d+"):
            await roles.rollout.generate(src, params=GREEDY)
        version = await sync.sync()
        after = await roles.rollout.generate(src, params=GREEDY).fetch()
        actor = await roles.actor.generate(src, params=GREEDY).fetch()
        meta = await weights
        return sync.buckets, version, after, actor, meta

    buckets, version, after, actor, meta = lt.run(main())
    assert len(buckets) > 2
    names = [n for bucket in buckets for n in bucket]
    assert sorted(names) == sorted(f.name for f in meta.fields if f.name != WEIGHTS_VERSION)  # each once
    sizes = [sum(meta.field(n).row_bytes() * meta.num_rows for n in bucket) for bucket in buckets]
    assert all(s <= 16 << 10 for s, b in zip(sizes, buckets, strict=True) if len(b) > 1)
    assert version == 2  # the module's second optimizer step
    assert torch.equal(after["response_ids"], actor["response_ids"])
