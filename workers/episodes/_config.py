"""An episode's settings: the environment and the budgets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from channels import ConfigError
from workers.episodes._codec import ObservationFormat

__all__ = ["OUTCOMES", "EpisodeConfig", "outcome_code"]

OUTCOMES: tuple[str, ...] = ("done", "max_turns", "budget", "error", "timeout")
"""How an episode ended (its ``episode_outcome`` column holds the index):
``done`` (the environment said so), ``max_turns``, ``budget`` (the episode's tokens
ran out), ``error`` (the environment raised or broke its protocol) and ``timeout``
(an environment call outlived ``timeout_s``). The last two score 0."""

MAX_TURNS_LIMIT = 1024
"""Most turns an episode may have (the engine's sample index holds the turn)."""


def outcome_code(outcome: str) -> int:
    """The ``episode_outcome`` value of ``outcome``."""
    return OUTCOMES.index(outcome)


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """Multi-turn generation: each sample is an episode with an environment.

    Each turn samples at most the sampling settings' ``max_new_tokens`` and ends
    at EOS or a stop string (the sampling's, plus :attr:`stop`).
    """

    env: str | type
    """The environment class, ``"module:Class"`` (see ``workers.episodes``)."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class, for each episode's environment."""
    max_turns: int = 4
    """Most turns of the model in an episode."""
    max_tokens: int = 256
    """The episode's token budget after the prompt: the model's turns and the
    observations together (the rows' response width)."""
    timeout_s: float = 60.0
    """Longest an environment call may take."""
    on_error: Literal["end", "fail"] = "end"
    """An environment that raises or times out: ``"end"`` the episode (outcome
    ``error``/``timeout``, reward 0) or ``"fail"`` the call (and the step)."""
    format: ObservationFormat = "auto"
    """How observations are wrapped (``workers.episodes.ObservationCodec``)."""
    observation_role: str = "tool"
    """The chat role of observations (``format = "chat"``)."""
    text_template: str = "{observation}"
    """An observation's text (``format = "text"``)."""
    stop: tuple[str, ...] = ()
    """More stop strings that end a turn (e.g. ``"</tool_call>"``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.env, str | type) or not self.env:
            raise ConfigError(f"[env] class must be a 'module:Class' string, got {self.env!r}")
        if not isinstance(self.settings, Mapping):
            raise ConfigError(f"[env] settings must be a table of keyword arguments, got {self.settings!r}")
        for name, value, low in (("max_turns", self.max_turns, 1), ("max_tokens", self.max_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"[env] {name} must be an int >= {low}, got {value!r}")
        if self.max_turns > MAX_TURNS_LIMIT:
            raise ConfigError(f"[env] max_turns must be at most {MAX_TURNS_LIMIT}, got {self.max_turns}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"[env] timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.on_error not in ("end", "fail"):
            raise ConfigError(f"[env] on_error must be 'end' or 'fail', got {self.on_error!r}")
        if self.format not in ("auto", "chat", "text"):
            raise ConfigError(f"[env] format must be 'auto', 'chat' or 'text', got {self.format!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "settings", dict(self.settings))
