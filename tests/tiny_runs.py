"""The smallest GRPO run ``asyncflow train`` accepts, for the tests that run the
command itself: a 1-layer model saved once per module and a config built here,
so each test writes only what it changes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from workers.models import TinyModelConfig, save_tiny_model

TINY_MODEL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                             num_key_value_heads=1, head_dim=64, num_hidden_layers=1)


def save_model(path: Path) -> str:
    """:data:`TINY_MODEL` saved under ``path`` (seed 0); returns its directory."""
    return str(save_tiny_model(path, TINY_MODEL, seed=0))


def grpo_toml(out: Path, model: str, *, steps: int, seed: int = 3, train: Mapping[str, int] | None = None,
              pools: str = "main = { devices = 1 }", more: str = "") -> str:
    """A GRPO run of ``steps`` steps on 1-digit addition writing under ``out``.

    Args:
        train: ``[train]`` keys over the defaults (4 prompts a step, a checkpoint
            every 2 steps).
        pools: the ``[pools]`` table's lines.
        more: further tables, e.g. ``[placement]``, ``[reward]`` or ``[algorithm.policy]``.
    """
    keys = {"steps": steps, "prompts_per_step": 4, "checkpoint_every": 2, "eval_size": 8, **(train or {})}
    lines = "\n".join(f"{k} = {v}" for k, v in keys.items())
    return f"""
output_dir = "{out}"
seed = {seed}

[model]
path = "{model}"

[data.arithmetic]
digits = 1
train_size = 40
eval_size = 8

[train]
{lines}

[algorithm]
name = "grpo"
sampling = {{ n = 2, temperature = 1.0, max_new_tokens = 3 }}

[actor]
lr = 1e-3
micro_batch_size = 8

[pools]
{pools}
{more}
"""
