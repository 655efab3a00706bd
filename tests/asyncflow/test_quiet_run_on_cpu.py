"""A tiny ``asyncflow train`` started from another directory than its config's:
the reward module beside the config imports in the driver and in the reward
worker, and the engines' log records below WARNING reach the run's
``engines.log``, not the terminal (a harmless warning neither, a real one once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_runs import grpo_toml, save_model

ROOT = Path(__file__).parents[2]

# Logs as an engine would, from the reward worker: every call (each step) the same
# records under the engines' logger names.
REWARD = '''
import logging

def score(prompts, responses, answers):
    logging.getLogger("vllm.engine").info("af-engine-info: KV cache ready")
    logging.getLogger("transformers.modeling").info("af-engine-info: loaded")
    logging.getLogger("vllm.reload").warning("RotaryEmbedding: Failed to load weights")
    logging.getLogger("vllm.engine").warning("af-engine-warning: the cache is small")
    return [float(r.strip() == a) for r, a in zip(responses, answers)]
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(tmp_path_factory.mktemp("model"))


def test_run_from_elsewhere_imports_the_reward_beside_the_config_and_keeps_engine_logs_in_the_run(
        tmp_path: Path, model_dir: str) -> None:
    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    configs.mkdir()
    elsewhere.mkdir()
    (configs / "af_beside_reward.py").write_text(REWARD)
    config = configs / "run.toml"
    config.write_text(grpo_toml(tmp_path / "out", model_dir, steps=2,
                                more='\n[reward]\nfunction = "af_beside_reward:score"\n'))
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCFLOW_LOG", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)  # the package only: not the config's directory
    proc = subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", str(config), "--no-progress"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal
    assert not re.search(r"\bINFO\b", terminal), terminal
    assert "af-engine-info" not in terminal and "Failed to load weights" not in terminal
    assert terminal.count("af-engine-warning: the cache is small") == 1  # once per process, not per step
    log = (tmp_path / "out" / "latest" / "engines.log").read_text()
    assert "INFO vllm.engine: af-engine-info: KV cache ready" in log
    assert "INFO transformers.modeling: af-engine-info: loaded" in log
    assert "RotaryEmbedding: Failed to load weights" in log
    assert not list((tmp_path / "out").glob(".engines-*.log"))  # moved into the run's directory
