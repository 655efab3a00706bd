"""Asynchronous training's weight loads when a pull stalls, on real Ray workers: the
bucket's ``timeout_s`` fails the load naming the rollout rank and the actor rank
it pulls from, and :meth:`SamplesAhead.guard` ends a step that waits on something
the stall holds up (here a call on the stalled actor itself) with that error,
instead of hanging.

The stall is made deterministic: the rollout rank is stopped (``SIGSTOP``) before
the loads are queued, the actor once it has published its weights, then the
rollout rank is let go; it cannot get its bucket from the stopped actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import pytest
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.algos import SamplingConfig, WeightSync
from asyncflow.train._ahead import SamplesAhead
from support import stop_process
from workers.models import TinyModelConfig, save_tiny_model
from workers.roles import ActorConfig, ActorWorker, RolloutWorker, RolloutWorkerConfig

pytestmark = pytest.mark.usefixtures("shared_ray")

MODEL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=32, num_hidden_layers=1)
TIMEOUT_S = 5.0
GUARD_S = 180.0


async def _pid(session: af.Session, pool: str) -> int:
    pid, *_ = await session.worker(pool, 0).identity.remote()
    return int(pid)


async def _load_started(session: af.Session) -> None:
    """Until a ``load_weights`` call runs on pool ``gen`` (the scheduler started it:
    its weights exist, and the stopped rollout rank holds it there)."""
    gen = session._scheduler.pools["gen"]  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    while not any(c.method == "load_weights" for c in gen.running.values()):
        assert time.monotonic() < deadline, "no load_weights call started within 60 s"
        await asyncio.sleep(0.05)


def test_a_stalled_weight_pull_ends_the_waiting_step_naming_both_ends(tmp_path) -> None:
    model_dir = str(save_tiny_model(tmp_path, MODEL, seed=0))

    async def main() -> tuple[BaseException, float, list[tuple[str, ...]]]:
        # Workers of its own, not ones an earlier module's session left on the shared
        # Ray instance: with adopted workers the stopped actor once answered the
        # step's call (one CI run in many, the cause not found), and a test that
        # stops processes takes none that another module used.
        async with af.Session(cpu_slots=8, keep_workers=False) as session:
            roles = await session.spawn({
                "actor": RoleSpec(cls=ActorWorker, pool=ResourcePool(name="train", devices=1),
                                  config=ActorConfig(model_dir=model_dir, rollout=None)),
                "rollout": RoleSpec(cls=RolloutWorker, pool=ResourcePool(name="gen", devices=1),
                                    config=RolloutWorkerConfig(model_dir=model_dir))})

            batches = [await session.put({"prompt_ids": torch.tensor([[1, 2, 3], [1, 4, 5]]) + j,
                                          "prompt_mask": torch.ones(2, 3, dtype=torch.long)}, pool=roles.rollout.pool)
                       for j in range(3)]  # put now: a put on a stopped rank would wait for it

            async def prompts() -> Any:
                return batches.pop(0)

            sync = WeightSync(roles.actor, roles.rollout, bucket_bytes=8 << 10, timeout_s=TIMEOUT_S)
            ahead = SamplesAhead(session, roles, SamplingConfig(n=2, max_new_tokens=4), max_staleness=1,
                                 last_step=4, seed_of=lambda j: j, next_prompts=prompts, start=0, sync=sync)
            await ahead.prepare()
            first, _ = await ahead.for_step(1)  # batches 1 and 2, by version 0: no load yet
            await first.rows
            await ahead.pending[2].rows
            rollout_pid, actor_pid = await _pid(session, "gen"), await _pid(session, "train")
            stop_process(rollout_pid)
            try:
                await ahead.for_step(2)  # queues version 1's loads (bucket by bucket), then batch 3
                await _load_started(session)  # the actor has published: the first bucket's call runs
                stop_process(actor_pid)
                os.kill(rollout_pid, signal.SIGCONT)
                started = time.monotonic()
                with pytest.raises(af.CallTimeoutError) as info:
                    await ahead.guard(roles.actor.weights())  # never runs: the actor is stopped
                elapsed = time.monotonic() - started
            finally:
                for pid in (rollout_pid, actor_pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            assert sync.buckets is not None
            return info.value, elapsed, sync.buckets

    err, elapsed, buckets = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    assert len(buckets) > 1
    assert isinstance(err, af.CallTimeoutError)
    assert (err.role, err.method, err.pool, err.rank) == ("rollout", "load_weights", "gen", 0)
    assert f"did not finish within {TIMEOUT_S:g} s" in str(err)
    assert "it pulls rows of actor.weights from pool 'train' rank 0" in str(err), str(err)
    assert elapsed < TIMEOUT_S + 15
