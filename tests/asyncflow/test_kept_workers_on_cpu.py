"""Worker processes kept between the sessions of one Ray instance (real Ray): the
next session adopts them as if they were new, and only clean ones are kept."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import asyncflow as af
from asyncflow.runtime import _idle
from support import Probe, Sleeper
from workers.host._engine_logs import LEVEL_ENV, LOG_FILE_ENV

pytestmark = pytest.mark.usefixtures("shared_ray")


@pytest.fixture(autouse=True)
def _none_kept() -> None:
    _idle.forget()  # what earlier modules left: each test starts with no idle worker


def _probe(ranks: int = 2) -> dict[str, af.RoleSpec]:
    return {"probe": af.RoleSpec(cls=Probe, pool=af.ResourcePool(name="main", devices=ranks, threads=1))}


def _reports(*, env: Mapping[str, str] | None = None, keep: bool = True, ask: str = "") -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        async with af.Session(worker_env=env, keep_workers=keep) as session:
            roles = await session.spawn(_probe())
            return await roles.probe.report(env=ask)

    return asyncio.run(asyncio.wait_for(main(), timeout=300))


def _pids(reports: list[dict[str, Any]]) -> list[int]:
    return [r["pid"] for r in reports]


def test_the_next_session_adopts_the_workers_as_if_they_were_new() -> None:
    first = _reports()
    assert _idle.kept_count() == 2
    second = _reports()
    assert _pids(second) == _pids(first), "the same processes, in the same ranks"
    assert [r["seen_before"] for r in first] == [False, False]
    assert [r["seen_before"] for r in second] == [True, True]
    assert [(r["world"], r["rank"], r["threads"]) for r in second] == [(2, 0, 1), (2, 1, 1)]
    assert [r["draw"] for r in second] == [r["draw"] for r in first], "torch's generator as it started"

    fresh = _reports(keep=False)  # new processes, ended when it closes
    assert not set(_pids(fresh)) & set(_pids(first))
    assert _idle.kept_count() == 2, "a session that does not keep workers leaves the kept ones alone"


def test_workers_of_a_session_closed_in_a_call_are_not_kept() -> None:
    async def closed_mid_call() -> list[int]:
        async with af.Session() as session:
            roles = await session.spawn({"s": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="main", devices=2,
                                                                                          threads=1))})
            pids = await roles.s.pid()
            roles.s.work(seconds=60)  # still running when the session closes
            await asyncio.sleep(0.5)
            return pids

    pids = asyncio.run(asyncio.wait_for(closed_mid_call(), timeout=300))
    assert _idle.kept_count() == 0
    assert not set(_pids(_reports())) & set(pids)


def test_only_the_log_file_may_differ_between_the_sessions_a_worker_serves(tmp_path: Path) -> None:
    own = _reports(env={"PROBE_SETTING": "1"}, ask="PROBE_SETTING")
    assert [r["env"] for r in own] == ["1", "1"]
    other = _reports(ask="PROBE_SETTING")
    assert not set(_pids(other)) & set(_pids(own)), "another environment: other processes"
    assert [r["env"] for r in other] == [None, None]

    a, b = str(tmp_path / "a.log"), str(tmp_path / "b.log")
    first = _reports(env={LOG_FILE_ENV: a}, ask=LOG_FILE_ENV)
    second = _reports(env={LOG_FILE_ENV: b}, ask=LOG_FILE_ENV)
    third = _reports(ask=LOG_FILE_ENV)
    assert _pids(first) == _pids(second) == _pids(third)
    assert [r["env"] for r in first + second + third] == [a, a, b, b, None, None]


def test_a_worker_sets_asyncflows_own_variables_itself_and_ray_the_others(tmp_path: Path) -> None:
    (tmp_path / "probe_module_beside.py").write_text("VALUE = 1\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}${{PYTHONPATH}}", LEVEL_ENV: "info", "PROBE_SETTING": "1"}

    async def main() -> list[list[dict[str, Any]]]:
        async with af.Session(worker_env=env) as session:
            roles = await session.spawn(_probe())
            return [await roles.probe.report(env=name, module="probe_module_beside")
                    for name in ("PYTHONPATH", LEVEL_ENV, "PROBE_SETTING")]

    path, level, setting = asyncio.run(asyncio.wait_for(main(), timeout=300))
    assert [r["env"] for r in level + setting] == ["info", "info", "1", "1"]
    # ${PYTHONPATH} is the worker's own (the suite's), as Ray's runtime_env expands it
    assert all(r["env"].startswith(f"{tmp_path}{os.pathsep}") and "$" not in r["env"] for r in path), path
    assert [r["module"] for r in path] == [True, True], "a PYTHONPATH the worker set itself imports"
    assert [r["ray_env"] for r in path] == [["PROBE_SETTING"]] * 2, "only the other variable went by Ray"

    alone = _reports(env={LEVEL_ENV: "info"})
    assert [r["ray_env"] for r in alone] == [[], []], "asyncflow's own variables alone: no runtime_env at all"


def test_a_kept_worker_that_died_is_replaced_and_the_kept_ones_are_bounded(monkeypatch) -> None:
    first = _reports()
    os.kill(first[1]["pid"], signal.SIGKILL)
    second = _reports()
    assert _pids(second)[0] == _pids(first)[0] and _pids(second)[1] != _pids(first)[1]
    assert [r["rank"] for r in second] == [0, 1]

    monkeypatch.setattr(_idle, "KEPT_WORKERS", 1)
    _idle.forget()
    last = _reports()
    assert _idle.kept_count() == 1
    # The newest kept (the last to leave), the one kept longer ended: a later session fits the newest likelier.
    assert _pids(_reports())[0] == _pids(last)[1]


def test_the_next_session_takes_the_rendezvous_store_over_emptied() -> None:
    """A clean session's rendezvous store server serves the next session, holding
    none of the old keys; a session closed in a call ends its own."""

    async def session_store(*, keep: bool = True, leave_a_call: bool = False) -> tuple[str, bool]:
        async with af.Session(keep_workers=keep) as session:
            roles = await session.spawn({"s": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(
                name="main", devices=2, threads=1))})
            store = session._store
            left = await store.check.remote(["left/behind"])  # by the session before
            await store.set.remote("left/behind", b"x")
            assert await store.num_keys.remote() > 1, "the ranks' rendezvous used it"
            if leave_a_call:
                roles.s.work(seconds=60)
                await asyncio.sleep(0.5)
            return store._actor_id.hex(), left

    def run(**kw: bool) -> tuple[str, bool]:
        return asyncio.run(asyncio.wait_for(session_store(**kw), timeout=300))

    first, _ = run()
    second, left = run()
    assert second == first and not left, "the same server, emptied"
    third, _ = run(keep=False)
    assert third != first, "a session that keeps nothing starts its own"
    fourth, left = run(leave_a_call=True)
    assert fourth == first and not left
    fifth, _ = run()
    assert fifth != fourth, "the server of a session closed in a call ended with it"


def test_a_session_of_one_worker_starts_no_store_server_and_its_worker_meets_others_next() -> None:
    """A world of one process meets nobody: no rendezvous store server starts for
    it. The worker it keeps joins the next session's world of two through one."""

    async def session(ranks: int) -> tuple[Any, list[dict[str, Any]]]:
        async with af.Session() as s:
            roles = await s.spawn(_probe(ranks))
            return s._store, await roles.probe.report()

    store, one = asyncio.run(asyncio.wait_for(session(1), timeout=300))
    assert store is None and _idle.take_store() is None
    assert [(r["world"], r["rank"]) for r in one] == [(1, 0)]
    store, two = asyncio.run(asyncio.wait_for(session(2), timeout=300))
    assert store is not None and sorted((r["world"], r["rank"]) for r in two) == [(2, 0), (2, 1)]
    assert one[0]["pid"] in {r["pid"] for r in two}, "the kept worker joined the larger world"
