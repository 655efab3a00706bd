"""Fault injection on real Ray workers (CPU): every failure ends in one error of the
right type naming pool, rank and method, and the driver returns.

One session serves the module; its pools are used in an order such that the
cases that kill a worker come last, each on a pool of its own. Each case records
its seconds-to-error; set ``ASYNCFLOW_FAULT_REPORT=path.json`` to keep them.
A generous ``wait_for`` only guards against hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import torch

import asyncflow as af
from asyncflow import Layout, ResourcePool, RoleSpec
from support import Collective, Consumer, Producer, Sleeper
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model
from workers.roles import ActorConfig, ActorWorker, CriticConfig, CriticWorker, UpdateConfig
from workers.rollout import NativeRolloutConfig, SamplingParams

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
GEN = ResourcePool(name="gen", devices=2)
TRAIN = ResourcePool(name="train", devices=4)
PROD = ResourcePool(name="prod", devices=2)
CONS = ResourcePool(name="cons", devices=2)
HANG_GUARD_S = 120
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model = str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))
    session = af.Session(collective_timeout_s=120)
    # One sequence per decode batch: 128 sequences per rank take seconds.
    slow_rollout = NativeRolloutConfig(max_batch_size=1)
    roles = loop_thread.run(_start(session, {
        "generator": RoleSpec(cls=ActorWorker, pool=GEN,
                              config=ActorConfig(model_dir=model, rollout=slow_rollout)),
        "actor": RoleSpec(cls=ActorWorker, pool=TRAIN, config=ActorConfig(model_dir=model)),
        "critic": RoleSpec(cls=CriticWorker, pool=TRAIN, config=CriticConfig(model_dir=model)),
        "producer": RoleSpec(cls=Producer, pool=PROD),
        "consumer": RoleSpec(cls=Consumer, pool=CONS),
        "collective": RoleSpec(cls=Collective, pool=CONS, layout=Layout(d=2)),
        "sleeper": RoleSpec(cls=Sleeper, pool=CONS),
    }), timeout=300)
    tok = CharTokenizer.from_pretrained(model)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=64, eval_size=2)).train)
    yield loop_thread, session, roles, tok, problems
    loop_thread.run(session.close(), timeout=HANG_GUARD_S)
    report = os.environ.get("ASYNCFLOW_FAULT_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(TIMINGS, f, indent=2)


async def _start(session: af.Session, specs):
    await session.__aenter__()
    return await session.spawn(specs)


async def _value(fut):
    return await fut


def _guarded(lt, coro):
    return lt.run(asyncio.wait_for(coro, HANG_GUARD_S), timeout=HANG_GUARD_S + 30)


async def _pid(session, pool, rank) -> int:
    pid, *_ = await session.worker(pool, rank).identity.remote()
    return pid


async def _rollout(session, roles, tok, problems, n_prompts: int, n: int, role: str = "actor",
                   tokens: int = 4):
    prompts = await session.put(prompt_batch(problems[:n_prompts], tok), pool=TRAIN)
    params = SamplingParams(max_new_tokens=tokens, seed=1)
    return getattr(roles, role).generate(prompts, n=n, params=params)


@af.transform(reads=("old_logprobs",), writes=("advantages",))
def _ones(batch):
    return {"advantages": torch.ones_like(batch["old_logprobs"])}


@af.transform(reads=("values",), writes=("returns",))
def _returns(batch):
    return {"returns": batch["values"] + 1.0}


# ----- no process dies -----

def test_a_rank_raising_inside_a_collective_fails_at_once_and_the_pool_heals(env) -> None:
    lt, _, roles, _, _ = env

    async def main():
        t0 = time.monotonic()
        with pytest.raises(af.RemoteStageError) as info:
            await roles.collective.reduce_unless(raise_on=1, seconds=1.0)
        elapsed = time.monotonic() - t0 - 1.0
        again = await roles.collective.reduce_unless()  # healed: both ranks reduce again
        return info.value, elapsed, again

    err, elapsed, again = _guarded(lt, main())
    TIMINGS["raise_in_collective_s"] = round(elapsed, 3)
    assert type(err) is af.RemoteStageError
    assert (err.pool, err.rank, err.role, err.method) == ("cons", 1, "collective", "reduce_unless")
    assert "gives up before the all-reduce" in str(err)
    assert elapsed < 30  # the peer was released by the poisoned group, not by the 120 s timeout
    assert again == [3.0, 3.0]


def test_a_slow_rank_does_not_fail(env) -> None:
    lt, _, roles, _, _ = env
    out = _guarded(lt, _value(roles.collective.reduce_unless(late=1, seconds=5.0)))
    assert out == [3.0, 3.0]


@pytest.mark.parametrize("n_prompts,n", [(1, 1), (3, 2)], ids=["1-row-on-dp4", "3-groups-on-dp4"])
def test_fewer_rows_or_groups_than_dp_ranks(env, n_prompts, n) -> None:
    lt, session, roles, tok, problems = env

    async def main():
        rollout = await _rollout(session, roles, tok, problems, n_prompts, n)
        old = roles.actor.log_prob(rollout)
        values = roles.critic.values(rollout)
        batch = af.merge(rollout, old, values).map(_ones).map(_returns)
        actor, critic = await af.gather(roles.actor.update(batch), roles.critic.update(batch))
        return (await rollout).num_rows, await old.fetch(), await values.fetch(), actor, critic

    rows, old, values, actor, critic = _guarded(lt, main())
    assert rows == n_prompts * n and old["old_logprobs"].shape[0] == rows and values["values"].shape[0] == rows
    assert torch.isfinite(old["old_logprobs"]).all() and torch.isfinite(values["values"]).all()
    assert actor["actor/steps"] == 1.0 and critic["critic/steps"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in (*actor.values(), *critic.values()))


def test_cancel_a_queued_call_with_dependents(env) -> None:
    lt, session, roles, _, _ = env

    async def main():
        src = await session.put({"idx": torch.arange(8)}, pool=PROD)
        blocker = roles.sleeper.work(1.0)
        first = roles.consumer.echo(roles.producer.produce(src, width=4))
        second = roles.consumer.total(first)
        first.cancel()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await second
        return first.cancelled(), second.cancelled()

    assert _guarded(lt, main()) == (True, True)


# ----- a process dies (each on a pool of its own) -----

def test_sigkill_during_generation(env) -> None:
    lt, session, roles, tok, problems = env

    async def main():
        pid = await _pid(session, "gen", 1)
        busy = await _rollout(session, roles, tok, problems, 64, 4, role="generator", tokens=200)
        await asyncio.sleep(0.5)
        assert not busy.done()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(af.WorkerDiedError) as info:
            await busy
        return info.value, time.monotonic() - t0

    err, elapsed = _guarded(lt, main())
    TIMINGS["sigkill_during_generation_s"] = round(elapsed, 3)
    assert (err.pool, err.rank, err.role, err.method) == ("gen", 1, "generator", "generate")
    assert "\n" not in str(err) and "died" in str(err)


def test_sigkill_during_an_update(env) -> None:
    lt, session, roles, tok, problems = env

    async def main():
        rollout = await _rollout(session, roles, tok, problems, 8, 2)
        batch = af.merge(rollout, roles.actor.log_prob(rollout)).map(_ones)
        await batch
        pid = await _pid(session, "train", 2)
        busy = roles.actor.update(batch, schedule=UpdateConfig(epochs=10_000, mini_batches=1))
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(af.WorkerDiedError) as info:
            await busy
        elapsed = time.monotonic() - t0
        with pytest.raises(af.PoolBrokenError) as later:
            await roles.critic.values(rollout)
        return info.value, elapsed, later.value

    err, elapsed, later = _guarded(lt, main())
    TIMINGS["sigkill_during_update_s"] = round(elapsed, 3)
    assert (err.pool, err.rank, err.role, err.method) == ("train", 2, "actor", "update")
    assert "lost rank 2" in str(later) and "\n" not in str(later)


def test_sigkill_of_a_producer_a_consumer_pulls_from(env) -> None:
    lt, session, roles, _, _ = env

    async def main():
        src = await session.put({"idx": torch.arange(16)}, pool=PROD)
        made = roles.producer.produce(src, width=1 << 14)
        await made
        pid = await _pid(session, "prod", 1)
        pull = roles.consumer.echo(made)  # queued behind the sleeper: pulls after the kill
        gate = roles.sleeper.work(0.5)
        del gate
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(af.WorkerDiedError) as info:
            await pull
        elapsed = time.monotonic() - t0
        still = await roles.sleeper.work(0.0)  # the consumer's pool is healthy
        return info.value, elapsed, still

    err, elapsed, still = _guarded(lt, main())
    TIMINGS["sigkill_of_producer_s"] = round(elapsed, 3)
    assert (err.pool, err.rank, err.role, err.method) == ("prod", 1, "producer", "produce")
    assert "consumer.echo" in err.cause
    assert len(still) == 2


def test_close_with_calls_queued_and_awaited(env) -> None:
    lt, session, roles, _, _ = env

    async def main():
        running = roles.sleeper.work(3.0)
        queued = roles.sleeper.work(0.1)
        waiter = asyncio.ensure_future(_value(queued))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await session.close()
        outcomes = []
        for fut in (running, waiter):
            try:
                await fut
            except af.SessionClosedError:
                outcomes.append("closed")
        return outcomes, time.monotonic() - t0

    outcomes, elapsed = _guarded(lt, main())
    TIMINGS["close_with_queued_calls_s"] = round(elapsed, 3)
    assert outcomes == ["closed", "closed"]
