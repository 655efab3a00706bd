"""Checks of run-configuration values, each failing with a :class:`ConfigError` that
names the key as the user wrote it (``actor.lr``, ``placement.critic.t``), says what is
wrong and how to fix it.

:func:`~asyncflow.train._validate.validate` uses them for what no section can check
alone: the layouts against the pools and the model, and the reward functions,
imported here in the driver so that a bad one fails before Ray starts rather than
as a worker's start-up error. Numbers and the algorithms' settings are checked by
:mod:`asyncflow.algos._checks` and each algorithm's own check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from channels import ConfigError
from workers.models import read_architecture, read_gguf_header
from workers.rewards import load_reward_fn

MODEL_ROLES = ("actor", "ref", "critic", "cost_critic")
"""Roles that load the policy's model (and so may split it by tensor parallelism)."""
ROLLOUT_ROLE = "rollout"
"""The role that generates on its own pool (``[placement] rollout``), from the actor's weights."""


# ----- models and layouts -----

def model_heads(key: str, model_dir: str) -> tuple[int, int]:
    """Check that ``model_dir`` holds a supported Hugging Face checkpoint.

    Args:
        key: the config key that names the directory (``model.path``).
        model_dir: the directory.

    Returns:
        The model's ``(num_attention_heads, num_key_value_heads)``.

    Raises:
        ConfigError: the directory does not exist, has no ``config.json``, or holds an
            unsupported or unreadable model.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"{key} = {model_dir!r} is not a directory; point it at a Hugging Face model "
                          "directory, or leave it out and add [sft] for a warm start")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key} = {model_dir!r} has no config.json; point it at a Hugging Face model "
                          "directory (save_tiny_model and the SFT warm start write one)")
    try:
        architecture = read_architecture(path)
    except ConfigError as e:
        raise ConfigError(f"{key} = {model_dir!r}: {str(e).splitlines()[0]}") from None
    return architecture.num_attention_heads, architecture.num_key_value_heads


def gguf_heads(key: str, file: str) -> tuple[int, int]:
    """Check that ``file`` is a GGUF file of a supported architecture, reading only
    its header (:func:`workers.models.read_gguf_header`; the weights are dequantised
    when the run starts).

    Returns:
        The model's ``(num_attention_heads, num_key_value_heads)``.

    Raises:
        ConfigError: naming ``key``.
    """
    header = read_gguf_header(file, key=key)
    return header.num_attention_heads, header.num_key_value_heads


def check_tensor_parallel(role: str, t: int, heads: tuple[int, int], model: str) -> None:
    """A model role's tensor-parallel size splits the attention heads evenly.

    Args:
        role: the placed role.
        t: its tensor-parallel size.
        heads: the model's ``(num_attention_heads, num_key_value_heads)``.
        model: the key the heads come from, for the message (``sft.model``).

    Raises:
        ConfigError: naming ``placement.{role}.t``.
    """
    for name, n in zip(("num_attention_heads", "num_key_value_heads"), heads, strict=True):
        if n % t:
            raise ConfigError(f"placement.{role}.t = {t} must divide the model's {name} ({n}, from {model}); "
                              f"use a t that divides {n}, or t = 1 and more data-parallel devices")


# ----- reward functions -----

def load_score_function(key: str, spec: str) -> Callable[..., Any]:
    """Import a ``module:function`` reward (or cost) function in the driver, as the
    reward workers will (:func:`workers.rewards.load_reward_fn`).

    The caller puts the config's module directories on ``sys.path`` first
    (:func:`asyncflow.train._user_modules.importable`), as the run does for the
    workers.

    Raises:
        ConfigError: naming ``key``: malformed, the module does not import, the
            attribute is missing or not callable.
    """
    return load_reward_fn(spec, key=key)
