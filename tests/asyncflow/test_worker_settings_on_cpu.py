"""Worker processes run at the session's niceness and with their pool's torch
threads (those of one thread under the batch scheduling policy), and keep the
memory they free (real Ray workers), the default thread count follows the cores, a
session takes over the Ray instance ``asyncflow.start_ray`` started, and a run
starts Ray and its CPU workers ahead of its session."""

from __future__ import annotations

import asyncio
import os
import platform
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray
import torch

import asyncflow as af
from asyncflow.runtime import _idle
from asyncflow.runtime._pool import worker_threads
from asyncflow.train import load_config
from asyncflow.train._config import RunConfig
from asyncflow.train._ray_ahead import cpu_ranks, ray_started_ahead
from asyncflow.train._sections import PoolSection
from channels import ConfigError
from support import Sleeper

EXAMPLE = Path(__file__).parents[2] / "examples" / "arith_grpo.toml"

pytestmark = pytest.mark.usefixtures("no_shared_ray")  # its sessions start Ray with their settings

BATCH = ["batch"] if hasattr(os, "SCHED_BATCH") else ["normal"]
"""Every thread of a CPU worker of one torch thread (``workers.host._cpu_policy``),
at its niceness; a worker of several keeps the normal policy."""


def test_default_threads_split_the_cores_and_follow_omp_num_threads() -> None:
    pool = af.ResourcePool(name="p", devices=2)
    assert worker_threads(pool, world=2, device="cpu", cores=2, env={}) == 1
    assert worker_threads(pool, world=1, device="cpu", cores=8, env={}) == 8
    assert worker_threads(pool, world=16, device="cpu", cores=2, env={}) == 1
    assert worker_threads(pool, world=2, device="cpu", cores=2, env={"OMP_NUM_THREADS": "3"}) == 3
    own = af.ResourcePool(name="p", devices=2, threads=4)
    assert worker_threads(own, world=2, device="cpu", cores=2, env={"OMP_NUM_THREADS": "3"}) == 4


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="threads must be an int >= 1"):
        af.ResourcePool(name="p", devices=1, threads=0)
    with pytest.raises(ConfigError, match=r"worker_nice must be an int in 0\.\.19"):
        af.Session(worker_nice=-5)


def test_workers_run_at_the_session_niceness_with_their_pools_threads_batch_policy_and_keep_freed_memory() -> None:
    async def main() -> tuple[list[dict[str, int | None]], list[dict[str, int | None]], list[float]]:
        async with af.Session(worker_nice=7) as session:
            roles = await session.spawn({
                "one": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="one", devices=1, threads=3)),
                "two": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="two", devices=2, threads=1)),
            })
            settings = await roles.one.process_settings(), await roles.two.process_settings()
            return *settings, [*await roles.one.refaults(), *await roles.two.refaults()]

    try:
        one, two, refaults = asyncio.run(asyncio.wait_for(main(), timeout=300))
    finally:
        af.shutdown_ray()
    assert one == [{"openmp": 3, "nice": 7, "threads": 3, "policies": ["normal"]}]
    assert two == [{"openmp": 1, "nice": 7, "threads": 1, "policies": BATCH}] * 2
    if platform.libc_ver()[0] == "glibc":  # workers.host._allocator: 5,120 pages a round where memory went back
        assert all(r < 256 for r in refaults), refaults


def test_a_session_takes_over_the_ray_instance_start_ray_started() -> None:
    af.shutdown_ray()
    sys.modules.pop("wave", None)
    af.start_ray(worker_nice=5, preload=("wave",))
    assert ray.is_initialized() and "wave" in sys.modules  # imported while Ray started

    async def main() -> list[dict[str, int | None]]:
        async with af.Session() as session:
            roles = await session.spawn({"one": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="one", devices=1,
                                                                                              threads=2))})
            return await roles.one.process_settings()

    try:
        got = asyncio.run(asyncio.wait_for(main(), timeout=300))
        assert not ray.is_initialized(), "the session shuts down the instance it took over"
    finally:
        af.shutdown_ray()
    assert got == [{"openmp": 2, "nice": 5, "threads": 2, "policies": ["normal"]}]


def test_an_instance_started_to_be_kept_outlives_its_sessions() -> None:
    af.shutdown_ray()
    af.start_ray(worker_nice=6, preload=(), keep=True)
    gcs = ray.get_runtime_context().gcs_address

    async def main() -> list[dict[str, int | None]]:
        async with af.Session(worker_nice=0) as session:
            roles = await session.spawn({"one": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="one", devices=1,
                                                                                              threads=1))})
            return await roles.one.process_settings()

    try:
        first = asyncio.run(asyncio.wait_for(main(), timeout=300))
        assert ray.is_initialized() and ray.get_runtime_context().gcs_address == gcs, "the session left it running"
        second = asyncio.run(asyncio.wait_for(main(), timeout=300))
        assert ray.get_runtime_context().gcs_address == gcs
    finally:
        af.shutdown_ray()
    assert first == second == [{"openmp": 1, "nice": 6, "threads": 1, "policies": BATCH}], (
        "the kept instance's settings, not the sessions'")


def test_workers_started_with_ray_are_the_first_sessions() -> None:
    af.shutdown_ray()
    af.start_ray(preload=(), workers=2)
    ahead = sorted(ray.get([actor.identity.remote() for _, actor in _idle._kept[_idle._connection()]]))
    store_ahead = _idle._kept_stores[_idle._connection()]._actor_id

    async def main() -> tuple[list[int], Any, list[dict[str, Any]]]:
        async with af.Session() as session:
            roles = await session.spawn({"s": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="main", devices=2,
                                                                                          threads=1))})
            assert _idle.kept_count() == 0 and _idle.take_store() is None
            return await roles.s.pid(), session._store._actor_id, await roles.s.process_settings()

    try:
        pids, store, settings = asyncio.run(asyncio.wait_for(main(), timeout=300))
    finally:
        af.shutdown_ray()
    assert sorted(pids) == [pid for pid, *_ in ahead]
    assert [s["policies"] for s in settings] == [BATCH] * 2, "moved when the session gave them their one thread"
    assert store == store_ahead, "the rendezvous store server started with them"


def _run_config(**pools: PoolSection) -> RunConfig:
    return msgspec.structs.replace(load_config(EXAMPLE), pools=pools)


def test_a_run_counts_the_ranks_of_its_cpu_pools() -> None:
    # A device a pool names holds for every pool of the run (a session uses one kind);
    # with none named, the pools are CPU ones where torch sees no GPU.
    assert cpu_ranks(_run_config(main=PoolSection(devices=2, device="cpu"), side=PoolSection(devices=3))) == 5
    assert cpu_ranks(_run_config(main=PoolSection(devices=2), side=PoolSection(devices=3))) == (
        0 if torch.cuda.is_available() else 5)
    assert cpu_ranks(_run_config(main=PoolSection(devices=2, device="cuda"), side=PoolSection(devices=3))) == 0


def test_a_run_starts_ray_and_its_cpu_workers_ahead_and_its_session_adopts_them() -> None:
    af.shutdown_ray()
    config = _run_config(main=PoolSection(devices=2, device="cpu"))
    env = {"ASYNCFLOW_TEST_AHEAD": "1"}  # the session's worker_env: the workers must have it to be adopted

    async def main() -> list[int]:
        async with af.Session(worker_env=env) as session:
            roles = await session.spawn({"s": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="main", devices=2,
                                                                                          threads=1))})
            return await roles.s.pid()

    try:
        with ray_started_ahead(config, address=None, worker_env=env):
            assert ray.is_initialized() and _idle.kept_count() == 2
            ahead = sorted(pid for pid, *_ in ray.get([a.identity.remote() for _, a in _idle._kept[_idle._connection()]]))
            pids = asyncio.run(asyncio.wait_for(main(), timeout=300))
        assert not ray.is_initialized()
    finally:
        af.shutdown_ray()
    assert sorted(pids) == ahead


def test_a_run_that_fails_before_its_session_ends_the_ray_it_started() -> None:
    af.shutdown_ray()
    config = _run_config(main=PoolSection(devices=1, device="cpu"))
    with pytest.raises(RuntimeError, match="SFT failed"), ray_started_ahead(config, address=None, worker_env={}):
        assert ray.is_initialized()
        raise RuntimeError("SFT failed")
    assert not ray.is_initialized()


def test_a_run_starts_nothing_ahead_on_a_cluster_or_a_running_ray() -> None:
    af.shutdown_ray()
    config = _run_config(main=PoolSection(devices=1, device="cpu"))
    with ray_started_ahead(config, address="127.0.0.1:1", worker_env={}):  # joined when its session starts
        assert not ray.is_initialized()
    af.start_ray(preload=(), keep=True)  # a script's own instance
    try:
        with ray_started_ahead(config, address=None, worker_env={}):
            assert _idle.kept_count() == 0
        assert ray.is_initialized(), "an instance the run did not start outlives it"
    finally:
        af.shutdown_ray()
