"""Streaming on real Ray workers: the actor's ``generate`` streamed into inference
calls on another pool and on its own pool, long-tail migration between its ranks,
identical collected batches, and a worker killed mid-stream.

The vLLM case is in ``test_streaming_vllm_on_cpu.py``."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions, collect, merge
from support import Scorer, Ticker, value_of_length
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model
from workers.roles import ActorConfig, ActorWorker
from workers.rollout import NativeRolloutConfig, SamplingParams

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
GEN = ResourcePool(name="gen", devices=2)
INF = ResourcePool(name="inf", devices=1)
TOY = ResourcePool(name="toy", devices=2)
HANG_GUARD_S = 120
PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
LONG = SamplingParams(max_new_tokens=64, temperature=1.0, seed=11, ignore_eos=True)
"""Long enough that the driver's handoff reaches the ranks while they still generate."""


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model = str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))
    session = af.Session(collective_timeout_s=120)
    roles = loop_thread.run(_start(session, {
        "actor": RoleSpec(cls=ActorWorker, pool=GEN, config=ActorConfig(model_dir=model)),
        # Two sequences per decode batch: generation lasts long enough to migrate.
        "slow_actor": RoleSpec(cls=ActorWorker, pool=GEN, config=ActorConfig(
            model_dir=model, rollout=NativeRolloutConfig(max_batch_size=2))),
        "scorer": RoleSpec(cls=Scorer, pool=GEN),
        "remote_scorer": RoleSpec(cls=Scorer, pool=INF),
        "ticker": RoleSpec(cls=Ticker, pool=TOY),
        "toy_scorer": RoleSpec(cls=Scorer, pool=TOY),  # rank-local on the ticker's pool
    }), timeout=300)
    tok = CharTokenizer.from_pretrained(model)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=48, eval_size=2)).train)
    yield loop_thread, session, roles, prompt_batch(problems[:24], tok)
    loop_thread.run(session.close(), timeout=HANG_GUARD_S)


async def _start(session: af.Session, specs):
    await session.__aenter__()
    return await session.spawn(specs)


def _guarded(lt, coro):
    return lt.run(asyncio.wait_for(coro, HANG_GUARD_S), timeout=HANG_GUARD_S + 30)


def _same(a, b, keys=None) -> None:
    for k in keys or sorted(a):
        assert torch.equal(a[k], b[k]), k


def test_streamed_generate_equals_batch_and_feeds_another_pool(env) -> None:
    lt, session, roles, prompts = env

    async def main():
        src = await session.put(prompts, pool=GEN)
        whole = await roles.actor.generate(src, n=4, params=PARAMS).fetch()
        rollout = roles.actor.generate(src, n=4, params=PARAMS, stream=StreamOptions(micro_batch=8))
        scored = roles.remote_scorer.score(rollout.map(value_of_length))
        sizes = [(await f).num_rows async for f in rollout]
        merged = await collect(merge(rollout.map(value_of_length), scored)).fetch()
        return whole, merged, sizes

    whole, merged, sizes = _guarded(lt, main())
    _same(whole, merged, sorted(whole))
    assert torch.equal(merged["score"], 2 * whole["response_mask"].sum(1).double())
    assert len(sizes) > 2 and sum(sizes) == whole["response_ids"].shape[0]
    assert all(s % 4 == 0 for s in sizes)  # whole groups of n samples


def test_migration_gives_the_same_rows_and_frees_a_rank_for_rank_local_calls(env) -> None:
    lt, session, roles, _ = env

    async def main():
        steps = torch.tensor([1, 2, 1, 3, 2, 40, 1, 2, 2, 1, 3, 30])
        src = await session.put({"idx": torch.arange(12), "steps": steps}, pool=TOY)
        baseline = await roles.ticker.tick(src).fetch()
        stream = roles.ticker.tick(src, delay=0.05, stream=StreamOptions(micro_batch=1, migrate=2, targets=1))
        scored = roles.toy_scorer.score(stream)  # same pool, rank-local: runs on the freed rank
        arrived = []  # each micro-batch, with when the driver saw it (monotonic: the workers' clock too)
        async for fut in stream:
            await fut
            arrived.append((fut, time.monotonic()))
        when = {}
        for fut, t in arrived:
            for i in (await fut.fetch())["idx"].tolist():
                when[i] = t
        return baseline, await collect(merge(stream, scored)).fetch(), when

    baseline, migrated, when = _guarded(lt, main())
    _same(baseline, migrated, ["idx", "steps", "value"])
    assert sorted(when) == list(range(12))
    tail_rank = migrated["done_by"][5].item()
    assert migrated["done_by"][11] == tail_rank  # both long rows ended on one rank
    # The other rank, given back by the stream, scored rows while the tail still
    # ran: before the 30-step row came out, 10 steps (0.5 s) ahead of the 40-step one.
    assert when[11] < when[5]
    freed = migrated["scored_by"] != tail_rank
    assert bool((freed & (migrated["scored_at"] < when[11])).any()), (migrated["scored_by"], migrated["scored_at"], when)


def test_actor_tail_migrates_between_ranks_with_identical_rows(env) -> None:
    lt, session, roles, prompts = env

    async def main():
        src = await session.put(prompts, pool=GEN)
        whole = await roles.slow_actor.generate(src, n=4, params=LONG).fetch()
        # 96 samples, 48 a rank. At 40 left, neither rank can have finished unless
        # the other did at most 8 while it did 48: the tail migrates whatever else
        # runs on the machine.
        opts = StreamOptions(micro_batch=4, migrate=40, targets=1)
        rollout = roles.slow_actor.generate(src, n=4, params=LONG, stream=opts)
        scored = roles.scorer.score(rollout.map(value_of_length))  # rank-local on the actor's pool
        merged = await collect(merge(rollout.map(value_of_length), scored)).fetch()
        return whole, merged, await rollout.report()

    whole, merged, report = _guarded(lt, main())
    assert report.migrated > 0 and report.targets and report.threshold == 40, report
    for k in ("response_ids", "response_mask", "prompt_ids"):
        assert torch.equal(whole[k], merged[k]), k
    # Re-prefilled samples' log-probs differ from decoded ones by float rounding only.
    torch.testing.assert_close(whole["rollout_logprobs"], merged["rollout_logprobs"], atol=1e-5, rtol=0)


def test_a_worker_killed_mid_stream_ends_its_consumers_with_the_producers_error(env) -> None:
    lt, session, roles, _ = env

    async def main():
        steps = torch.tensor([1, 200] * 4)
        src = await session.put({"idx": torch.arange(8), "steps": steps}, pool=TOY)
        stream = roles.ticker.tick(src, delay=0.05, stream=StreamOptions(micro_batch=1))
        scored = roles.remote_scorer.score(stream)
        async for _ in stream:  # the first micro-batch is out: generation goes on
            break
        victim = session.worker("toy", 1)
        ray.kill(victim)
        with pytest.raises(af.WorkerDiedError) as err:
            await collect(stream)
        with pytest.raises(af.WorkerDiedError):
            await collect(scored)
        return err.value

    err = _guarded(lt, main())
    assert (err.role, err.method, err.pool) == ("ticker", "tick", "toy")
