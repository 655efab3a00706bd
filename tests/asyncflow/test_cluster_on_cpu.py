"""``asyncflow train`` on a Ray cluster of several nodes, all on this machine's
loopback interface: pools on different nodes, a node lost mid-run, ``--resume``
on the nodes left, and the way Ray users start jobs (``ray start`` by hand, then
``ray job submit``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray._private import ray_constants
from ray._private.node import Node
from ray.cluster_utils import Cluster

from asyncflow.cli import main
from asyncflow.train import read_metrics
from process_tree import clean_env
from tiny_runs import grpo_toml, save_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_shared_ray")]  # it joins clusters

LABEL = "asyncflow-test"

PLACEMENT = """
[algorithm.policy]
kl_coef = 0.01

[placement]
actor = { pool = "main" }
ref = { pool = "side" }
reward = { pool = "side" }
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(tmp_path_factory.mktemp("model"))


def _config(tmp: Path, model: str, *, steps: int) -> Path:
    path = tmp / "run.toml"
    side = f'side = {{ devices = 1, labels = {{ {json.dumps(LABEL)} = "side" }} }}'
    path.write_text(grpo_toml(tmp / "out", model, steps=steps, seed=2, train={"eval_every": 0},
                              pools=f"main = {{ devices = 1 }}\n{side}", more=PLACEMENT))
    return path


def _latest_checkpoint(out: Path) -> Path | None:
    for pointer in out.rglob("checkpoints/latest"):
        return pointer.parent / pointer.read_text().strip()
    return None


def _placement(text: str) -> dict[str, str]:
    """``{pool: node id prefix}`` from the run's ``pools on nodes`` line."""
    line = next(x for x in text.splitlines() if x.startswith("pools on nodes: "))
    return dict(re.findall(r"(\w+) on node (\w+) \(", line))


@pytest.fixture
def two_nodes() -> Iterator[tuple[Cluster, Node]]:
    """A head node for the trainer and a node labelled for the side pool, one CPU
    each; the head notices a lost node within about 2 s."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "labels": {LABEL: "trainer"},
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    side = cluster.add_node(num_cpus=1, labels={LABEL: "side"})
    cluster.wait_for_nodes()
    try:
        yield cluster, side
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_pools_on_two_nodes_train_then_a_lost_node_ends_the_run_and_resume_continues(
        tmp_path: Path, model_dir: str, two_nodes: tuple[Cluster, Node],
        capsys: pytest.CaptureFixture[str]) -> None:
    cluster, side = two_nodes
    config = _config(tmp_path, model_dir, steps=10_000)
    assert main(["train", str(config), "--address", cluster.address, "--set", "pools.main.devices=2"]) == 2
    assert ("the pools ask for 3 CPU in all (main: 2, side: 1) but the Ray cluster has 2"
            in capsys.readouterr().err)
    out_file, err_file = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(config), "--no-progress",
                             "--address", cluster.address], stdout=out_file, stderr=err_file, text=True)
    deadline = time.monotonic() + 300
    while _latest_checkpoint(tmp_path / "out") is None:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.3)
    placed = _placement((tmp_path / "stdout.txt").read_text())
    assert cluster.head_node is not None
    head_id, side_id = cluster.head_node.node_id[:8], side.node_id[:8]
    assert placed == {"main": head_id, "side": side_id}

    raylet = side.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    psutil.Process(raylet.pid).kill()
    assert proc.wait(timeout=180) == 1
    out_file.close()
    err_file.close()
    err = (tmp_path / "stderr.txt").read_text()
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err, err[-3000:]
    assert last.startswith("asyncflow: RunInterruptedError: ")
    assert f"node {side_id} (127.0.0.1)" in last and "in pool 'side'" in last, last
    checkpoint = _latest_checkpoint(tmp_path / "out")
    assert checkpoint is not None and f"last checkpoint: {checkpoint} (continue with --resume)" in last, last

    # The side pool's node is gone: its pool goes wherever there is room now.
    cluster.remove_node(side, allow_graceful=False)
    cluster.add_node(num_cpus=1)
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    assert main(["train", str(config), "--resume", "--address", cluster.address, "--no-progress",
                 "--set", "pools.side.labels={}", "--set", f"train.steps={step + 2}"]) == 0
    rows = read_metrics(next((tmp_path / "out").rglob("metrics.jsonl")))
    assert rows[-1]["step"] == step + 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """``ray ARGS``' output; retried while the head's job agent is still starting
    (``ray job submit`` right after ``ray start`` finds none for a few seconds)."""
    deadline = time.monotonic() + 90
    while True:
        done = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
        text = done.stdout + done.stderr
        if done.returncode == 0 or "No available agent" not in text or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, f"ray {' '.join(args)} failed:\n{text[-4000:]}"
    return text


def _end_processes_under(temp_dir: Path) -> None:
    """End the processes of the cluster whose files are under ``temp_dir`` (not
    ``ray stop``, which would end every Ray process on the machine)."""
    mine: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(str(temp_dir) in part for part in p.info["cmdline"] or ()):
            mine[p.pid] = p
            with contextlib.suppress(psutil.Error):  # agents rename themselves: found as children
                mine.update((c.pid, c) for c in p.children(recursive=True))
    for p in mine.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(mine.values()), timeout=10)


@pytest.mark.slow
def test_ray_job_submit_runs_the_cli_on_a_cluster_started_by_hand(tmp_path: Path, model_dir: str) -> None:
    temp_dir = Path(tempfile.mkdtemp(prefix="afray", dir="/tmp"))
    env = clean_env(RAY_AUTH_MODE="token")  # `ray start` enabled it (a token is in ~/.ray): its clients need it too
    port, dashboard = _free_port(), _free_port()
    try:
        # Each node's agent on a port of its own: two nodes on one machine (and any
        # other Ray instance here) would otherwise both want Ray's default, 52365.
        _ray(env, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
             "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port", str(_free_port()),
             "--temp-dir", str(temp_dir), "--disable-usage-stats")
        _ray(env, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1", "--labels", f"{LABEL}=side",
             "--dashboard-agent-listen-port", str(_free_port()))
        config = _config(tmp_path, model_dir, steps=2)
        text = _ray(env, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--",
                    "asyncflow", "train", str(config), "--no-progress", timeout=400)
        assert "accuracy: " in text, text[-3000:]
        placed = _placement(text)
        assert set(placed) == {"main", "side"} and placed["main"] != placed["side"], text[-3000:]
        assert _latest_checkpoint(tmp_path / "out") is not None

        # A plain run (no address) next to that cluster starts a Ray of its own on
        # loopback; it did join, then fail, on a cluster named by ray_current_cluster.
        script = tmp_path / "plain.py"
        script.write_text("import asyncio, asyncflow as af\n"
                          "async def main():\n"
                          "    async with af.Session() as s:\n"
                          "        print('nodes', len(__import__('ray').nodes()))\n"
                          "asyncio.run(main())\n")
        plain = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                               timeout=120)
        assert plain.returncode == 0 and "nodes 1" in plain.stdout, plain.stderr[-3000:]
    finally:
        _end_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        os.environ.pop("RAY_ADDRESS", None)


def test_an_address_where_no_cluster_answers_ends_the_run_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sft.toml"
    config.write_text(f'output_dir = "{tmp_path / "out"}"\n'
                      "[data.arithmetic]\ndigits = 1\ntrain_size = 40\neval_size = 8\n[sft]\nsteps = 1\n")
    port = _free_port()  # nothing listens there once the probe socket is closed
    assert main(["train", str(config), "--address", f"127.0.0.1:{port}", "--no-progress"]) == 2
    said = capsys.readouterr()
    assert said.err.strip() == (f"asyncflow: configuration error: no Ray cluster answers at 127.0.0.1:{port} "
                                "(Connection refused); start one with `ray start --head`, or check --address / "
                                "RAY_ADDRESS")
    assert "SFT" not in said.out


def test_a_pool_the_nodes_hold_in_all_but_not_together_waits_then_says_what_is_free(
        two_nodes: tuple[Cluster, Node]) -> None:
    import asyncio

    from asyncflow import ResourcePool, RoleSpec, Session
    from channels import ConfigError
    from support import Producer

    async def spawn() -> None:
        async with Session(address=two_nodes[0].address, placement_timeout_s=3) as session:
            pool = ResourcePool(name="both", devices=2, strategy="STRICT_PACK")  # 2 CPUs, but 1 a node
            await session.spawn({"p": RoleSpec(cls=Producer, pool=pool)})

    with pytest.raises(ConfigError, match=r"pool 'both' \(2 x \{'CPU': 1.0\}\) was not placed within 3 s: the "
                                          r"cluster has them, but not free together now \(free: CPU 2\)"):
        asyncio.run(spawn())
