"""Checks of run-configuration values, each failing with a :class:`ConfigError` that
names the key as the user wrote it (``actor.lr``, ``placement.critic.t``), says what is
wrong and how to fix it.

:mod:`asyncflow.train._config` uses them in two places: the sections' ``__post_init__``
(msgspec adds where the section is) and :func:`~asyncflow.train._config.validate`,
which checks what no ``__post_init__`` of ours can: the algorithms' settings (their
Structs live in :mod:`asyncflow.algos`), the layouts against the pools and the model,
and the reward functions, imported here in the driver so that a bad one fails before
Ray starts rather than as a worker's start-up error.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.algos import PolicyConfig, RolloutConfig, SafeRLHFConfig
from channels import ConfigError
from workers.models import check_supported_checkpoint
from workers.rewards import load_reward_fn

MODEL_ROLES = ("actor", "ref", "critic", "cost_critic")
"""Roles that load the policy's model (and so may split it by tensor parallelism)."""


# ----- numbers -----

def _fail(key: str, value: object, want: str, fix: str) -> None:
    raise ConfigError(f"{key} must be {want}, got {value!r}" + (f"; {fix}" if fix else ""))


def _finite(key: str, value: float, fix: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        _fail(key, value, "a finite number", fix)


def at_least(key: str, value: float, low: float, fix: str = "") -> None:
    """``value >= low`` (and finite).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    _finite(key, value, fix)
    if not value >= low:  # also refuses NaN
        _fail(key, value, f">= {low}", fix)


def above(key: str, value: float, low: float, fix: str = "") -> None:
    """``value > low`` (and finite).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    _finite(key, value, fix)
    if not value > low:
        _fail(key, value, f"> {low}", fix)


def within(key: str, value: float, low: float, high: float, *, open_low: bool = False, fix: str = "") -> None:
    """``low <= value <= high`` (``low < value`` with ``open_low``).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    inside = (low < value if open_low else low <= value) and value <= high
    if not inside:
        _fail(key, value, f"in {'(' if open_low else '['}{low}, {high}]", fix)


# ----- the algorithms' sections -----

def check_rollout(key: str, rollout: RolloutConfig) -> None:
    """Sampling settings (``rollout.n`` checks itself).

    Raises:
        ConfigError: naming the key, e.g. ``grpo.rollout.top_p``.
    """
    at_least(f"{key}.max_new_tokens", rollout.max_new_tokens, 1,
             "a response needs at least one token (its EOS); raise it to the longest answer plus one")
    at_least(f"{key}.temperature", rollout.temperature, 0, "use 1.0 to sample as the model predicts, 0 for greedy")
    within(f"{key}.top_p", rollout.top_p, 0, 1, open_low=True, fix="use 1.0 to turn nucleus sampling off")
    at_least(f"{key}.top_k", rollout.top_k, 0, "use 0 to turn top-k sampling off")


def check_policy(key: str, policy: PolicyConfig) -> None:
    """The actor's loss settings.

    Raises:
        ConfigError: naming the key, e.g. ``ppo.policy.clip_ratio``.
    """
    at_least(f"{key}.clip_ratio", policy.clip_ratio, 0, "0.2 is the usual PPO clip range")
    if policy.clip_ratio_high is not None:
        at_least(f"{key}.clip_ratio_high", policy.clip_ratio_high, 0,
                 "0.28 is DAPO's clip-higher; leave it out to use clip_ratio")
    if policy.dual_clip is not None:
        above(f"{key}.dual_clip", policy.dual_clip, 1, "3.0 is usual; leave it out to turn dual clip off")
    at_least(f"{key}.kl_coef", policy.kl_coef, 0, "use 0 to turn the KL loss term off")
    at_least(f"{key}.entropy_coef", policy.entropy_coef, 0, "use 0 to turn the entropy bonus off")


def check_gae(key: str, gamma: float, lam: float) -> None:
    """The discount and GAE lambda of a section.

    Raises:
        ConfigError: naming ``{key}.gamma`` or ``{key}.lam``.
    """
    within(f"{key}.gamma", gamma, 0, 1, fix="1.0 (no discount) is usual for LLM responses")
    within(f"{key}.lam", lam, 0, 1, fix="0.95 is usual")


def check_safe_rlhf(key: str, s: SafeRLHFConfig) -> None:
    """The Lagrange multiplier's and the pretraining term's settings.

    Raises:
        ConfigError: naming the key, e.g. ``safe_rlhf.lagrange_lr``.
    """
    _finite(f"{key}.cost_limit", s.cost_limit, "the expected cost the policy may spend, e.g. 0.0")
    at_least(f"{key}.lagrange_max", s.lagrange_max, 0, "100.0 is usual")
    within(f"{key}.lagrange_init", s.lagrange_init, 0, s.lagrange_max,
           fix=f"the multiplier starts in [0, {key}.lagrange_max]; 1.0 is usual")
    at_least(f"{key}.lagrange_lr", s.lagrange_lr, 0, "0.1 is usual; 0 keeps the multiplier fixed")
    if s.ptx_coef != 0:
        raise ConfigError(f"{key}.ptx_coef = {s.ptx_coef!r}: asyncflow train has no pretraining batches to mix "
                          "into the actor's loss; set it to 0 or leave it out")
    check_gae(key, s.gamma, s.lam)


# ----- models and layouts -----

def model_heads(key: str, model_dir: str) -> tuple[int, int]:
    """Check that ``model_dir`` holds a supported Hugging Face checkpoint.

    Args:
        key: the config key that names the directory (``model.dir``).
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
        hf = check_supported_checkpoint(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key} = {model_dir!r}: {str(e).splitlines()[0]}") from None
    heads = int(hf.num_attention_heads)
    return heads, int(getattr(hf, "num_key_value_heads", None) or heads)


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

    The workers find modules on their own ``sys.path`` and in the driver's working
    directory (Ray adds it), so the driver looks there too.

    Raises:
        ConfigError: naming ``key``: malformed, the module does not import, the
            attribute is missing or not callable.
    """
    cwd = os.path.abspath(os.curdir)
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return load_reward_fn(spec, key=key)
    finally:
        if added:
            sys.path.remove(cwd)
