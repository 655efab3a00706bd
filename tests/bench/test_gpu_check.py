"""``python -m bench.gpu_check`` (``make gpu-check``'s run of the main job with every
algorithm) keeps working on machines without a GPU: every run's settings are a
valid configuration of the main job, and one run goes end to end on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.train import algorithm_in, load_config
from bench.gpu_check import ALGORITHMS, PER_ALGORITHM, STREAMING, _overrides, line
from workers.models import TinyModelConfig, save_tiny_model

MAIN_JOB = "examples/arith_grpo.toml"
TINY_JOB = """
output_dir = "unused"
[data.arithmetic]
digits = 2
train_size = 200
eval_size = 50
[sft]
steps = 20
batch_size = 32
evaluate = false
[sft.model]
hidden_size = 64
num_hidden_layers = 1
num_attention_heads = 2
head_dim = 32
[train]
prompts_per_step = 4
[algorithm]
name = "grpo"
sampling = { n = 2, max_new_tokens = 3 }
[pools]
main = { devices = 1 }
"""


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Stands in for the main job's SFT output (the same architecture, untrained)."""
    return str(save_tiny_model(tmp_path_factory.mktemp("sft_model"), TinyModelConfig(), seed=0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_run_is_a_valid_main_job(algorithm: str, sft_model: str, tmp_path: Path) -> None:
    args = argparse.Namespace(steps=15, eval_size=500, precision="bf16", device="cuda")
    for stream in (False, True) if algorithm in STREAMING else (False,):
        config = load_config(MAIN_JOB, _overrides(args, algorithm, stream, sft_model, tmp_path / "out"))
        assert config.sft is None and config.model.path == sft_model
        assert config.actor.precision == "bf16" and config.pools["main"].device == "cuda"
        assert config.train.steps == 15 and config.train.stream is stream
        assert algorithm_in(config).name == algorithm
        for key, value in PER_ALGORITHM.get(algorithm, {}).items():  # what the algorithm needs beyond the job's
            assert _setting(config, key) == value, (algorithm, key)


def _setting(config: object, key: str) -> object:
    """The value at a dotted override key (``"algorithm.sampling.n"``) of a loaded config."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_one_run_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(TINY_JOB)
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--config", str(job), "--out",
         str(tmp_path / "runs"), "--steps", "2", "--eval-size", "8", "--precision", "fp32", "--algorithms", "grpo",
         "--stream", "on", "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    (run,) = record["runs"]
    assert run["algorithm"] == "grpo" and run["stream"] is True and run["error"] is None
    assert run["steps"] == 2 and run["s_per_step"] > 0 and run["logprob_mismatch"] >= 0
    assert line(run) in done.stdout


def test_a_failed_run_reads_as_failed() -> None:
    failed = {"algorithm": "ppo", "stream": False, "error": "RemoteStageError: critic.update failed"}
    assert line(failed).startswith("ppo        batch  FAILED: RemoteStageError")
