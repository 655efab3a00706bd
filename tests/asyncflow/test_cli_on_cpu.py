"""``asyncflow train``: resume reproduces an uninterrupted run, and user errors end
in one clear message (no hang, no traceback)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncflow.cli import main
from asyncflow.train import load_config, read_metrics
from asyncflow.train._signals import ONE_REQUEST_S
from channels import ConfigError
from support import config_file, wait_for_a_checkpoint
from workers.models import TinyModelConfig, save_tiny_model

EXAMPLE = Path(__file__).parents[2] / "examples" / "arith_grpo.toml"

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)

CONFIG = """
output_dir = "{out}"
seed = 3

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8

[train]
steps = {steps}
prompts_per_step = 4
checkpoint_every = 2
eval_size = 8

[algorithm]
name = "grpo"
sampling = {{ n = 2, temperature = 1.0, max_new_tokens = 3 }}

[actor]
lr = 1e-3
micro_batch_size = 8

[pools]
main = {{ devices = 1 }}
"""


pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's runs


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these for the Ray it starts; later tests' Ray must not inherit them.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _config(tmp: Path, model: str, *, steps: int, name: str, extra: str = "") -> Path:
    path = config_file(tmp, name)
    path.write_text(CONFIG.format(out=tmp / name, model=model, steps=steps) + extra)
    return path


def _comparable(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def test_resumed_run_repeats_the_uninterrupted_next_step(tmp_path, model_dir, capsys) -> None:
    full = _config(tmp_path, model_dir, steps=3, name="full")
    assert main(["train", str(full), "--no-progress", "--trace"]) == 0  # tracing changes no number
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("accuracy: ")
    assert (tmp_path / "full" / "latest" / "curves.png").exists()
    assert (tmp_path / "full" / "latest" / "timeline.png").exists()
    assert json.loads((tmp_path / "full" / "latest" / "trace.json").read_text())["traceEvents"]

    part = _config(tmp_path, model_dir, steps=2, name="part")
    assert main(["train", str(part), "--no-progress"]) == 0
    assert main(["train", str(part), "--resume", "--set", "train.steps=3", "--no-progress"]) == 0
    expected = read_metrics(tmp_path / "full" / "latest" / "metrics.jsonl")
    got = read_metrics(tmp_path / "part" / "latest" / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert _comparable(got[3]) == _comparable(expected[3])  # step 3, bit for bit
    state = json.loads((tmp_path / "part" / "latest" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["step"] == 3


def test_malformed_config_names_the_key(tmp_path, model_dir, capsys) -> None:
    bad = _config(tmp_path, model_dir, steps=1, name="bad", extra="\n[critic]\nlrr = 0.1\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "lrr" in err and "$.critic" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"\$\.actor\.lr"):
        load_config(bad, {"actor.lr": "fast"})


def test_empty_data_set_is_refused(tmp_path, model_dir, capsys) -> None:
    cfg = _config(tmp_path, model_dir, steps=1, name="empty")
    assert main(["train", str(cfg), "--set", "data.arithmetic.train_size=0"]) == 2
    assert "train_size" in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_refused(tmp_path, capsys) -> None:
    short = str(save_tiny_model(tmp_path / "short", TinyModelConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
        num_hidden_layers=1, max_position_embeddings=6), seed=0))
    cfg = _config(tmp_path, short, steps=1, name="long")
    assert main(["train", str(cfg), "--set", "data.arithmetic.digits=3"]) == 2
    err = capsys.readouterr().err
    assert "> the model's max_position_embeddings=6; lower algorithm.sampling.max_new_tokens or " \
           "data.arithmetic.digits, or start from a model with a longer context" in err, err


def test_raising_reward_function_is_named_with_the_sample(tmp_path, model_dir, capsys, monkeypatch) -> None:
    # Ray's workers inherit this environment: they can import the test's reward module.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = _config(tmp_path, model_dir, steps=1, name="raising",
                  extra='\n[reward]\nfunction = "support:raising_reward"\n')
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    # The message that names the failing sample (its index, uid and text), not the
    # fallback for a function that fails on a batch only.
    named = re.search(r"reward function support:raising_reward raised on sample 0 of the 8 on this rank "
                      r"\(uid \d+\): ZeroDivisionError: reward bug; prompt=.+ response=.* answer=.+; "
                      r"fix the function so that it scores this sample", err)
    assert named, err
    assert "on none of them alone" not in err, err


BREAKS_AFTER_A_CHECKPOINT = """
import time
from pathlib import Path

def reward(prompts, completions, answer):
    if Path({checkpoint!r}).exists():
        {breaks}
    return [float(c == a) for c, a in zip(completions, answer)]
"""

BREAKS = {"raises": ('raise ValueError("broke after the first checkpoint")',
                     r"reward function breaks_later:reward raised on sample 0 of the 8 on this rank \(uid \d+\): "
                     r"ValueError: broke after the first checkpoint; "),
          "hangs": ("time.sleep(30)",  # past [reward] timeout_s; the worker's thread ends on its own later
                    r"reward function breaks_later:reward did not return within its timeout_s of 1 s on the 8 "
                    r"samples on this rank \(uids \d+, ")}


@pytest.mark.parametrize("breaks", BREAKS)
def test_a_step_that_fails_names_the_checkpoint_to_continue_from(tmp_path, model_dir, capsys, breaks: str) -> None:
    """A reward function that raises, or hangs past its timeout, from step 3 on
    (once step 2's checkpoint is written): its error's line, then the last step
    logged and the checkpoint that ``--resume`` continues from, once it is fixed."""
    code, message = BREAKS[breaks]
    checkpoints = tmp_path / "breaking" / "version_0" / "checkpoints"
    (tmp_path / "breaks_later.py").write_text(
        BREAKS_AFTER_A_CHECKPOINT.format(checkpoint=str(checkpoints / "latest"), breaks=code))
    cfg = tmp_path / "breaking.toml"  # beside its module: the workers import it from the config's directory
    cfg.write_text(CONFIG.format(out=tmp_path / "breaking", model=model_dir, steps=6)
                   + '\n[reward]\nfunction = "breaks_later:reward"\ntimeout_s = 1\n')
    assert main(["train", str(cfg), "--no-progress"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, lines[-2]), lines
    assert lines[-1] == (f"asyncflow: the run stopped after step 2; last checkpoint: {checkpoints / 'step_000002'} "
                         "(continue with --resume)"), lines
    assert [r["step"] for r in read_metrics(tmp_path / "breaking" / "latest" / "metrics.jsonl")] == [0, 1, 2]


def _start(tmp_path: Path, run: Path, name: str, *, group: bool = False) -> tuple[subprocess.Popen[str], Path]:
    """``asyncflow train run`` in a subprocess, its stderr in ``<name>.stderr``; with
    ``group``, leading a process group of its own (as a shell's job, or ``timeout``'s)."""
    paths = [str(Path(__file__).parents[2]), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the package, and support's rewards
    err = tmp_path / f"{name}.stderr"
    with (tmp_path / f"{name}.stdout").open("w") as out_file, err.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(run), "--no-progress"],
                                stdout=out_file, stderr=err_file, text=True, env=env, start_new_session=group)
    return proc, err


def _ended_in_one_line(proc: subprocess.Popen[str], err_path: Path, workers: list[psutil.Process],
                       *, never: str) -> str:
    """Wait for ``proc``; check it failed (exit 1) without a traceback or ``never`` on
    stderr and left no worker behind; its last stderr line."""
    proc.wait(timeout=120)
    err = err_path.read_text()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and never not in err, err
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.name() for p in alive]
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_sigterm_stops_after_the_step_with_its_checkpoint_and_a_second_signal_at_once(tmp_path, model_dir) -> None:
    """A preempted run (SIGTERM) finishes its step, checkpoints it and exits with one
    line naming that checkpoint, which ``--resume`` continues from; two SIGINTs
    (Ctrl-C twice) stop it at once, keeping the last checkpoint. Ray's own handler
    (a native stack trace) never runs, and no worker outlives the command."""
    run = _config(tmp_path, model_dir, steps=10_000, name="run")
    proc, err_path = _start(tmp_path, run, "run")
    wait_for_a_checkpoint(proc, tmp_path / "run" / "latest" / "checkpoints", err_path)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    last = _ended_in_one_line(proc, err_path, workers, never="SIGTERM received")  # Ray's native trace
    latest = (tmp_path / "run" / "latest" / "checkpoints" / "latest").read_text().strip()
    step = json.loads((tmp_path / "run" / "latest" / "checkpoints" / latest / "state.json").read_text())["step"]
    assert last == (f"asyncflow: RunInterruptedError: stopped by SIGTERM after step {step}; last checkpoint: "
                    f"{tmp_path / 'run' / 'version_0' / 'checkpoints' / latest} (continue with --resume)")
    assert latest == f"step_{step:06d}"
    assert main(["train", str(run), "--resume", "--set", f"train.steps={step + 1}", "--no-progress"]) == 0
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")]
    assert steps[-1] == step + 1 and steps.count(step) == 1  # the stopped step's row, once

    # Steps of over 2 s (the reward sleeps), so that the second Ctrl-C, sent once the
    # first is acknowledged, comes in the middle of one. (Two signals sent at once
    # would reach Python as one.)
    again = _config(tmp_path, model_dir, steps=10_000, name="again",
                    extra='\n[reward]\nfunction = "support:sleepy_reward"\n')
    proc, err_path = _start(tmp_path, again, "again")
    wait_for_a_checkpoint(proc, tmp_path / "again" / "latest" / "checkpoints", err_path)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    out_path = tmp_path / "again.stdout"
    deadline = time.monotonic() + 60
    while "SIGINT: stopping after this step" not in out_path.read_text() + err_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.01)
    time.sleep(ONE_REQUEST_S)  # a second Ctrl-C, not the first delivered twice
    proc.send_signal(signal.SIGINT)
    last = _ended_in_one_line(proc, err_path, workers, never="KeyboardInterrupt")
    assert last.startswith("asyncflow: RunInterruptedError: stopped by SIGINT twice, during a step; last checkpoint: ")


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "line"), [
    (signal.SIGINT, "asyncflow: interrupted (Ctrl-C) during `asyncflow train`"),
    (signal.SIGTERM, "asyncflow: RunInterruptedError: stopped by SIGTERM before the RL steps; nothing of the run was "
                     "written yet (rerun from the start)"),
])
def test_a_signal_during_the_warm_start_ends_the_run_at_once(tmp_path, sig: signal.Signals, line: str) -> None:
    """The SFT warm start runs on the driver's event loop, where the loop's signal
    handlers would run only at its end (a Ctrl-C waited for the whole warm start,
    a SIGTERM met Ray's handler: native stack dumps, exit 134)."""
    run = tmp_path / "sft.toml"
    run.write_text(EXAMPLE.read_text().replace('output_dir = "runs/arith-grpo"', f'output_dir = "{tmp_path / "out"}"')
                   .replace("steps = 2000", "steps = 1000000").replace("max_seconds = 150", "max_seconds = 3600"))
    proc, err_path = _start(tmp_path, run, "sft")
    out_path = tmp_path / "sft.stdout"
    deadline = time.monotonic() + 120
    while "SFT warm start: up to" not in out_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.05)
    time.sleep(1)  # inside the warm start's steps
    spawned = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)  # not the warm start's hour
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_path.read_text()
    assert proc.returncode == (130 if sig == signal.SIGINT else 1), err
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err and "SIGTERM received" not in err, err
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, [p.name() for p in alive]


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_ends_the_run_in_one_line_at_once(tmp_path, model_dir) -> None:
    """``timeout``, a shell's job control or a process manager signal the command's
    whole process group: Ray's own processes (started by the run, in its group) end
    at once, and the step under way with them. The run still ends within seconds
    (asking the gone cluster would wait a minute and abort), in one line naming the
    checkpoint, and leaves no process behind."""
    run = _config(tmp_path, model_dir, steps=10_000, name="run")
    proc, err_path = _start(tmp_path, run, "run", group=True)
    wait_for_a_checkpoint(proc, tmp_path / "run" / "latest" / "checkpoints", err_path)
    spawned = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    last = _ended_in_one_line(proc, err_path, spawned, never="Failed to connect to GCS")
    checkpoint = tmp_path / "run" / "version_0" / "checkpoints"
    latest = checkpoint / (checkpoint / "latest").read_text().strip()
    assert last.startswith("asyncflow: RunInterruptedError: stopped by SIGTERM"), last
    assert last.endswith(f"last checkpoint: {latest} (continue with --resume)"), last


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_in_one_line_and_resume_continues(tmp_path, model_dir) -> None:
    """SIGKILL a worker of a running ``asyncflow train``: it exits non-zero with one
    line naming the dead rank and the last checkpoint; ``--resume`` goes on from
    there exactly as an uninterrupted run does."""
    run = _config(tmp_path, model_dir, steps=10_000, name="run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    # Output goes to files, not pipes: nobody reads a pipe while the run goes on,
    # and a full pipe would block the run (a hang that looks like ours).
    out_file, err_file = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(run), "--no-progress"],
                            stdout=out_file, stderr=err_file, text=True, env=env)
    wait_for_a_checkpoint(proc, tmp_path / "run" / "latest" / "checkpoints", tmp_path / "stderr.txt")
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("ray::WorkerProcess")]
    assert workers
    workers[0].send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    out_file.close()
    err_file.close()
    err = (tmp_path / "stderr.txt").read_text()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert last.startswith("asyncflow: RunInterruptedError: ") and "rank 0 in pool 'main' on node " in last
    assert " (127.0.0.1) died" in last  # "during role.method" when a call was running
    checkpoint = (tmp_path / "run" / "latest" / "checkpoints" / "latest").read_text().strip()
    assert f"last checkpoint: {tmp_path / 'run' / 'version_0' / 'checkpoints' / checkpoint}" in last

    resumed_from = json.loads((tmp_path / "run" / "latest" / "checkpoints" / checkpoint / "state.json").read_text())["step"]
    target = resumed_from + 2
    assert main(["train", str(run), "--resume", "--set", f"train.steps={target}", "--no-progress"]) == 0
    reference = _config(tmp_path, model_dir, steps=target, name="reference")
    assert main(["train", str(reference), "--no-progress"]) == 0
    got = {r["step"]: r for r in read_metrics(tmp_path / "run" / "latest" / "metrics.jsonl")}
    want = {r["step"]: r for r in read_metrics(tmp_path / "reference" / "latest" / "metrics.jsonl")}
    for step in (resumed_from + 1, target):
        assert _comparable(got[step]) == _comparable(want[step]), step
