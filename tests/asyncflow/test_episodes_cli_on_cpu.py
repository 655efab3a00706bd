"""``asyncflow train`` with an ``[env]``: every built-in algorithm family trains on
episodes (GRPO, PPO with its critic, RLOO, DAPO), asynchronously too, and a run
killed mid-episode resumes to the uninterrupted run's metrics."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from asyncflow.cli import main
from asyncflow.train import read_metrics
from support import config_file, wait_for_a_checkpoint
from tiny_runs import save_model

CONFIG = """
output_dir = "{out}"
seed = 3

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 4

[train]
steps = {steps}
prompts_per_step = 4
checkpoint_every = 1
eval_size = 4
kl_metric = false
max_staleness = {staleness}

[algorithm]
name = "{algorithm}"
sampling = {{ n = 4, temperature = 1.0, max_new_tokens = 4 }}

[env]
class = "support:DigitsEnv"
settings = {{ turns = 2, sleep_s = {sleep_s} }}
max_turns = 3
max_tokens = 24

[actor]
lr = 1e-2
micro_batch_size = 16

[pools]
main = {{ devices = 1, threads = 1 }}
{more}
"""

DISAGGREGATED = """gen = { devices = 1, threads = 1 }

[placement]
rollout = { pool = "gen" }
"""

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    # Ray's workers inherit this environment: they import the environment of tests/support.py.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(tmp_path_factory.mktemp("model"))


def _config(tmp: Path, model: str, name: str, *, algorithm: str = "grpo", steps: int = 2, staleness: int = 0,
            disaggregated: bool = False, sleep_s: float = 0.0) -> Path:
    path = config_file(tmp, name)
    path.write_text(CONFIG.format(out=tmp / name, model=model, steps=steps, staleness=staleness, algorithm=algorithm,
                                  sleep_s=sleep_s, more=DISAGGREGATED if disaggregated else ""))
    return path


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo", "dapo"])
def test_each_algorithm_trains_on_episodes(tmp_path: Path, model_dir: str, algorithm: str) -> None:
    assert main(["train", str(_config(tmp_path, model_dir, algorithm, algorithm=algorithm)), "--no-progress"]) == 0
    rows = read_metrics(tmp_path / algorithm / "latest" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "actor/loss" in r]
    assert len(steps) >= 2
    for r in steps:
        assert r["episode/turns"] == 2 and r["episode/done"] == 1  # DigitsEnv ends each after two turns
        assert r["episode/observation_tokens"] >= 2
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["reward/mean"])
    if algorithm == "ppo":
        assert all(math.isfinite(r["critic/loss"]) for r in steps)


def test_asynchronous_training_on_episodes(tmp_path: Path, model_dir: str) -> None:
    """A rollout role on its own pool runs the episodes one update ahead."""
    config = _config(tmp_path, model_dir, "async", steps=3, staleness=1, disaggregated=True)
    assert main(["train", str(config), "--no-progress", "--set", "algorithm.policy.off_policy=decoupled"]) == 0
    steps = [r for r in read_metrics(tmp_path / "async" / "latest" / "metrics.jsonl") if r["step"] > 0]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1]
    assert all(r["episode/turns"] == 2 for r in steps)


def _learned(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def test_a_run_killed_mid_episode_resumes_to_the_uninterrupted_runs_metrics(tmp_path: Path, model_dir: str) -> None:
    """Each environment step sleeps, so that the kill lands while episodes wait."""
    run = _config(tmp_path, model_dir, "run", steps=10_000, sleep_s=0.3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    with (tmp_path / "stdout.txt").open("w") as out, (tmp_path / "stderr.txt").open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(run), "--no-progress"],
                                stdout=out, stderr=err_file, text=True, env=env)
        wait_for_a_checkpoint(proc, tmp_path / "run" / "latest" / "checkpoints", tmp_path / "stderr.txt")
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if p.name().startswith("ray::WorkerProcess")]
        assert workers
        workers[0].send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("asyncflow: RunInterruptedError: "), err
    checkpoints = tmp_path / "run" / "latest" / "checkpoints"
    resumed_from = int((checkpoints / "latest").read_text().strip().removeprefix("step_"))
    target = resumed_from + 2
    assert main(["train", str(run), "--resume", "--set", f"train.steps={target}", "--no-progress"]) == 0
    reference = _config(tmp_path, model_dir, "reference", steps=target, sleep_s=0.0)
    assert main(["train", str(reference), "--no-progress"]) == 0
    got = {r["step"]: r for r in read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")}
    want = {r["step"]: r for r in read_metrics(tmp_path / "reference" / "latest" / "metrics.jsonl")}
    for step in (resumed_from + 1, target):
        assert set(_learned(got[step])) == set(_learned(want[step]))
        for key, value in _learned(want[step]).items():
            # The rollout's log-probs depend on which turns shared an engine step (the
            # environments' timing) in the last float bits: tolerance, not equality.
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
