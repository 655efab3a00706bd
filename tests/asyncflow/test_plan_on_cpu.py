"""The planner's profile on real Ray workers: costs on 1 and N ranks, the timed
overlapped steps and the interference fitted to them."""

from __future__ import annotations

from typing import Any

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.plan import Placement, predict, profile, profile_placements
from support import Sleeper

SLEEP_S = 0.2


class _Steps:
    def __init__(self, roles: Any) -> None:
        self.roles = roles

    async def step(self, *, stream: bool) -> object:
        return await af.gather(self.roles.a.work(SLEEP_S), self.roles.b.work(SLEEP_S))


class SleepJob:
    """Two roles whose calls sleep: side by side they take no core from each other."""

    roles = ("a", "b")

    async def start(self, placement: Placement, session: af.Session) -> _Steps:
        pools = {n: ResourcePool(name=n, devices=d) for n, d in placement.pools.items()}
        return _Steps(await session.spawn({r: RoleSpec(cls=Sleeper, pool=pools[placement.roles[r]])
                                           for r in self.roles}))


def test_profile_fits_costs_and_the_overlapped_steps(loop_thread) -> None:
    found = loop_thread.run(profile(SleepJob(), devices=2, stream=False, steps=2, cores=2))
    for ranks in (1, 2):
        line = found.costs.fit("a", "work", ranks)
        assert line is not None and SLEEP_S <= line[0] + line[1] < SLEEP_S + 0.15
    overlapped = found.overlapped_s["batch"]
    assert overlapped < 2 * SLEEP_S  # the two pools' calls ran side by side
    assert 0.0 <= found.interference <= 0.5  # sleeps slow each other little, if at all
    one = profile_placements(SleepJob.roles, 2)["1"]
    assert abs(predict(found, one, cores=2).step_s / overlapped - 1) < 0.1  # the fit reproduces its run
