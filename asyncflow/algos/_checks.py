"""Checks of algorithm settings, each failing with a :class:`ConfigError` that names
the key as the user wrote it (``algorithm.sampling.top_p``), says what is wrong and
how to fix it. The trainer's own sections use the number checks too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from channels import ConfigError

if TYPE_CHECKING:
    from asyncflow.algos._common import PolicyConfig, SamplingConfig


# ----- numbers -----

def _fail(key: str, value: object, want: str, fix: str) -> None:
    raise ConfigError(f"{key} must be {want}, got {value!r}" + (f"; {fix}" if fix else ""))


def finite(key: str, value: float, fix: str) -> None:
    """``value`` is a finite number (an int passes).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        _fail(key, value, "a finite number", fix)


def at_least(key: str, value: float, low: float, fix: str = "") -> None:
    """``value >= low`` (and finite).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    finite(key, value, fix)
    if not value >= low:  # also refuses NaN
        _fail(key, value, f">= {low}", fix)


def above(key: str, value: float, low: float, fix: str = "") -> None:
    """``value > low`` (and finite).

    Raises:
        ConfigError: naming ``key``, the value and ``fix``.
    """
    finite(key, value, fix)
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


# ----- settings every algorithm shares -----

def check_sampling(key: str, sampling: SamplingConfig) -> None:
    """Sampling settings (``sampling.n`` checks itself).

    Raises:
        ConfigError: naming the key, e.g. ``algorithm.sampling.top_p``.
    """
    at_least(f"{key}.max_new_tokens", sampling.max_new_tokens, 1,
             "a response needs at least one token (its EOS); raise it to the longest answer plus one")
    at_least(f"{key}.temperature", sampling.temperature, 0, "use 1.0 to sample as the model predicts, 0 for greedy")
    within(f"{key}.top_p", sampling.top_p, 0, 1, open_low=True, fix="use 1.0 to turn nucleus sampling off")
    at_least(f"{key}.top_k", sampling.top_k, 0, "use 0 to turn top-k sampling off")


def check_policy(key: str, policy: PolicyConfig) -> None:
    """The actor's loss settings.

    Raises:
        ConfigError: naming the key, e.g. ``algorithm.policy.clip_ratio``.
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


def check_group_size(n: int, why: str) -> None:
    """``algorithm.sampling.n`` is at least 2 (a group-baseline algorithm compares
    the samples of one prompt).

    Raises:
        ConfigError: naming the key, the value and ``why``.
    """
    if n < 2:
        raise ConfigError(f"algorithm.sampling.n must be >= 2, got {n}: {why}")
