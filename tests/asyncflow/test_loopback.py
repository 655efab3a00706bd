"""Every entry point keeps what it starts on the loopback interface, and a killed
driver leaves nothing running.

Each entry point runs as a new user runs it: in a subprocess with a clean
environment (no ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, whatever this test
process has), its process tree's listening sockets sampled from outside while
it runs (tests/process_tree.py).
"""

from __future__ import annotations

import re
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from process_tree import WatchedRun, _bound_sockets, clean_env, is_loopback
from tiny_runs import grpo_toml, save_model

pytestmark = [pytest.mark.timeout(280), pytest.mark.usefixtures("no_shared_ray")]

SIDE_POOL = '[placement]\nactor = { pool = "main" }\nreward = { pool = "side" }\n'

SCRIPT = textwrap.dedent("""
    import ray  # first, as a script may: nothing was set for Ray before this
    import asyncio
    import torch
    import asyncflow as af

    class Doubler(af.Role):
        @af.register(protocol=af.DP(), reads=("x",), writes=("x",))
        def double(self, batch):
            return {"x": batch["x"] * 2}

    async def main():
        async with af.Session() as session:
            pool = af.ResourcePool(name="p", devices=2)
            roles = await session.spawn({"doubler": af.RoleSpec(cls=Doubler, pool=pool)})
            rows = await session.put({"x": torch.arange(8.0)})
            out = await roles.doubler.double(rows).fetch()
            print("doubled", out["x"].tolist(), flush=True)

    asyncio.run(main())
""")


def test_the_watch_counts_listeners_and_unconnected_udp_but_not_a_connected_udp_socket() -> None:
    with (socket.socket() as listening, socket.socket(type=socket.SOCK_DGRAM) as bound,
          socket.socket(type=socket.SOCK_DGRAM) as connected, socket.socket(type=socket.SOCK_DGRAM) as peer):
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))
        peer.bind(("127.0.0.1", 0))
        connected.connect(peer.getsockname())  # as a DNS lookup's socket: it takes datagrams from its peer only
        found = set(_bound_sockets().values())
        assert listening.getsockname() in found and bound.getsockname() in found
        assert connected.getsockname() not in found


def _check_loopback(run: WatchedRun) -> None:
    names = run.names()
    assert {"gcs_server", "raylet"} <= names, f"Ray never started? processes seen: {sorted(names)}"
    assert len(run.listeners) >= 4, f"too few listeners seen to mean anything: {run.listeners}"
    outside = sorted(str(x) for x in run.listeners if not is_loopback(x.ip))
    assert not outside, "listening beyond the loopback interface:\n" + "\n".join(outside)


def test_the_cli_listens_on_loopback_only_and_leaves_nothing_once_killed(tmp_path: Path) -> None:
    model = save_model(tmp_path / "model")
    config = tmp_path / "run.toml"
    config.write_text(grpo_toml(tmp_path / "out", model, steps=100_000, seed=1,
                                train={"checkpoint_every": 0, "eval_every": 0},
                                pools="main = { devices = 1 }\nside = { devices = 1 }", more=SIDE_POOL))
    run = WatchedRun([sys.executable, "-m", "asyncflow.cli", "train", str(config), "--no-progress"],
                     env=clean_env())
    run.wait_for_line("roles up", timeout_s=180)  # every worker up, its gloo groups made
    run.wait_for_line("held-out accuracy before RL", timeout_s=120)  # rows moved between the pools
    _check_loopback(run)
    run.kill9()
    left = run.survivors(within_s=10)
    assert not left, f"still running 10 s after kill -9 of the driver: {left}"


def test_a_bench_module_listens_on_loopback_only() -> None:
    run = WatchedRun([sys.executable, "-m", "bench.tracing", "--calls", "20", "--repeats", "1"], env=clean_env())
    assert run.wait(timeout_s=240) == 0, run.output[-3000:]
    _check_loopback(run)
    for key in ("call_off_us", "ray_call_us", "pull_call_us", "local_call_us", "pull_over_local"):
        assert re.search(rf'"{key}": [0-9.]+', run.output), (key, run.output[-3000:])


def test_a_script_with_a_session_listens_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run = WatchedRun([sys.executable, str(script)], env=clean_env())
    assert run.wait(timeout_s=240) == 0, run.output[-3000:]
    assert "doubled [0.0, 2.0, 4.0" in run.output
    _check_loopback(run)
    assert not run.survivors(within_s=10)


def test_the_watchdog_ends_the_descendants_of_a_killed_process_even_orphaned_ones(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        from asyncflow.runtime._watchdog import watch_this_process
        watch_this_process()
        child = subprocess.Popen([sys.executable, "-c",  # a child with a grandchild of its own
                                  "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
        time.sleep(2.5)  # the watchdog has seen them
        print("READY", flush=True)
        time.sleep(300)
    """))
    run = WatchedRun([sys.executable, str(script)], env=clean_env())
    run.wait_for_line("READY", timeout_s=60)
    assert {"sleep"} <= run.names()
    run.kill9()
    left = run.survivors(within_s=10)
    assert not left, f"still running 10 s after kill -9: {left}"
