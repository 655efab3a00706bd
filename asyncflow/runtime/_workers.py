"""A session's worker processes: its pools' placement groups, the workers started
(or adopted, ``asyncflow.runtime._idle``) in them, and how they end or are kept
when the session closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    PlacementGroupSchedulingStrategy,
)

from asyncflow.runtime import _idle
from asyncflow.runtime._pool import ResourcePool, worker_threads, world_size
from channels import ConfigError
from workers import LIVE_ENV

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 10.0
"""How long a closing session waits for a worker to leave it (else the worker ends)."""


class Workers:
    """The worker processes of one session, in session-wide index order.

    Args:
        worker_env: the workers' environment variables (``Session(worker_env=...)``).
        adopt: take idle workers an earlier session left, where they fit.
        keep: start workers that may outlive the session (outside the placement
            groups, which would end them), for :meth:`release` to keep.
        placement_timeout_s: how long :meth:`create` waits for a pool's devices.
    """

    def __init__(self, *, worker_env: Mapping[str, str], adopt: bool, keep: bool,
                 placement_timeout_s: float) -> None:
        self.actors: list[Any] = []
        """The Ray actor handles (``WorkerProcess``)."""
        self._env = dict(worker_env)
        self._adopt, self._keep = adopt, keep
        self._placement_timeout = placement_timeout_s
        self._fits: list[_idle.Fit | None] = []  # per worker: what it fits when kept
        self._placement_groups: list[PlacementGroup] = []

    async def create(self, pools: list[ResourcePool], device: str, slot: str,
                     preload: Mapping[str, tuple[str, ...]]) -> dict[str, list[int]]:
        """Reserve every pool's devices, then start or adopt a worker per rank;
        returns each pool's workers' indices, in rank order."""
        world = world_size(pools)
        groups = {}
        for pool in sorted(pools, key=lambda p: not p.labels):  # the pools with fewer nodes to go to first
            groups[pool.name] = await self._place(pool, device, slot)
        fitting = device == "cpu" and (self._adopt or self._keep)
        live_env = {k: v for k, v in self._env.items() if k in LIVE_ENV}
        ranks: dict[str, list[int]] = {}
        joining = []
        for pool in pools:
            pg = groups[pool.name]
            nodes = placement_group_table(pg)["bundles_to_node_id"] if fitting else {}
            ranks[pool.name] = []
            for rank in range(pool.devices):
                args: dict[str, Any] = {
                    "index": len(self.actors), "pool": pool.name, "rank": rank, "pool_size": pool.devices,
                    "world": world, "num_threads": worker_threads(pool, world=world, device=device),
                    "preload": preload.get(pool.name, ())}
                fit = _idle.Fit.of(nodes[rank], args["num_threads"], self._env) if fitting else None
                actor = _idle.take(fit) if fit is not None and self._adopt else None
                if actor is not None:
                    joining.append((actor.rejoin.remote(**args, env=live_env), args, pool, pg))
                else:
                    actor = self._start(pool, device, slot, pg, fit, args)
                ranks[pool.name].append(len(self.actors))
                self.actors.append(actor)
                self._fits.append(fit if self._keep else None)
        for joined, args, pool, pg in joining:
            try:
                await joined
            except ray.exceptions.RayError:  # it ended while idle: start a new one
                logger.debug("an idle worker could not join; starting a new one", exc_info=True)
                self.actors[args["index"]] = self._start(pool, device, slot, pg, self._fits[args["index"]], args)
        return ranks

    def _start(self, pool: ResourcePool, device: str, slot: str, pg: PlacementGroup, fit: _idle.Fit | None,
               args: Mapping[str, Any]) -> Any:
        """A new worker for ``args["rank"]`` of ``pool``: one that may outlive the
        session (``fit`` and keeping) on the bundle's node, else in its bundle of ``pg``."""
        if fit is not None and self._keep:
            return _idle.start_keepable(fit.node, self._env, args)
        opts: dict[str, Any] = {
            "num_cpus": 1 if slot == "CPU" else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=args["rank"]),
            "resources": {**({slot: 1.0} if slot not in ("CPU", "GPU") else {}), **pool.resources},
        }
        if device == "cuda":
            opts["num_gpus"] = 1
        return _idle.start_worker(opts, self._env, args, device=device)

    async def _place(self, pool: ResourcePool, device: str, slot: str) -> PlacementGroup:
        """Reserve ``pool``'s devices (a placement group), waiting at most
        ``placement_timeout_s`` for devices that others hold now."""
        labels = [dict(pool.labels)] * pool.devices if pool.labels else None
        pg = placement_group([pool.bundle(device, slot)] * pool.devices, strategy=pool.strategy,
                             bundle_label_selector=labels)
        self._placement_groups.append(pg)
        try:
            await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), self._placement_timeout)
        except TimeoutError:
            free = ray.available_resources()
            raise ConfigError(
                f"pool {pool.name!r} ({pool.devices} x {pool.bundle(device, slot)}"
                f"{f' on nodes labelled {dict(pool.labels)}' if pool.labels else ''}) was not placed within "
                f"{self._placement_timeout:g} s: the cluster has them, but not free together now (free: "
                f"{', '.join(f'{k} {v:g}' for k, v in sorted(free.items()) if k in pool.bundle(device, slot))}"
                "); other jobs may hold them, or a pool's ranks do not fit one node") from None
        return pg

    async def release(self, *, clean: bool) -> None:
        """End the workers, or, after a ``clean`` close (no call running, no pool
        broken), keep those that leave the session in time and fit
        (``asyncflow.runtime._idle``); then free the placement groups."""
        kept = await self._leave() if clean else set()
        for i, actor in enumerate(self.actors):
            if i not in kept:
                ray.kill(actor, no_restart=True)
        for pg in self._placement_groups:
            remove_placement_group(pg)

    async def _leave(self) -> set[int]:
        leaving = [i for i, fit in enumerate(self._fits) if fit is not None]
        answers = await asyncio.gather(
            *(asyncio.wait_for(asyncio.wrap_future(self.actors[i].leave.remote().future()), LEAVE_TIMEOUT_S)
              for i in leaving), return_exceptions=True)
        kept = {i for i, fit in zip(leaving, answers, strict=True) if fit is True}
        for i in kept:
            fit = self._fits[i]
            assert fit is not None
            _idle.keep(fit, self.actors[i])
        return kept
