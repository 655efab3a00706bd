"""The planner's profile on real Ray workers: costs on 1 and N ranks, the timed
overlapped steps and the interference fitted to them, and the serial run on fewer
processes that the oversubscription is fitted to."""

from __future__ import annotations

from typing import Any

import pytest

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.plan import Placement, oversubscribed, predict, profile, profile_placements
from support import Sleeper

pytestmark = pytest.mark.usefixtures("shared_ray")

SLEEP_S = 0.4
"""Long enough that the runtime's per-call costs on a busy 2-core machine (tens of ms)
stay small beside it."""


class _Steps:
    def __init__(self, roles: Any) -> None:
        self.roles = roles

    async def step(self, *, stream: bool) -> object:
        return await af.gather(*(getattr(self.roles, r).work(SLEEP_S) for r in SleepJob.roles))


class SleepJob:
    """Three roles whose calls sleep: side by side they take no core from each other,
    and more processes than cores do not slow them."""

    roles = ("a", "b", "c")

    async def start(self, placement: Placement, session: af.Session) -> _Steps:
        pools = {n: ResourcePool(name=n, devices=d) for n, d in placement.pools.items()}
        return _Steps(await session.spawn({r: RoleSpec(cls=Sleeper, pool=pools[placement.roles[r]])
                                           for r in self.roles}))


def test_profile_fits_costs_and_the_overlapped_steps(loop_thread) -> None:
    found = loop_thread.run(profile(SleepJob(), devices=2, stream=False, steps=2, cores=2))
    for ranks in (1, 2):
        line = found.costs.fit("a", "work", ranks)
        # 1-rank costs are the "1" run's divided by its fitted slowdown (3 processes, 2 cores).
        low = SLEEP_S / (oversubscribed(3, 2, found.oversubscription) if ranks == 1 else 1.0)
        assert line is not None and low - 1e-6 <= line[0] + line[1] < SLEEP_S + 0.15
    overlapped = found.overlapped_s["batch"]
    assert overlapped < 2 * SLEEP_S  # the three pools' calls ran side by side
    assert 0.0 <= found.interference <= 0.5  # sleeps slow each other little, if at all
    assert [len(t) for t in found.traces.values()] == [1, 1, 1]  # "1", "packed" (2 pools), "2"
    assert found.traces["packed"][0].pools == {"core0": 1, "core1": 1}
    assert 0.0 <= found.oversubscription <= 0.3  # 3 sleeping processes on 2 cores: hardly slower
    one = profile_placements(SleepJob.roles, 2, cores=2)["1"]
    # Sleeps take no core, so the model without core sharing reproduces the run: to
    # within the runtime's per-call costs on a busy machine (the same 0.15 s as the
    # costs above; a model that serialised the pools would be off by 2 * SLEEP_S).
    assert abs(predict(found, one, cores=None).step_s - overlapped) < 0.15
