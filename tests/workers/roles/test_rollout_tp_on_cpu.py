"""A rollout role with its own generation layout, on real Ray workers and gloo: a
tensor-parallel rollout (t = 2, its own 2-rank pool) takes a tensor-parallel actor's
(t = 2) weights with ``WeightSync``; each rollout rank pulls only the rows of its
shards of the split parameters (bytes measured by the runtime's tracing), generates
tensor parallel and samples the actor's greedy tokens; streamed, its two ranks
report each row once."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import prompt_columns
from rollout_testlib import (
    GREEDY,
    MODEL,
    POLICY,
    actor_and_rollout,
    updated_and_planned,
)

import asyncflow as af
from asyncflow import ResourcePool
from channels import Layout
from workers.models import load_model, save_tiny_model
from workers.roles import WEIGHTS_VERSION, RolloutWorker, RolloutWorkerConfig
from workers.rollout import VLLMRolloutConfig

GEN = ResourcePool(name="gen", devices=2)
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("policy"), MODEL, seed=0))
    with actor_and_rollout(loop_thread, model_dir, gen=GEN, rollout_layout=Layout(t=2)) as (session, roles):
        yield loop_thread, session, roles, model_dir


def test_each_rollout_rank_pulls_its_shards_and_samples_the_actors_tokens(env) -> None:
    lt, session, roles, model_dir = env

    async def main():
        src, sync = await updated_and_planned(session, roles)
        await session.start_trace()
        version = await sync.sync()
        trace = session.stop_trace()
        after = await roles.rollout.generate(src, params=GREEDY).fetch()
        actor = await roles.actor.generate(src, params=GREEDY).fetch()
        return sync, version, trace, after, actor, await roles.actor.weights().fetch()

    sync, version, trace, after, actor, weights = lt.run(main())
    assert version == 1
    assert torch.equal(after["response_ids"], actor["response_ids"])

    params = dict(load_model(model_dir).named_parameters())
    split = {n for n in params if n.rsplit(".", 2)[-2] in SPLIT}
    assert split and {n for b, s in zip(sync.buckets or [], sync.sharded, strict=True) if s for n in b} == split
    # Per rollout rank: half of every split parameter (its own row of the actor's
    # two), and every row of the parameters it holds whole; each version column once
    # per call.
    version_bytes = weights[WEIGHTS_VERSION][:1].nbytes
    calls = [c for c in trace.calls if c.role == "rollout"]
    assert {c.method for c in calls} == {"load_weights", "load_weight_shards"}
    for rank in (0, 1):
        pulled = {m: sum(s.bytes_pulled for c in calls if c.method == m for s in c.ranks if s.rank == rank)
                  for m in ("load_weights", "load_weight_shards")}
        shards = sum(c.method == "load_weight_shards" for c in calls)
        wholes = len(calls) - shards
        assert pulled["load_weight_shards"] == sum(params[n].nbytes for n in split) // 2 + shards * version_bytes
        assert pulled["load_weights"] == (sum(weights[n].nbytes for n in params if n not in split)
                                          + wholes * 2 * version_bytes)


def test_a_streamed_tensor_parallel_generation_reports_each_row_once(env) -> None:
    lt, session, roles, _ = env

    async def main():
        src = await session.put(prompt_columns(), pool=POLICY)
        plain = await roles.rollout.generate(src, n=2, params=GREEDY).fetch()
        parts = [await f.fetch() async for f in roles.rollout.generate(src, n=2, params=GREEDY, stream=True)]
        return plain, parts

    plain, parts = lt.run(main())
    streamed = torch.cat([p["response_ids"] for p in parts])
    assert streamed.shape == plain["response_ids"].shape  # not twice the rows
    assert sorted(map(tuple, streamed.tolist())) == sorted(map(tuple, plain["response_ids"].tolist()))


def test_tensor_parallel_generation_with_vllm_is_refused(tmp_path) -> None:
    from workers import WorkerContext

    model_dir = str(save_tiny_model(tmp_path, MODEL, seed=0))
    ctx = WorkerContext(role="rollout", pool="gen", rank=0, world_size=2, global_rank=0, layout=Layout(t=2),
                        device=torch.device("cpu"), process_group=None, mesh=None)
    with pytest.raises(af.ConfigError, match=r"tensor-parallel generation .* needs the native rollout engine"):
        RolloutWorker(ctx, RolloutWorkerConfig(model_dir=model_dir, rollout=VLLMRolloutConfig()))
