"""What every algorithm loop shares: sampling and policy-update settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow._datastream import DataStream, collect
from channels import ConfigError
from workers.engines import PolicyLoss
from workers.rollout import SamplingParams

_CFG = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class PolicyConfig(msgspec.Struct, **_CFG):
    """The actor's objective, passed to ``actor.update`` each step."""

    clip_ratio: float = 0.2
    """PPO clip range of the probability ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None: same as ``clip_ratio``."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) bounding negative-advantage losses; None disables."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (0 disables it and the reference)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""

    def update_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``actor.update``."""
        loss = PolicyLoss(clip_ratio_low=self.clip_ratio, clip_ratio_high=self.clip_ratio_high,
                          dual_clip=self.dual_clip, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        return {"loss": loss}


class RolloutConfig(msgspec.Struct, **_CFG):
    """How the actor samples responses."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 16
    """Most tokens per response."""
    ignore_eos: bool = False
    """Run every response to its budget (``max_new_tokens``, or the prompt's own
    ``max_new_tokens`` column): fixed response lengths, for benchmarks."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"rollout.n must be >= 1, got {self.n}")

    def params(self, *, seed: int | None, greedy: bool = False) -> SamplingParams:
        """The actor's sampling parameters (its EOS comes from the model)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0 if greedy else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed, ignore_eos=self.ignore_eos)


def require_roles(roles: Mapping[str, Any], algo: str, *names: str) -> None:
    """Fail with the missing role's name before anything runs.

    Raises:
        ConfigError: a role the algorithm needs is not placed.
    """
    missing = [n for n in names if n not in roles]
    if missing:
        raise ConfigError(f"{algo} needs roles {list(names)}; missing {missing} (placed: {sorted(roles)})")


def whole(rows: Any) -> Any:
    """Every row of ``rows`` as one future: a stream collected (in row order), a
    future as is. Stages that need the whole batch (GAE's whitening-free
    per-row math is fine either way; updates shuffle mini-batches) take this."""
    return collect(rows) if isinstance(rows, DataStream) else rows
