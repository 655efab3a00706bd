"""A worker process killed while ``rollout.load_weights(actor.weights())`` pulls the
actor's weights, on real Ray workers (CPU): the call ends in a
:class:`~asyncflow.WorkerDiedError` naming the process that died (the rollout rank
itself, or the actor rank it pulled from) within seconds, never a hang; and the
death breaks only the dead worker's pool.

Every case gets a fresh session (a killed worker breaks its pool for good). The pull
is held in flight deterministically: the rollout rank is stopped (``SIGSTOP``)
before the call, so it reads nothing and the actor ranks' sends of ~100 MB each
block part-way; one process is then killed, and the rollout rank let go again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from channels import Layout
from support import Consumer, LoopThread, Producer
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, save_tiny_model
from workers.roles import (
    WEIGHTS_VERSION,
    ActorConfig,
    ActorWorker,
    RolloutWorker,
    RolloutWorkerConfig,
)

# ~50 M parameters (200 MB in float32): each actor rank sends ~100 MB, far more than
# a socket's buffers hold, so a send to a stopped receiver stays in flight.
MODEL = TinyModelConfig(hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                        num_key_value_heads=8, head_dim=128, num_hidden_layers=3)
POLICY = ResourcePool(name="policy", devices=2)
GEN = ResourcePool(name="gen", devices=1)
PROD = ResourcePool(name="prod", devices=1)
CONS = ResourcePool(name="cons", devices=1)
HOLD_S = 2.0
"""How long the stopped rollout rank holds the call before the kill: ample for the
actor ranks to slice their rows and start sending (milliseconds when idle)."""
DEADLINE_S = 60.0
"""The error must come this soon after the kill (a hang fails here)."""
HANG_GUARD_S = 240.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), MODEL, seed=0))


@pytest.fixture
def env(loop_thread: LoopThread, shared_ray: None, model_dir: str) -> Iterator[tuple[LoopThread, Any, Any]]:
    session = af.Session()

    async def start() -> Any:
        await session.__aenter__()
        return await session.spawn({
            "actor": RoleSpec(cls=ActorWorker, pool=POLICY, layout=Layout(t=2), config=ActorConfig(
                model_dir=model_dir, training=TrainingConfig(lr=1e-2))),
            "rollout": RoleSpec(cls=RolloutWorker, pool=GEN, config=RolloutWorkerConfig(model_dir=model_dir)),
            "producer": RoleSpec(cls=Producer, pool=PROD),
            "consumer": RoleSpec(cls=Consumer, pool=CONS),
        })

    roles = loop_thread.run(start(), timeout=300)
    yield loop_thread, session, roles
    loop_thread.run(session.close(), timeout=HANG_GUARD_S)


def _guarded(lt: LoopThread, coro: Any) -> Any:
    return lt.run(asyncio.wait_for(coro, HANG_GUARD_S), timeout=HANG_GUARD_S + 30)


async def _pid(session: af.Session, pool: str, rank: int) -> int:
    pid, *_ = await session.worker(pool, rank).identity.remote()
    return int(pid)


async def _kill_mid_pull(session: af.Session, roles: Any, pool: str, rank: int
                         ) -> tuple[af.WorkerDiedError, float, Any]:
    """Kill rank ``rank`` of ``pool`` while the rollout rank pulls the actor's
    weights; returns the call's error, the seconds from the kill to it, and the
    weights future."""
    weights = roles.actor.weights()
    await weights
    receiver = await _pid(session, GEN.name, 0)
    victim = await _pid(session, pool, rank)
    os.kill(receiver, signal.SIGSTOP)
    try:
        pull = roles.rollout.load_weights(weights)
        await asyncio.sleep(HOLD_S)
        assert not pull.done(), "the stopped rollout rank finished its pull"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(receiver, signal.SIGCONT)
    with pytest.raises(af.WorkerDiedError) as info:
        await asyncio.wait_for(pull, DEADLINE_S)
    return info.value, time.monotonic() - killed_at, weights


def test_a_rollout_rank_killed_mid_pull_is_named(env) -> None:
    lt, session, roles = env

    async def main():
        err, elapsed, weights = await _kill_mid_pull(session, roles, GEN.name, 0)
        with pytest.raises(af.PoolBrokenError, match=r"pool 'gen' lost rank 0"):
            await asyncio.wait_for(roles.rollout.load_weights(weights), DEADLINE_S)
        return err, elapsed

    err, elapsed = _guarded(lt, main())
    assert (err.pool, err.rank, err.role, err.method) == ("gen", 0, "rollout", "load_weights")
    assert "\n" not in str(err) and "died" in str(err)
    assert elapsed < DEADLINE_S


def test_an_actor_rank_killed_while_the_rollout_pulls_from_it_is_named(env) -> None:
    lt, session, roles = env

    async def main():
        err, elapsed, _ = await _kill_mid_pull(session, roles, POLICY.name, 1)
        return err, elapsed

    err, elapsed = _guarded(lt, main())
    # The producer's death, not the consumer's: the rollout rank only waited on it.
    assert (err.pool, err.rank, err.role, err.method) == ("policy", 1, "actor", "weights"), str(err)
    assert "rollout.load_weights" in err.cause
    assert elapsed < DEADLINE_S


def test_a_rollout_rank_killed_mid_pull_breaks_only_its_own_pool(env) -> None:
    lt, session, roles = env

    async def main():
        await _kill_mid_pull(session, roles, GEN.name, 0)
        # Anything the death would still do to other processes happens within
        # moments (Ray's direct transport, which rows no longer take on the CPU,
        # killed both ends of a failed transfer a second later); give it time to.
        await asyncio.sleep(5.0)
        weights = await asyncio.wait_for(roles.actor.weights().fetch(), DEADLINE_S)
        src = await session.put({"idx": torch.arange(8)}, pool=PROD)
        echoed = await asyncio.wait_for(roles.consumer.echo(roles.producer.produce(src, width=1024)).fetch(),
                                        DEADLINE_S)
        return weights, echoed

    weights, echoed = _guarded(lt, main())
    assert weights[WEIGHTS_VERSION].tolist() == [0, 0]  # both actor ranks still serve
    assert echoed["idx"].tolist() == list(range(8))  # other pools still move rows
