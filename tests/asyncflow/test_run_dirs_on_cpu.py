"""``asyncflow train`` run after run on real Ray workers: a new run never changes an
earlier run's files (each writes into a ``version_<n>`` directory of its own; only
``--clean`` deletes), and a checkpoint or an export that cannot be written (a full
disk, on the driver or in a worker) ends the run in one line naming the directory
and the errno, keeps the last checkpoint and leaves nothing half-written, so that
``--resume`` goes on from that checkpoint."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.train import CheckpointDir, RunDirs, read_metrics
from disk_faults import FAILING_CHECKPOINT, FAILING_EXPORT, state_json_on_a_full_disk
from support import config_file
from tiny_runs import grpo_toml, save_model

PLAIN = "support:digit_share_reward"

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these for the Ray it starts; later tests' Ray must not inherit them.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    # Ray's workers inherit this environment: they can import the tests' reward modules.
    tests = str(Path(__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(tmp_path_factory.mktemp("model"))


def _config(tmp: Path, model: str, *, out: Path, steps: int = 2, reward: str = PLAIN) -> Path:
    path = config_file(tmp, "run")
    path.write_text(grpo_toml(out, model, steps=steps, train={"checkpoint_every": 1},
                              more=f'[reward]\nfunction = "{reward}"\n'))
    return path


def _digests(directory: Path) -> dict[str, str]:
    """The sha256 of every file under ``directory``, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_run_leaves_the_first_runs_files_as_they_were(tmp_path, model_dir, capsys) -> None:
    out = tmp_path / "run"
    config = _config(tmp_path, model_dir, out=out)
    assert main(["train", str(config), "--no-progress", "--trace"]) == 0
    first = out / "version_0"
    before = _digests(first)
    assert {"metrics.jsonl", "curves.png", "timeline.png", "trace.json", "policy/config.json",
            "checkpoints/latest", "checkpoints/step_000002/state.json"} <= before.keys()
    assert any(name.startswith("tensorboard/") for name in before)

    assert main(["train", str(config), "--no-progress", "--trace"]) == 0
    assert os.readlink(out / "latest") == "version_1"
    assert f"run directory: {out / 'version_1'}" in capsys.readouterr().out
    assert _digests(first) == before  # every file, byte for byte
    assert (out / "version_1" / "policy" / "config.json").is_file()

    assert main(["train", str(config), "--no-progress", "--clean", "--set", "train.steps=1"]) == 0
    assert f"--clean: deleted 2 earlier run(s) under {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["latest", "version_0"]
    assert [r["step"] for r in read_metrics(out / "latest" / "metrics.jsonl")] == [0, 1]


def _expected_error(fault: str, run: Path) -> str:
    """The one line a run ends with when ``fault`` fills the disk (see disk_faults)."""
    checkpoints = run / "checkpoints"
    staging, export = checkpoints / FAILING_CHECKPOINT, run / FAILING_EXPORT
    enospc = "[Errno 28] No space left on device"
    what = {
        "state.json on the driver": f"writing checkpoint step 2 to {staging} failed: {enospc}: "
                                    f"'{staging / 'state.json'}'",
        "a shard in the worker": f"writing checkpoint step 2 to {staging} failed: {enospc}",
        "the export in the worker": f"exporting the policy to {export} failed: {enospc}: "
                                    f"'{export / 'model.safetensors'}'",
    }[fault]
    kept = checkpoints / ("step_000002" if fault == "the export in the worker" else "step_000001")
    return f"asyncflow: CheckpointError: {what}; last checkpoint: {kept} (continue with --resume)"


@pytest.mark.parametrize("fault", ["state.json on the driver", "a shard in the worker", "the export in the worker"])
def test_a_full_disk_ends_the_run_in_one_line_and_resume_goes_on(tmp_path, model_dir, capsys, monkeypatch,
                                                                   fault) -> None:
    reward = {"a shard in the worker": "disk_faults:full_disk_for_shards",
              "the export in the worker": "disk_faults:full_disk_for_export"}.get(fault, PLAIN)
    config = _config(tmp_path, model_dir, out=tmp_path / "run", reward=reward)
    run = tmp_path / "run" / "version_0"
    with monkeypatch.context() as patch:
        if fault == "state.json on the driver":
            patch.setattr(Path, "write_text", state_json_on_a_full_disk(Path.write_text))
        assert main(["train", str(config), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == _expected_error(fault, run)
    assert not list(run.rglob(".tmp_*")) and not (run / "policy").exists()
    kept = CheckpointDir(run / "checkpoints").latest()
    assert kept.name == (run / "checkpoints" / "latest").read_text()

    RunDirs(tmp_path / "run").new()  # a run that ended before its first checkpoint (a late config error)
    assert main(["train", str(config), "--resume", "--no-progress", "--set", f"reward.function={PLAIN}"]) == 0
    out = capsys.readouterr().out
    assert "--resume: version_1 ended before its first checkpoint; continuing version_0" in out
    # The run kept its settings: a resume with another reward function is told it changed them.
    warned = f"warning: --resume with other settings than version_0 started with (reward.function: '{reward}' -> "
    assert (warned in out) == (reward != PLAIN), out
    assert f"resuming from {kept} (step {CheckpointDir.state(kept)['step']})" in out
    assert os.readlink(tmp_path / "run" / "latest") == "version_0"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    assert (run / "policy" / "config.json").is_file() and not list(run.rglob(".tmp_*"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    """A 16 MiB tmpfs (skipped where this process may not mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def _fill(disk: Path, *, leave: int) -> Path:
    """Fill ``disk`` up to its last ``leave`` bytes; the filler's path."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(bytes(stats.f_bavail * stats.f_frsize - leave))
    return filler


@pytest.mark.slow
def test_a_checkpoint_on_a_really_full_disk(tmp_path, model_dir, capsys, small_disk) -> None:
    """The same on a real full file system: the actor's checkpoint write fails in its
    worker (``ENOSPC`` from torch.distributed.checkpoint)."""
    config = _config(tmp_path, model_dir, out=small_disk / "run", steps=1)
    assert main(["train", str(config), "--no-progress"]) == 0
    run = small_disk / "run" / "version_0"
    filler = _fill(small_disk, leave=16 * 1024)  # room for a step's metrics, not for a checkpoint

    assert main(["train", str(config), "--resume", "--no-progress", "--set", "train.steps=2"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    staging = run / "checkpoints" / ".tmp_step_000002"
    assert last.startswith(f"asyncflow: CheckpointError: writing checkpoint step 2 to {staging} failed: "
                           "[Errno 28] No space left on device"), last
    assert last.endswith(f"; last checkpoint: {run / 'checkpoints' / 'step_000001'} (continue with --resume)"), last
    assert not list(run.rglob(".tmp_*"))

    filler.unlink()
    assert main(["train", str(config), "--resume", "--no-progress", "--set", "train.steps=2"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    assert CheckpointDir(run / "checkpoints").latest().name == "step_000002"
