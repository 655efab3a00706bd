"""A driver imports what it plans with, not the model stack: the trainer, the
algorithms and the role classes load no transformers model class (seconds of CPU in
every driver and worker process) until a model is built, and building one works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

_PROBE = """
import sys, tempfile
import asyncflow.algos, asyncflow.cli, asyncflow.train, workers.roles, workers.rollout
print("LOADED", sorted(m for m in ("transformers.modeling_utils", "transformers.models.llama.modeling_llama")
                       if m in sys.modules))
from workers.models import TinyModelConfig, load_model, save_tiny_model
with tempfile.TemporaryDirectory() as tmp:
    model = load_model(save_tiny_model(tmp, TinyModelConfig()))
print("BUILT", type(model).__name__, "transformers.modeling_utils" in sys.modules)
"""


def test_the_drivers_modules_load_no_model_class_until_a_model_is_built() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout.splitlines()
    assert out[-2] == "LOADED []"
    assert out[-1] == "BUILT LlamaForCausalLM True"
