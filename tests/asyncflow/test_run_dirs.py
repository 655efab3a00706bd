"""What a run keeps under ``output_dir``: a ``version_<n>`` directory per run with
``latest`` linking the newest, caches keyed by their settings, checkpoints that a
failed write (a full disk) never leaves half-made, and ``--resume`` refused before
anything starts when there is nothing to continue. No Ray is started here (the
runs themselves: ``test_run_dirs_on_cpu.py``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import ray

import asyncflow.train._start_model as start_model
from asyncflow import RemoteStageError
from asyncflow.cli import main
from asyncflow.train import CheckpointDir, CheckpointError, RunDirs, Trainer, load_config
from asyncflow.train._checkpoint import staged
from asyncflow.train._rundir import RunLock, changed_settings, save_settings
from channels import ConfigError
from disk_faults import enospc, state_json_on_a_full_disk

SFT_JOB = """
output_dir = "{out}"
[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8
[sft]
steps = 2
[algorithm]
name = "grpo"
[pools]
main = {{ devices = 1 }}
"""


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these for the Ray it would start; undo that for later tests.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_sft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if an SFT warm start or Ray starts."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("refused too late: the SFT warm start (or Ray) started")

    monkeypatch.setattr(start_model, "sft_warm_start", refuse)
    monkeypatch.setattr(ray, "init", refuse)


def _sft_job(tmp: Path) -> Path:
    path = tmp / "job.toml"
    path.write_text(SFT_JOB.format(out=tmp / "out"))
    return path


def test_each_run_gets_the_next_version_and_latest_links_it(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path / "out")
    assert runs.versions() == [] and runs.latest() is None
    first, second = runs.new(), runs.new()
    assert (first.name, second.name) == ("version_0", "version_1")
    assert os.readlink(tmp_path / "out" / "latest") == "version_1"  # relative: the tree can move
    assert runs.latest() == second and runs.versions() == [first, second]
    (tmp_path / "out" / "version_7").mkdir()  # made by hand: numbering goes on after it
    assert runs.new().name == "version_8"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "latest", "version_0", "version_1", "version_7", "version_8"]  # no temporary link left


def test_clean_deletes_the_runs_and_keeps_the_caches(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path)
    runs.new()
    runs.new()
    (tmp_path / "sft_model-0123456789ab").mkdir()
    assert [p.name for p in runs.clean()] == ["version_0", "version_1"]
    assert [p.name for p in tmp_path.iterdir()] == ["sft_model-0123456789ab"]
    assert runs.new().name == "version_0"


def _checkpoint(run: Path, step: int) -> Path:
    """A complete checkpoint of ``run`` at ``step`` (its state file: what makes one complete)."""
    path = run / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(f'{{"step": {step}}}')
    return path


def test_resume_continues_the_newest_run_with_a_checkpoint(tmp_path: Path) -> None:
    runs = RunDirs(tmp_path)
    with pytest.raises(ConfigError, match="--resume: no run under"):
        runs.to_resume(steps=10)
    first = runs.new()
    with pytest.raises(ConfigError, match=rf"--resume: no complete checkpoint under {first / 'checkpoints'};"):
        runs.to_resume(steps=10)
    kept = _checkpoint(first, 4)
    second, third = runs.new(), runs.new()  # both ended before their first checkpoint
    assert runs.to_resume(steps=10) == (first, kept)
    assert os.readlink(tmp_path / "latest") == "version_0"  # latest links the run resumed again
    assert runs.to_resume(steps=10) == (first, kept)
    newer = _checkpoint(second, 2)
    assert runs.to_resume(steps=10) == (second, newer)
    assert os.readlink(tmp_path / "latest") == "version_1" and third.is_dir()  # nothing deleted


def test_a_run_keeps_its_settings_and_a_resume_names_those_it_changes(tmp_path: Path) -> None:
    job = _sft_job(tmp_path)
    run = RunDirs(tmp_path / "out").new()
    assert changed_settings(run, load_config(job, {})) == []  # a run from before settings were kept
    save_settings(run, load_config(job, {}))
    assert changed_settings(run, load_config(job, {})) == []
    # The budget, checkpoints and traces may change; what the run computes may not unnoticed.
    again = load_config(job, {"train.steps": 50, "train.checkpoint_every": 5, "train.max_seconds": 10.0})
    assert changed_settings(run, again) == []
    other = load_config(job, {"seed": 99, "algorithm.policy.kl_coef": 0.1, "data.arithmetic.train_size": 30})
    assert changed_settings(run, other) == ["algorithm.policy.kl_coef: 0.0 -> 0.1", "data.arithmetic.train_size: 40 -> 30",
                                            "seed: 0 -> 99"]


def test_a_ctrl_c_outside_the_rl_steps_ends_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    import asyncflow.cli as cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt  # as Ctrl-C during the start-up, an SFT warm start or the last evaluation

    monkeypatch.setattr(cli, "_sft", interrupted)
    assert main(["sft", str(_sft_job(tmp_path))]) == 130
    assert capsys.readouterr().err == "asyncflow: interrupted (Ctrl-C) during `asyncflow sft`\n"
    with pytest.raises(KeyboardInterrupt):  # --debug shows where
        main(["sft", str(_sft_job(tmp_path)), "--debug"])


def test_a_run_in_use_is_neither_resumed_nor_cleaned_by_another(tmp_path: Path, capsys, no_sft) -> None:
    job = _sft_job(tmp_path)
    run = RunDirs(tmp_path / "out").new()
    _checkpoint(run, 2)
    lock = RunLock(run)
    assert RunLock.holder(run) is None
    lock.acquire()  # as the run that writes there holds it (another open file: refused here as well)
    try:
        assert RunLock.holder(run) == str(os.getpid())
        assert main(["train", str(job), "--resume"]) == 2
        assert capsys.readouterr().err == (f"asyncflow: configuration error: {run} is in use by another asyncflow "
                                           f"run (process {os.getpid()}); wait for it to end or stop it\n")
        assert main(["train", str(job), "--clean"]) == 2
        assert capsys.readouterr().err == (f"asyncflow: configuration error: --clean: {run} is in use by another "
                                           f"asyncflow run (process {os.getpid()}); wait for it to end or stop it\n")
        assert run.is_dir()
    finally:
        lock.release()
    assert RunLock.holder(run) is None
    # Released: the resume goes on to the next check (here the refused SFT warm start).
    with pytest.raises(AssertionError, match="refused too late"):
        main(["train", str(job), "--resume"])
    assert RunLock.holder(run) is None  # a run that ended by an error let it go too


def test_resume_and_clean_together_are_refused(tmp_path: Path) -> None:
    config = load_config(_sft_job(tmp_path), {})
    with pytest.raises(ConfigError, match="--clean would delete the run --resume continues"):
        Trainer(config, resume=True, clean=True)


def test_resume_without_a_run_is_refused_before_the_sft_warm_start(tmp_path: Path, capsys, no_sft) -> None:
    job = _sft_job(tmp_path)
    assert main(["train", str(job), "--resume"]) == 2
    assert capsys.readouterr().err == (f"asyncflow: configuration error: --resume: no run under {tmp_path / 'out'} "
                                       "to continue; start one without --resume\n")
    assert not (tmp_path / "out").exists()

    RunDirs(tmp_path / "out").new()  # a run that stopped before its first checkpoint
    assert main(["train", str(job), "--resume"]) == 2
    assert capsys.readouterr().err == (
        "asyncflow: configuration error: --resume: no complete checkpoint under "
        f"{tmp_path / 'out' / 'version_0' / 'checkpoints'}; start a new run without --resume\n")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["latest", "version_0"]  # no SFT model


def test_resume_past_the_configured_steps_is_refused_before_anything_starts(tmp_path: Path, capsys, no_sft) -> None:
    job = _sft_job(tmp_path)
    step = _checkpoint(tmp_path / "out" / "version_0", 6)
    assert main(["train", str(job), "--resume", "--set", "train.steps=2"]) == 2
    assert capsys.readouterr().err == (f"asyncflow: configuration error: --resume: {step} is step 6, past "
                                       "train.steps = 2; raise train.steps to train on\n")


@pytest.mark.parametrize(("where", "said"), [
    ("a file", "is a file, not a directory"),
    ("under a file", "lies under a file, not a directory"),
    ("/sys/asyncflow-out", "cannot be made: "),  # then the system's reason (EPERM as root, else EACCES)
])
def test_an_output_dir_that_cannot_be_a_directory_is_named_before_anything_starts(
        tmp_path: Path, capsys, no_sft, where: str, said: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    out = {"a file": afile, "under a file": afile / "out"}.get(where, Path(where))
    job = _sft_job(tmp_path)
    for command in (["train", str(job)], ["sft", str(job)]):
        assert main([*command, "--set", f"output_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"asyncflow: configuration error: output_dir = '{out}' {said}"), err
        assert err.endswith("; name a directory\n" if where != "/sys/asyncflow-out"
                            else "; name a directory this user may write\n"), err
        assert err.count("\n") == 1, err  # one line, no traceback


def test_sft_warm_starts_with_other_settings_keep_their_own_directories(tmp_path: Path, monkeypatch) -> None:
    trained: list[int] = []

    def fake_sft(out: Path, config: object, task: object, episodes: object = None) -> dict[str, float]:
        trained.append(config.steps)  # type: ignore[attr-defined]
        out.mkdir(parents=True)
        (out / "config.json").write_text(str(config.steps))  # type: ignore[attr-defined]
        return {"loss": 0.0}

    monkeypatch.setattr(start_model, "sft_warm_start", fake_sft)
    job = _sft_job(tmp_path)
    two = Trainer(load_config(job, {}), say=lambda line: None).model_dir()
    three = Trainer(load_config(job, {"sft.steps": 3}), say=lambda line: None).model_dir()
    again = Trainer(load_config(job, {}), say=lambda line: None).model_dir()
    assert two != three and again == two and trained == [2, 3]  # the first kept, and reused
    assert Path(two).name.startswith("sft_model-") and (Path(two) / "config.json").read_text() == "2"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([Path(two).name, Path(three).name])


def _two_checkpoints(tmp_path: Path) -> CheckpointDir:
    checkpoints = CheckpointDir(tmp_path / "checkpoints", keep=2)
    for step in (1, 2):
        with staged(f"writing checkpoint step {step}", checkpoints.staging(step)) as tmp:
            (tmp / "actor").mkdir()
            checkpoints.commit(tmp, step, {"step": step})
    return checkpoints


@pytest.mark.parametrize("where", ["the staging directory", "a shard in a worker", "state.json"])
def test_a_full_disk_keeps_the_last_checkpoint_and_leaves_nothing_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    checkpoints = _two_checkpoints(tmp_path)
    tmp = checkpoints.staging(3)
    if where == "the staging directory":
        real_mkdir = Path.mkdir

        def mkdir(self: Path, *args: object, **kwargs: object) -> None:
            if self == tmp:
                raise enospc(self)
            real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "mkdir", mkdir)
        cause = f"[Errno 28] No space left on device: '{tmp}'"
    elif where == "state.json":
        monkeypatch.setattr("disk_faults.FAILING_CHECKPOINT", tmp.name)
        monkeypatch.setattr(Path, "write_text", state_json_on_a_full_disk(Path.write_text))
        cause = f"[Errno 28] No space left on device: '{tmp / 'state.json'}'"
    else:
        cause = "[Errno 28] No space left on device"
    with pytest.raises(CheckpointError) as failed:
        with staged("writing checkpoint step 3", tmp, then=lambda: "last checkpoint: step 2") as staging:
            (staging / "actor").mkdir()
            (staging / "actor" / "__0_0.distcp").write_bytes(b"cut short")
            if where == "a shard in a worker":  # as the driver gets it from the actor's rank 0
                raise RemoteStageError(role="actor", method="save_checkpoint", rank=0, pool="main",
                                       cause="OSError: ...", error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            checkpoints.commit(staging, 3, {"step": 3})
    assert str(failed.value) == f"writing checkpoint step 3 to {tmp} failed: {cause}; last checkpoint: step 2"
    assert not tmp.exists()
    assert checkpoints.latest() == tmp_path / "checkpoints" / "step_000002"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    assert CheckpointDir.state(checkpoints.latest()) == {"step": 2}


def test_other_errors_pass_through_and_the_staging_directory_goes(tmp_path: Path) -> None:
    checkpoints = _two_checkpoints(tmp_path)
    with pytest.raises(ValueError, match="a bug"), staged("writing checkpoint step 3", checkpoints.staging(3)):
        raise ValueError("a bug")
    assert not checkpoints.staging(3).exists()
    assert [p.name for p in checkpoints.complete()] == ["step_000001", "step_000002"]


def test_saving_a_step_again_replaces_it_and_old_ones_are_pruned(tmp_path: Path) -> None:
    checkpoints = _two_checkpoints(tmp_path)
    with staged("writing checkpoint step 2", checkpoints.staging(2)) as tmp:
        checkpoints.commit(tmp, 2, {"step": 2, "again": True})
    with staged("writing checkpoint step 3", checkpoints.staging(3)) as tmp:
        checkpoints.commit(tmp, 3, {"step": 3})
    assert [p.name for p in checkpoints.complete()] == ["step_000002", "step_000003"]
    assert CheckpointDir.state(checkpoints.complete()[0]) == {"step": 2, "again": True}
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["latest", "step_000002", "step_000003"]
