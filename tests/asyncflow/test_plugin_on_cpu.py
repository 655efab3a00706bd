"""An algorithm from an installed package: ``tests/plugin`` holds a package with an
``asyncflow.algorithms`` entry point (a ``.dist-info``, as pip would install it);
with it on the path, ``asyncflow train`` runs ``[algorithm] name = "group_mean"``
and nothing in asyncflow names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.models import TinyModelConfig, save_tiny_model

ROOT = Path(__file__).parents[2]
PLUGIN = ROOT / "tests" / "plugin"

CONFIG = """
output_dir = "{out}"

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8

[train]
steps = 2
prompts_per_step = 4
checkpoint_every = 0
eval_size = 8
kl_metric = false

[algorithm]
name = "group_mean"
scale = 0.5
sampling = {{ n = 2, max_new_tokens = 3 }}

[actor]
lr = 1e-3
micro_batch_size = 8

[pools]
main = {{ devices = 1 }}
"""


def _train(config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", str(config), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=280)


def test_an_entry_point_algorithm_trains_with_asyncflow_train(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=64, intermediate_size=128,
                                                                num_attention_heads=1, num_key_value_heads=1,
                                                                head_dim=64, num_hidden_layers=1), seed=0)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=tmp_path / "run", model=model))
    done = _train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asyncflow train: group_mean" in done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "latest" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "group_mean/scale" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["group_mean/scale"] == 0.5 for r in steps)
    assert all("actor/loss" in r for r in steps)

    # The plug-in's config is checked like a built-in's: an unknown key lists its keys.
    config.write_text(CONFIG.format(out=tmp_path / "run", model=model).replace("scale = 0.5", "scal = 0.5"))
    bad = _train(config)
    assert bad.returncode == 2
    assert "scal" in bad.stderr and "valid keys there" in bad.stderr and "'scale'" in bad.stderr


def test_an_entry_point_algorithm_trains_on_episodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plug-in's step calls ``actor.generate`` as before; with an ``[env]`` its
    samples are episodes, scored by their reward."""
    model = save_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=64, intermediate_size=128,
                                                                num_attention_heads=1, num_key_value_heads=1,
                                                                head_dim=64, num_hidden_layers=1), seed=0)
    config = tmp_path / "run.toml"
    env = '\n[env]\nclass = "support:DigitsEnv"\nsettings = { turns = 2 }\nmax_tokens = 16\n'
    config.write_text(CONFIG.format(out=tmp_path / "run", model=model) + env)
    # support.DigitsEnv, for the driver and its workers.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    done = _train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "latest" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "group_mean/scale" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episode/turns"] == 2 and r["episode/done"] == 1 for r in steps)
